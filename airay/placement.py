"""Resource discovery: what one worker's bundle asks for, and how many bundles fit now."""

from __future__ import annotations

import math


def default_worker_resources(cluster_resources: dict[str, float]) -> dict[str, float]:
    """One GPU per worker where the cluster has GPUs, else one CPU slot."""
    return {"GPU": 1.0} if cluster_resources.get("GPU", 0) > 0 else {"CPU": 1.0}


def bundles_that_fit(available_per_node: list[dict[str, float]], per_worker: dict[str, float]) -> int:
    """How many worker bundles fit in the nodes' free resources (bundles never span nodes)."""
    total = 0
    for free in available_per_node:
        fits = min((math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in per_worker.items()), default=0)
        total += max(0, fits)
    return total


def actor_options(per_worker: dict[str, float]) -> dict:
    """Ray actor options that consume exactly one bundle."""
    rest = {k: v for k, v in per_worker.items() if k not in ("CPU", "GPU", "memory")}
    opts = {"num_cpus": per_worker.get("CPU", 0.0), "num_gpus": per_worker.get("GPU", 0.0)}
    if "memory" in per_worker:
        opts["memory"] = per_worker["memory"]
    if rest:
        opts["resources"] = rest
    return opts


def available_per_node(exclude: set[str] | frozenset[str] = frozenset()) -> list[dict[str, float]]:
    """Free (unreserved) resources of each alive node, leaving out `exclude`d node ids.

    ray.available_resources() sums over nodes, which would let a bundle "fit" across two
    half-free nodes; Ray's per-node view (ray._private.state, stable since Ray 2.0) does not.
    """
    from ray._private.state import available_resources_per_node

    return [free for node, free in available_resources_per_node().items() if node not in exclude]


def avoid_nodes(node_ids: set[str], n_bundles: int) -> list[dict[str, str]] | None:
    """Ray label selectors (one per bundle) that keep a placement group off `node_ids`.

    Every Ray node carries the label ray.io/node-id (label scheduling, Ray 2.60), so this
    works on any cluster, not only on nodes airay started.
    """
    if not node_ids:
        return None
    return [{"ray.io/node-id": f"!in({','.join(sorted(node_ids))})"} for _ in range(n_bundles)]

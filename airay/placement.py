"""Resource discovery and demand: what one worker's bundle asks for, how many bundles fit now,
how a reservation is split into placement groups, and the standing demand the autoscaler sees."""

from __future__ import annotations

import math


def default_worker_resources(cluster_resources: dict[str, float]) -> dict[str, float]:
    """One GPU per worker where the cluster has GPUs, else one CPU slot."""
    return {"GPU": 1.0} if cluster_resources.get("GPU", 0) > 0 else {"CPU": 1.0}


def fits_per_node(available_per_node: list[dict[str, float]], per_worker: dict[str, float]) -> list[int]:
    """How many worker bundles fit in each node's free resources (a bundle never spans nodes)."""
    return [max(0, min((math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in per_worker.items()), default=0))
            for free in available_per_node]


def bundles_that_fit(available_per_node: list[dict[str, float]], per_worker: dict[str, float]) -> int:
    """How many worker bundles fit in the nodes' free resources, each node counted apart."""
    return sum(fits_per_node(available_per_node, per_worker))


def strategy_for(requested: str, team: int) -> str:
    """The placement strategy of a job's groups: the spec's, or STRICT_PACK when a model-parallel
    group of `team` ranks must share a node (each placement group is then one node's)."""
    return "STRICT_PACK" if team > 1 else requested


def group_sizes(n: int, fits: list[int], strategy: str, unit: int = 0, team: int = 1) -> list[int]:
    """The placement groups (bundles in each) that reserve `n` workers. One group, where GCS
    may spread it over nodes; with STRICT_PACK a group must fit on one node, so it is one group
    per node, the roomiest nodes first, each at most what that node fits now (fewer than `n`
    in all when the nodes fit fewer). `unit` > 0 caps every group at `unit` bundles: a job under
    the cluster's scheduler gives back capacity a whole group at a time (Ray releases no single
    bundle of a group), so its groups are as small as the sizes it may shrink by. `team` > 1
    (a model-parallel group's ranks, which must share a node): STRICT_PACK groups of whole teams
    only, a node's room rounded down to them (`unit` is then a multiple of `team`)."""
    if team > 1:
        fits, n = [f - f % team for f in fits], n - n % team
    if strategy != "STRICT_PACK":
        sizes = [n] if n > 0 else []
    else:
        sizes = []
        for fit in sorted(fits, reverse=True):
            if n <= 0 or fit <= 0:
                break
            sizes.append(min(fit, n))
            n -= sizes[-1]
    if unit <= 0:
        return sizes
    return [min(unit, k - start) for k in sizes for start in range(0, k, unit)]


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


def off_driver_node() -> dict:
    """Ray options that keep a helper actor (data readers) off the driver's node, spread over
    the others: the driver's node (the head of a launcher cluster) does no heavy work. Empty on
    a cluster of one node, where there is nowhere else."""
    import ray

    driver = ray.get_runtime_context().get_node_id()
    if not any(n["Alive"] and n["NodeID"] != driver for n in ray.nodes()):
        return {}
    return {"scheduling_strategy": "SPREAD", "label_selector": {"ray.io/node-id": f"!{driver}"}}


def request_capacity(per_worker: dict[str, float], n: int, exclude: set[str] | frozenset[str] = frozenset()) -> None:
    """Tell the autoscaler the run wants room for `n` worker bundles (the whole world at
    max_workers, the bundles in use included), off excluded nodes. The request stands until it
    is replaced: a node lost later (a spot reclaim) is launched again. n = 0 withdraws it.
    Ray keeps one such request per cluster, so two jobs asking at once replace each other's."""
    from ray.autoscaler.sdk import request_resources

    bundles = [dict(per_worker) for _ in range(n)]
    selectors = avoid_nodes(set(exclude), n)
    request_resources(bundles=bundles, bundle_label_selectors=selectors) if selectors \
        else request_resources(bundles=bundles)


def withdraw_request(address: str) -> bool:
    """Withdraw the cluster's standing request (request_capacity with 0) from a process that is
    not a run's driver: `airay run`'s supervisor, once the driver that made it died. False when
    `address` is "auto" and no cluster runs here (the driver's own Ray went with it)."""
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except ConnectionError:
        if address == "auto":
            return False
        raise
    try:
        request_capacity({}, 0)
    finally:
        ray.shutdown()
    return True

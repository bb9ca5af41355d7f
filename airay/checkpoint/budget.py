"""The memory tier's byte budget: how much of a node's memory its checkpoints may hold, and what
a save gives up to stay within it. Pure: the NodeStores report figures, the Checkpointer acts.

A node's tier lives in /dev/shm, which is the node's RAM: a tier that grows past what the
training processes leave free gets them killed by Ray's memory monitor (seen at 100M parameters
on a 24 GiB machine: three kept steps with their peer copies filled it, every rank was killed,
every node excluded). So each node's tier has a budget, and a save that would exceed it drops
the oldest kept steps first, then the peer copy, and only then is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The share of /dev/shm's room a host's tiers may take, whatever the fraction of memory says:
# a resharded load's scratch copies and Ray's object store live there too.
SHM_SHARE = 0.8


@dataclass(frozen=True)
class NodeMemory:
    """One node's figures, as its NodeStore reads them (bytes)."""

    node_id: str
    host: str  # the machine (raylets that share one, as a local cluster's do, share its memory)
    mem_total: int
    mem_available: int
    shm_total: int
    shm_free: int
    tier_bytes: int  # this job's tier on the node now (its own files and peer copies)


def node_budgets(nodes: list[NodeMemory], fraction: float, budget_bytes: int | None = None,
                 scale: dict[str, float] | None = None) -> dict[str, int]:
    """Each node's budget: `fraction` of its machine's memory (or `budget_bytes` when the spec
    sets one), capped by SHM_SHARE of /dev/shm's room (what is free plus what this job's tiers
    there hold), the machine's share split evenly over the nodes on it. `scale`: a factor per
    host, lowered after Ray's memory monitor killed a rank there."""
    hosts: dict[str, list[NodeMemory]] = {}
    for n in nodes:
        hosts.setdefault(n.host, []).append(n)
    out = {}
    for host, on_host in hosts.items():
        first = on_host[0]
        want = budget_bytes * len(on_host) if budget_bytes is not None else fraction * first.mem_total
        room = SHM_SHARE * (first.shm_free + sum(n.tier_bytes for n in on_host))
        share = min(want, room) * (scale or {}).get(host, 1.0) / len(on_host)
        for n in on_host:
            out[n.node_id] = int(max(0.0, share))
    return out


@dataclass(frozen=True)
class SavePlan:
    drop: tuple[int, ...] = ()  # kept steps to remove before the save, oldest first
    drop_copies: tuple[int, ...] = ()  # protected steps whose peer copies go (their owners' files stay)
    no_peer: frozenset[str] = frozenset()  # nodes whose ranks keep no copy on their successor
    skip: bool = False  # the save does not fit even alone
    reason: str = ""
    use: dict[str, int] = field(default_factory=dict)  # each node's tier bytes after the save, as planned


def plan_save(budgets: dict[str, int], kept: dict[str, dict[int, int]], protected: set[int],
              own: dict[str, int], ring: dict[str, str],
              copies: dict[str, dict[int, int]] | None = None) -> SavePlan:
    """What a save of `own[node]` bytes per node must give up to keep every node within its budget.

    `kept[node]`: bytes per step the node holds now (own files and peer copies); `protected`:
    steps that may not go (an upload reads them); `ring[node]`: the node its ranks copy to;
    `copies[node]`: bytes of other nodes' files the node holds of each protected step (their peer
    copies: an upload reads each rank's own files, on its own node).
    Kept steps go oldest first, on every node at once (a step is loadable only whole); then the
    peer copies of protected steps; when even that does not fit, the copies to the nodes that
    would overflow are not made; when a node's own files alone overflow it, the save is skipped
    (nothing is dropped for it)."""
    copies = copies or {}
    incoming = {node: 0 for node in budgets}
    for src, dst in ring.items():
        if dst in incoming:
            incoming[dst] += own.get(src, 0)
    steps = sorted({s for per in kept.values() for s in per} - set(protected))
    copied = tuple(sorted({s for per in copies.values() for s in per} & set(protected)))

    def use(dropped: set[int], with_peer: set[str], uncopied: tuple[int, ...] = ()) -> dict[str, int]:
        return {node: sum(b for s, b in kept.get(node, {}).items() if s not in dropped)
                - sum(copies.get(node, {}).get(s, 0) for s in uncopied)
                + own.get(node, 0) + (incoming[node] if node in with_peer else 0) for node in budgets}

    def fits(planned: dict[str, int]) -> bool:
        return all(planned[n] <= budgets[n] for n in budgets)

    everyone = set(budgets)
    for k in range(len(steps) + 1):
        dropped = set(steps[:k])
        planned = use(dropped, everyone)
        if fits(planned):
            return SavePlan(drop=tuple(steps[:k]), use=planned,
                            reason=f"dropped steps {steps[:k]} to fit" if k else "")
    dropped = set(steps)
    if copied and fits(planned := use(dropped, everyone, copied)):
        return SavePlan(drop=tuple(steps), drop_copies=copied, use=planned,
                        reason=f"dropped steps {steps} and the peer copies of steps {list(copied)}, which uploads read, "
                               "to fit")
    alone = use(dropped, set(), copied)
    over = sorted(n for n in budgets if alone[n] > budgets[n])
    if over:
        return SavePlan(skip=True, use=alone, reason=(
            f"node {over[0][:8]}'s own files of the step ({own.get(over[0], 0) / 2**20:.0f} MiB, with "
            f"{(alone[over[0]] - own.get(over[0], 0)) / 2**20:.0f} MiB of steps an upload still reads) exceed its "
            f"memory-tier budget of {budgets[over[0]] / 2**20:.0f} MiB"))
    full = use(dropped, everyone, copied)
    receivers = {n for n in budgets if full[n] > budgets[n]}
    no_peer = frozenset(src for src, dst in ring.items() if dst in receivers)
    return SavePlan(drop=tuple(steps), drop_copies=copied, no_peer=no_peer,
                    use=use(dropped, everyone - receivers, copied),
                    reason=f"dropped steps {steps}, the peer copies of steps {list(copied)} and the peer copies to "
                           f"{len(receivers)} node(s) to fit")


def rank_bytes(manifest, world_size: int) -> list[int]:
    """Each rank's bytes of a save at `world_size`, from the last save's manifest: exact at the
    same world size, else its largest rank's share rescaled (ZeRO partitions evenly; rank 0's
    extra model file is kept in the largest)."""
    per_rank: dict[int, int] = {}
    for f in manifest.files.values():
        per_rank[f.rank] = per_rank.get(f.rank, 0) + f.size
    if manifest.world_size == world_size:
        return [per_rank.get(r, 0) for r in range(world_size)]
    largest = max(per_rank.values(), default=0)
    return [int(largest * manifest.world_size / world_size)] * world_size

"""The world as data-parallel replicas x a model-parallel group: one object maps rank <-> coordinates.

A world of `world` ranks with tensor-parallel size `tp` and sequence-parallel size `sp` has
`mp = tp x sp` ranks per model replica and `dp = world / mp` replicas. Ranks are laid out with
tensor parallelism fastest, then sequence, then data (Megatron's and DeepSpeed's order):

    rank = (dp_rank x sp + sp_rank) x tp + tp_rank

so each replica's model-parallel group is `mp` consecutive ranks (packed on one node: tensor
parallelism needs NVLink), each tensor-parallel group is `tp` consecutive ranks, and a
data-parallel group holds the ranks with the same (sp_rank, tp_rank), one per replica.

Elasticity is over replicas: the failure domain is a model-parallel group. A lost rank retires
its whole group (`retire`), the data-parallel size shrinks by one per retired group, and the
world only takes sizes that are multiples of mp. Pure functions, no Ray, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coordinates:
    dp: int  # which replica
    sp: int  # position in its sequence-parallel group
    tp: int  # position in its tensor-parallel group


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    sp: int = 1

    def __post_init__(self):
        if self.tp < 1 or self.sp < 1:
            raise ValueError(f"tensor and sequence parallel sizes must be >= 1, got {self.tp} and {self.sp}")
        if self.world < 1 or self.world % self.mp:
            raise ValueError(f"a world of {self.world} ranks is not a whole number of model-parallel groups of "
                             f"{self.mp} (tensor {self.tp} x sequence {self.sp})")

    @property
    def mp(self) -> int:
        """Ranks per model replica."""
        return self.tp * self.sp

    @property
    def dp(self) -> int:
        """Data-parallel replicas."""
        return self.world // self.mp

    def coordinates(self, rank: int) -> Coordinates:
        self._check(rank)
        return Coordinates(rank // self.mp, rank // self.tp % self.sp, rank % self.tp)

    def rank(self, c: Coordinates) -> int:
        if not (0 <= c.dp < self.dp and 0 <= c.sp < self.sp and 0 <= c.tp < self.tp):
            raise ValueError(f"{c} lies outside a layout of dp {self.dp}, sp {self.sp}, tp {self.tp}")
        return (c.dp * self.sp + c.sp) * self.tp + c.tp

    def model_parallel_groups(self) -> list[list[int]]:
        """Each replica's ranks: the unit of placement and of failure."""
        return [list(range(g * self.mp, (g + 1) * self.mp)) for g in range(self.dp)]

    def tensor_parallel_groups(self) -> list[list[int]]:
        return [list(range(start, start + self.tp)) for start in range(0, self.world, self.tp)]

    def sequence_parallel_groups(self) -> list[list[int]]:
        return [[self.rank(Coordinates(d, s, t)) for s in range(self.sp)]
                for d in range(self.dp) for t in range(self.tp)]

    def data_parallel_groups(self) -> list[list[int]]:
        """One per model-parallel position: the ranks that hold the same slice of the model, whose
        ZeRO partitions are resharded together across data-parallel sizes."""
        return [[self.rank(Coordinates(d, s, t)) for d in range(self.dp)]
                for s in range(self.sp) for t in range(self.tp)]

    def replica(self, rank: int) -> int:
        return self.coordinates(rank).dp

    def retire(self, lost: list[int]) -> list[int]:
        """Every rank that leaves the world when `lost` ranks are lost: their whole
        model-parallel groups (a group missing a rank holds no whole model). Sorted."""
        groups = {self.replica(r) for r in lost}
        return sorted(r for g in groups for r in range(g * self.mp, (g + 1) * self.mp))

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a world of {self.world}")


def groups_per_node(ranks_per_node: int, mp: int) -> int:
    """How many model-parallel groups a node holds (a node of 8 GPUs with tensor parallel 4: 2);
    0 when a group does not fit on one node."""
    return ranks_per_node // mp


def deepspeed_sizes(ds_config: dict) -> tuple:
    """(tensor, sequence) parallel sizes a DeepSpeed config asks for, as written (1 where unset or
    0): `tensor_parallel.autotp_size` and `sequence_parallel_size`. airay.config checks them."""
    return ((ds_config.get("tensor_parallel") or {}).get("autotp_size", 1) or 1,
            ds_config.get("sequence_parallel_size", 1) or 1)


def form_teams(nodes: list[str | None], prior: list[object | None], mp: int) -> list[list[int]]:
    """Members (indices into `nodes`, each member's node) grouped into model-parallel groups of
    `mp` members on one node, the order a new world takes them in. First the groups that come
    whole from the world before (`prior[i]`: member i's group there, None for a member that was
    in none; every member of it present, on one node), in the order they appear, so survivors
    keep their ranks' order; then the other members, node by node in order of appearance, `mp`
    at a time. Members left over (fewer than `mp` on a node) are in no group: they stand by
    until a replacement on their node completes one."""
    prior = list(prior) + [None] * (len(nodes) - len(prior))
    members: dict[object, list[int]] = {}
    for i, key in enumerate(prior):
        if key is not None:
            members.setdefault(key, []).append(i)
    whole = {key for key, idx in members.items() if len(idx) == mp and len({nodes[i] for i in idx}) == 1}
    teams, seen = [], set()
    for i, key in enumerate(prior):
        if key in whole and key not in seen:
            seen.add(key)
            teams.append(members[key])
    placed = {i for t in teams for i in t}
    by_node: dict[str | None, list[int]] = {}
    for i, node in enumerate(nodes):
        if i not in placed:
            by_node.setdefault(node, []).append(i)
    for idx in by_node.values():
        teams += [idx[k:k + mp] for k in range(0, len(idx) - mp + 1, mp)]
    return teams

"""Classify what happened to a round of steps, find hung ranks and stragglers: every outcome gets a name.

Pure: the worker group turns Ray's futures and heartbeats into plain values; this module decides.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass, field
from typing import Literal

OutcomeKind = Literal["ok", "died", "errored", "silent", "hung"]

# Exceptions raised inside a worker that say its process or its memory failed, not its code:
# the rank is replaced like a crash. MemoryError: the worker ran out of address space or RAM;
# OutOfMemoryError: Ray's memory monitor killed a task; ObjectLostError and friends: an object
# the call needed was lost with its node.
INFRA_ERRORS = frozenset({"MemoryError", "OutOfMemoryError", "ObjectLostError", "OwnerDiedError",
                          "ObjectReconstructionFailedError", "ObjectFetchTimedOutError", "NodeDiedError",
                          "WorkerCrashedError"})


_LOST_KINDS = frozenset({"died", "silent", "hung"})

# A block of the rank's step could not be fetched (airay.data.DataFetchError): the data path
# failed, the rank did not. The round is re-run on the same world; nobody is replaced.
DATA_ERRORS = frozenset({"DataFetchError"})


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    kind: OutcomeKind  # died: the process is gone; errored: its method raised; silent: no answer; hung: no progress
    error: str = ""
    user_error: bool = False  # the exception came from the user's model, loss or data code
    cause: str = ""  # the exception's class name, when the method raised
    step: int | None = None  # the step it failed at, when the error says (a data failure)

    @property
    def infra(self) -> bool:
        """The rank itself failed (process, node, memory, hang): replace it, don't blame the code."""
        return self.kind in _LOST_KINDS or (self.kind == "errored" and self.cause in INFRA_ERRORS)

    @property
    def fault(self) -> str:
        """The failure's name in events and summaries."""
        if self.kind == "errored" and self.cause in ("MemoryError", "OutOfMemoryError"):
            return "oom"
        if self.kind == "errored" and self.cause in INFRA_ERRORS:
            return "object_lost"
        if self.kind == "errored" and self.cause in DATA_ERRORS:
            return "data_lost"
        return self.kind


@dataclass(frozen=True)
class RoundVerdict:
    kind: Literal["ok", "lost", "user_error", "data_lost", "comm_error"]
    lost_ranks: tuple[int, ...] = ()
    message: str = ""
    outcomes: tuple[RankOutcome, ...] = field(default=(), repr=False)


def classify_round(outcomes: list[RankOutcome]) -> RoundVerdict:
    """ok: every rank finished. lost: some rank died, hung, went silent or hit an infrastructure
    error (survivors' errors are collateral: their collective lost a peer). user_error: no rank
    was lost and some rank's own code raised; retrying would fail again. data_lost: no rank was
    lost, no user code failed, and some rank could not fetch a block of its step (the others'
    collectives failed with it); the same world re-runs the round. comm_error: ranks failed in
    collectives with no rank lost."""
    # Inlined RankOutcome.infra: this runs over every rank after each failure (4,096 in benchmarks/decision.py).
    lost = tuple(o.rank for o in outcomes
                 if o.kind in _LOST_KINDS or (o.kind == "errored" and o.cause in INFRA_ERRORS))
    if lost:
        return RoundVerdict("lost", lost, outcomes=tuple(outcomes))
    errored = [o for o in outcomes if o.kind == "errored"]
    if not errored:
        return RoundVerdict("ok", outcomes=tuple(outcomes))
    users = [o for o in errored if o.user_error]
    if users:
        first = min(users, key=lambda o: o.rank)
        return RoundVerdict("user_error", message=f"user code failed on rank {first.rank}:\n{first.error}",
                            outcomes=tuple(outcomes))
    data = [o for o in errored if o.cause in DATA_ERRORS]
    if data:
        return RoundVerdict("data_lost", message=f"rank {data[0].rank}: {data[0].error}", outcomes=tuple(outcomes))
    first = min(errored, key=lambda o: o.rank)
    return RoundVerdict("comm_error", message=f"rank {first.rank}: {first.error}", outcomes=tuple(outcomes))


def merge_pipelined(failed: list[RankOutcome], behind: list[RankOutcome | None]) -> list[RankOutcome]:
    """Outcomes of a failed round whose ranks had the next round queued behind it (`behind`:
    that round's outcomes, None for a rank not waited for). The queued round could not finish
    (a peer is gone), so its errors are collateral; but a rank that died, hung, went silent or
    ran out of memory in it is lost as surely as in the round itself."""
    return [b if b is not None and b.infra and not o.infra else o for o, b in zip(failed, behind)]


# ---- hangs ------------------------------------------------------------------------------------

# A rank's progress inside a round, as its heartbeat reports it: (step, micro-batch, phase).
# Phases in the order a step passes them; a rank at a smaller position is behind. A join, save
# or load is one phase of its own, its sub-steps counted in the micro-batch place.
PHASES = ("start", "data", "forward", "backward", "optimizer", "done", "join", "save", "fetch", "load")


def position(progress: dict) -> tuple[int, int, int]:
    return (int(progress.get("step", -1)), int(progress.get("micro", -1)),
            PHASES.index(progress.get("phase", "start")))


def find_hung(positions: dict[int, tuple[int, int, int]], last_change: dict[int, float],
              answering: set[int], now: float, hang_timeout_s: float) -> list[int]:
    """The ranks to declare hung, or [].

    `positions`: each rank's last reported progress; `last_change`: when (driver clock) the
    driver last saw it change; `answering`: ranks whose heartbeat answered recently.
    A stalled rank (no change for hang_timeout_s) is hung if its heartbeat stopped answering (the
    process is stopped), or if it is the furthest behind: in data-parallel training every other
    rank soon blocks in a collective waiting for it, so they stall too, but further ahead. When
    every rank stalls at the same position, all are hung (a deadlock or a hang on every rank).
    """
    stalled = {r for r, t in last_change.items() if now - t >= hang_timeout_s}
    if not stalled:
        return []
    silent = sorted(stalled - answering)
    if silent:
        return silent
    behind = min(positions.values())
    hung = sorted(r for r in stalled if positions[r] == behind)
    # The furthest-behind rank still moves: the others are waiting on it, not hung.
    if any(positions[r] == behind and r not in stalled for r in positions):
        return []
    return hung


# ---- stragglers -----------------------------------------------------------------------------


def find_stragglers(local_s: list[list[float]], factor: float, min_excess_s: float) -> list[int]:
    """Ranks whose median local step time (the part of a step before its collectives) exceeds
    the median of the other ranks' medians by `factor` and by at least `min_excess_s`.

    `local_s[rank]`: that rank's times over a round. Total step times cannot tell: every rank
    waits for the slowest in the gradient all-reduce, so all report the same total.
    """
    if len(local_s) < 2:
        return []
    medians = [statistics.median(ts) for ts in local_s if ts]
    if len(medians) != len(local_s):
        return []
    out = []
    ordered = sorted(medians)
    for rank, m in enumerate(medians):
        others = median_without(ordered, m)
        if m > factor * others and m - others >= min_excess_s:
            out.append(rank)
    return out


def median_without(ordered: list[float], value: float) -> float:
    """statistics.median of sorted `ordered` with one occurrence of `value` taken out, in
    O(log n) (which occurrence does not matter: they are equal). The same float as
    statistics.median of that list: the middle element, or the mean of the middle two."""
    gone = bisect.bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(i: int) -> float:  # element i of `ordered` without the one at `gone`
        return ordered[i] if i < gone else ordered[i + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


# ---- failure records -----------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """One failure the run recovered from (or gave up on): what, where, when."""

    ts: float
    fault: str  # died, hung, silent, oom, object_lost, data_lost, comm_error, user_error
    rank: int | None
    node_id: str | None
    step: int


def summarize_failures(failures: list[Failure]) -> str:
    """One line per kind: how many, on which ranks, nodes (short ids) and steps."""
    kinds: dict[str, list[Failure]] = {}
    for f in failures:
        kinds.setdefault(f.fault, []).append(f)
    lines = []
    for kind, fs in kinds.items():
        ranks = sorted({f.rank for f in fs if f.rank is not None})
        nodes = sorted({f.node_id[:8] for f in fs if f.node_id})
        steps = sorted({f.step for f in fs})
        lines.append(f"  {kind} x{len(fs)}: ranks {ranks}, nodes {nodes}, steps {steps}")
    return "\n".join(lines)

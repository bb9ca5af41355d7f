"""Classify what happened to a round of steps, find hung ranks and stragglers: every outcome gets a name.

Pure: the worker group turns Ray's futures and heartbeats into plain values; this module decides.
"""

from __future__ import annotations

import bisect
import re
import statistics
from dataclasses import dataclass, field
from typing import Literal

OutcomeKind = Literal["ok", "died", "errored", "silent", "hung"]

# Exceptions raised inside a worker that say its process or its memory failed, not its code:
# the rank is replaced like a crash. MemoryError: the worker ran out of address space or RAM;
# OutOfMemoryError: Ray's memory monitor killed a task, or CUDA's allocator ran out (torch's
# class of the same name); GPUError: a CUDA error on the rank's device (airay.worker.failures:
# its process must not be reused); ObjectLostError and friends: an object the call needed was
# lost with its node.
INFRA_ERRORS = frozenset({"MemoryError", "OutOfMemoryError", "GPUError", "ObjectLostError", "OwnerDiedError",
                          "ObjectReconstructionFailedError", "ObjectFetchTimedOutError", "NodeDiedError",
                          "WorkerCrashedError"})

# NCCL failed in a rank's process (a system or an internal error, airay.worker.failures.NCCLError).
# The rank's own fault when it stands out: no other rank was lost (a peer's death shows as such
# errors on its survivors), and not every rank of the world reported one (NCCL 2.18 words every
# network error as an internal error: the whole world seeing one is the network's).
NCCL_ERRORS = frozenset({"NCCLError"})

# airay's own code raised it on the rank (airay.worker.failures.InternalError): retried once.
INTERNAL_ERRORS = frozenset({"InternalError"})

# Ray's memory monitor killing a worker, in the error its callers get (ray.exceptions.OutOfMemoryError
# for the call it ran, ActorDiedError for calls to the dead actor): "Task was killed due to the node
# running low on memory." up to Ray 2.54 (Ray's docs, ray-oom-prevention), "2 worker(s) were killed
# due to the node running low on memory. Memory on the node (IP: ..., ID: ...) was 21.84GB used /
# 23.54GB limit (0.927782)" since (the raylet's "%d worker(s) were killed due to the node running
# low on memory. %s"; this text from Ray 2.60 on this machine). Kept: that line, and the node's
# memory figures where they follow on the next (older Rays).
_MEMORY_MONITOR = re.compile(
    r"[^\n]*killed due to the node running low on memory[^\n]*(\nMemory on the node[^\n]*)?")


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
    # The exception's class name, when the method raised; for a death, OutOfMemoryError when
    # Ray's memory monitor killed the process (actor_died).
    cause: str = ""
    step: int | None = None  # the step it failed at, when the error says (a data failure)

    @property
    def infra(self) -> bool:
        """The rank itself failed (process, node, memory, device, hang): replace it, don't blame
        the code. An NCCL error is decided with the round in view (classify_round)."""
        return self.kind in _LOST_KINDS or (self.kind == "errored" and self.cause in INFRA_ERRORS)

    @property
    def fault(self) -> str:
        """The failure's name in events and summaries."""
        if self.cause in ("MemoryError", "OutOfMemoryError"):  # raised, or killed by Ray's memory monitor
            return "oom"
        if self.kind == "errored":
            return _ERROR_FAULTS.get(self.cause) or ("object_lost" if self.cause in INFRA_ERRORS else self.kind)
        return self.kind


_ERROR_FAULTS = {"GPUError": "gpu_error", "NCCLError": "nccl_error", "InternalError": "internal_error",
                 **{c: "data_lost" for c in DATA_ERRORS}}


def actor_died(rank: int, cause: str, text: str) -> RankOutcome:
    """The outcome of a rank whose actor died (`cause`: the Ray error's class name, `text`: its
    message): killed by Ray's memory monitor (outcome oom, with the node's memory figures) or
    gone otherwise (its first line)."""
    oom = _MEMORY_MONITOR.search(text)
    if oom:
        return RankOutcome(rank, "died", error=" ".join(oom.group(0).split()), cause="OutOfMemoryError")
    return RankOutcome(rank, "died", error=text.splitlines()[0] if text else cause, cause=cause)


@dataclass(frozen=True)
class RoundVerdict:
    kind: Literal["ok", "lost", "user_error", "data_lost", "internal_error", "comm_error"]
    lost_ranks: tuple[int, ...] = ()
    message: str = ""
    outcomes: tuple[RankOutcome, ...] = field(default=(), repr=False)
    rank: int | None = None  # the rank the message is about (user_error, data_lost, internal_error)


def classify_round(outcomes: list[RankOutcome]) -> RoundVerdict:
    """ok: every rank finished. lost: some rank died, hung, went silent or hit an infrastructure
    error (host or GPU memory, a CUDA error, an NCCL error of its own: NCCL_ERRORS); survivors'
    errors are collateral: their collective lost a peer. user_error: no rank was lost and some
    rank's own code raised; retrying would fail again. data_lost: no rank was lost, no user code
    failed, and some rank could not fetch a block of its step (the others' collectives failed
    with it); the same world re-runs the round. internal_error: none of those, and airay's own
    code raised on some rank. comm_error: ranks failed in collectives with no rank lost."""
    # Inlined RankOutcome.infra: this runs over every rank after each failure (4,096 in benchmarks/decision.py).
    lost = tuple(o.rank for o in outcomes
                 if o.kind in _LOST_KINDS or (o.kind == "errored" and o.cause in INFRA_ERRORS))
    if not lost:
        nccl = tuple(o.rank for o in outcomes if o.kind == "errored" and o.cause in NCCL_ERRORS)
        if nccl and not len(nccl) == len(outcomes) > 1:
            lost = nccl
    if lost:
        return RoundVerdict("lost", lost, outcomes=tuple(outcomes))
    errored = [o for o in outcomes if o.kind == "errored"]
    if not errored:
        return RoundVerdict("ok", outcomes=tuple(outcomes))
    users = [o for o in errored if o.user_error]
    if users:
        first = min(users, key=lambda o: o.rank)
        return RoundVerdict("user_error", message=f"user code failed on rank {first.rank}:\n{first.error}",
                            outcomes=tuple(outcomes), rank=first.rank)
    data = [o for o in errored if o.cause in DATA_ERRORS]
    if data:
        return RoundVerdict("data_lost", message=f"rank {data[0].rank}: {data[0].error}", outcomes=tuple(outcomes),
                            rank=data[0].rank)
    internal = [o for o in errored if o.cause in INTERNAL_ERRORS]
    if internal:
        first = internal[0]
        return RoundVerdict("internal_error", message=f"airay's own code failed on rank {first.rank}:\n{first.error}",
                            outcomes=tuple(outcomes), rank=first.rank)
    first = min(errored, key=lambda o: o.rank)
    return RoundVerdict("comm_error", message=f"rank {first.rank}: {first.error}", outcomes=tuple(outcomes))


def merge_pipelined(failed: list[RankOutcome], behind: list[RankOutcome | None]) -> list[RankOutcome]:
    """Outcomes of a failed round whose ranks had the next round queued behind it (`behind`:
    that round's outcomes, None for a rank not waited for). The queued round could not finish
    (a peer is gone), so its errors are collateral; but a rank that died, hung, went silent or
    ran out of memory in it is lost as surely as in the round itself."""
    return [b if b is not None and b.infra and not o.infra else o for o, b in zip(failed, behind)]


# ---- hangs ------------------------------------------------------------------------------------

# A rank's progress inside a round, as its heartbeat reports it: (step, micro-batch, phase) and
# the collective calls it has entered and left since the phase began. Phases in the order a step
# passes them; a rank at a smaller position is behind. A join, save or load is one phase of its
# own, its sub-steps counted in the micro-batch place.
PHASES = ("start", "data", "forward", "backward", "optimizer", "done", "join", "save", "fetch", "load")


def position(progress: dict, groups: bool = True) -> tuple[int, ...]:
    """(step, micro-batch, phase, collectives entered, collectives left[, torch's group counters]).

    Every rank of a data-parallel world makes the same collective calls in the same order, so
    within one phase the counts compare across ranks: a rank that entered k calls while its
    peers entered k + 1 is the one they wait for inside call k + 1. The host's counts
    (airay.commtime) come first: with NCCL a host thread that returned from queuing a collective
    may still be behind on its device, which torch's per-group counters tell (completed, started,
    enqueued: airay.worker.dist.collective_counts), compared last and only with `groups` (the
    caller's word that every rank reports them: a rank without them would look behind)."""
    entered, left = progress.get("collectives", (0, 0))
    place = (int(progress.get("step", -1)), int(progress.get("micro", -1)),
             PHASES.index(progress.get("phase", "start")), int(entered), int(left))
    return place + tuple(progress.get("groups", ())) if groups else place


def deadline(progress: dict, hang_timeout_s: float, first_step_timeout_s: float | None = None) -> float:
    """How long a rank may stand still: `first_step_timeout_s` (None: not its first step) until
    its heartbeat says it has completed a step in this world, hang_timeout_s after. A world's
    first step also creates NCCL's communicators lazily and runs a first compile."""
    if first_step_timeout_s is not None and not progress.get("steps"):
        return first_step_timeout_s
    return hang_timeout_s


def find_hung(positions: dict[int, tuple[int, ...]], last_change: dict[int, float], last_answer: dict[int, float],
              now: float, timeouts: dict[int, float] | float, poll_s: float = 1.0) -> list[int]:
    """The ranks to declare hung, or [].

    `positions`: each running rank's last reported place (position()); `last_change`: when
    (driver clock) the driver last saw it change; `last_answer`: when its heartbeat last
    answered; `timeouts`: how long each may stand still (deadline(); one number: all alike).
    A rank is stalled when its place has not changed for its timeout. A stalled rank is hung
    - if its heartbeat stopped answering for its timeout too (the process is stopped). Of
      several, those that stopped first (within one heartbeat poll, `poll_s`): a process
      stopped with its peers' data can leave them blocked in a way that silences them later;
    - else if it is the furthest behind (with any rank at the same place): in data-parallel
      training every other rank soon blocks in a collective waiting for it, so they stall too,
      but further ahead: by a step, a phase, or one collective call (position()). When one GPU
      or link stops, every rank stalls at one point; the rank that never entered the collective
      its peers wait in is the one named, alone.
    When every rank stands still at exactly the same place, the same collective entered and not
    left by all, none waits for another: a deadlock or a fault they all share. All are hung.
    """
    limit = timeouts if isinstance(timeouts, dict) else dict.fromkeys(positions, timeouts)
    stalled = {r for r, t in last_change.items() if now - t >= limit[r]}
    if not stalled:
        return []
    silent = [r for r in stalled if now - last_answer[r] >= limit[r]]
    if silent:
        first = min(last_answer[r] for r in silent)
        return sorted(r for r in silent if last_answer[r] - first <= poll_s)
    behind = min(positions.values())
    hung = sorted(r for r in stalled if positions[r] == behind)
    # The furthest-behind rank still moves: the others are waiting on it, not hung.
    if any(positions[r] == behind and r not in stalled for r in positions):
        return []
    return hung


def node_mates(rank: int, nodes: list[str | None]) -> list[int]:
    """The other ranks on `rank`'s node (`nodes[r]`: rank r's node), replaced with a hung rank.

    A hang is the node's incident, not the rank's: the ranks of a GPU node share its NVLink or
    NVSwitch fabric, PCIe switches, NICs and GPU driver, and a fault in any of them stalls or
    poisons them all (an Xid that wedges the driver, a link that drops). They cannot be told
    apart from healthy ranks while they wait in the collective the hung rank never entered, and
    a world re-formed with them would stall again a hang timeout later, one rank at a time.
    Replacing them costs their processes' restart, in the same bundles, which the shrunk world
    trains through; and like a node excluded for failures, they count as one failure, the hung
    rank's."""
    node = nodes[rank]
    return [r for r, n in enumerate(nodes) if node is not None and n == node and r != rank]


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


class LocalTimeWindow:
    """Each rank's local step times over its last `steps` steps in the current world.

    A straggler is judged on its median over this window, never on one round alone: a round can be
    a single step (a fault or a checkpoint splits rounds), and one slow step (a GC pause, a
    checkpoint's background writes sharing the rank's cores) is noise, not a slow rank. Nothing is
    judged until every rank has `steps` times. A new world starts a new window (ranks renumber).
    """

    def __init__(self, steps: int):
        self.steps = steps
        self.times: list[list[float]] = []

    def add(self, local_s: list[list[float]]) -> list[list[float]] | None:
        """Add a round's times per rank; the full windows to judge, or None while any is short."""
        if len(self.times) != len(local_s):
            self.times = [[] for _ in local_s]
        for kept, new in zip(self.times, local_s):
            kept.extend(new)
            del kept[:-self.steps]
        return self.times if all(len(ts) == self.steps for ts in self.times) else None


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
    # died, hung, silent, oom, gpu_error, nccl_error, object_lost, data_lost, internal_error, comm_error, user_error
    fault: str
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

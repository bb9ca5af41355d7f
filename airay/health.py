"""Classify what happened to a round of steps: every outcome gets a name.

Pure: the worker group turns Ray's futures into `RankOutcome`s; this module decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

OutcomeKind = Literal["ok", "died", "errored", "silent"]


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    kind: OutcomeKind  # died: the actor's process is gone; errored: its method raised; silent: no answer
    error: str = ""
    user_error: bool = False  # the exception came from the user's model, loss or data code


@dataclass(frozen=True)
class RoundVerdict:
    kind: Literal["ok", "lost", "user_error", "comm_error"]
    lost_ranks: tuple[int, ...] = ()
    message: str = ""
    outcomes: tuple[RankOutcome, ...] = field(default=(), repr=False)


def classify_round(outcomes: list[RankOutcome]) -> RoundVerdict:
    """ok: every rank finished. lost: some rank died or went silent (survivors' errors are
    collateral: their collective lost a peer). user_error: no rank died and some rank's own code
    raised; retrying would fail again. comm_error: ranks failed in collectives with no rank lost."""
    lost = tuple(o.rank for o in outcomes if o.kind in ("died", "silent"))
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
    first = min(errored, key=lambda o: o.rank)
    return RoundVerdict("comm_error", message=f"rank {first.rank}: {first.error}", outcomes=tuple(outcomes))

"""WorkerGroup's wait for a call per rank (airay.worker_group.gather_calls) without Ray: calls
that finish at scripted times on a simulated clock, behind a wait with ray.wait's contract.
The real one is exercised on a cluster by the elastic tests (tests/test_elastic.py)."""

import math

from airay.health import RankOutcome
from airay.worker_group import gather_calls


class Calls:
    """Call i finishes at done_at[i] (math.inf: never) as `outcome` says; time passes only while a
    wait blocks. Records every wait: how many refs it was handed, and its num_returns."""

    def __init__(self, done_at: list[float | None], errors: dict[int, str] | None = None):
        self.refs = [None if t is None else f"ref{i}" for i, t in enumerate(done_at)]
        self.done_at = {ref: t for ref, t in zip(self.refs, done_at) if ref is not None}
        self.errors = errors or {}
        self.now = 0.0
        self.waits: list[tuple[int, int]] = []

    def clock(self) -> float:
        return self.now

    def wait(self, refs: list, num_returns: int = 1, timeout: float | None = None):
        """ray.wait: returns when num_returns are done or at the timeout, at most num_returns of them."""
        self.waits.append((len(refs), num_returns))
        assert len(set(refs)) == len(refs) and 1 <= num_returns <= len(refs)
        enough = sorted(self.done_at[r] for r in refs)[num_returns - 1]
        self.now = max(self.now, min(enough, self.now + timeout))
        ready = [r for r in refs if self.done_at[r] <= self.now][:num_returns]
        return ready, [r for r in refs if r not in set(ready)]

    def outcome_of(self, rank: int, ref) -> tuple[RankOutcome, object]:
        assert self.done_at[ref] <= self.now, "a call was read before it was done"
        if rank in self.errors:
            return RankOutcome(rank, "errored", error=self.errors[rank], cause="RuntimeError"), None
        return RankOutcome(rank, "ok"), {"rank": rank}


def test_a_world_finishing_together_is_gathered_in_a_few_waits():
    # 4,096 ranks leave their last collective together: the loop that waited for one call at a
    # time made 4,096 waits over ~8.4 million refs in all; batched, it is two waits.
    n = 4096
    calls = Calls([1.0] * n)
    outcomes, values = gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=5.0, clock=calls.clock)
    assert [o.kind for o in outcomes] == ["ok"] * n and values == [{"rank": r} for r in range(n)]
    assert len(calls.waits) <= 3, calls.waits
    assert sum(size for size, _ in calls.waits) <= 3 * n


def test_ranks_finishing_in_a_few_groups_take_a_few_waits_each():
    # Four nodes' ranks finish at four moments: at most two waits per moment.
    n = 4096
    calls = Calls([1.0 + 0.01 * (r % 4) for r in range(n)])
    outcomes, _ = gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=5.0, clock=calls.clock)
    assert all(o.kind == "ok" for o in outcomes)
    assert len(calls.waits) <= 8 and sum(size for size, _ in calls.waits) <= 5 * n, calls.waits


def test_the_hang_watch_is_polled_once_per_interval_not_once_per_finished_rank():
    # 1,000 ranks finish one by one over 2 s; the watch (every 0.25 s) is asked 8 times, not 1,000.
    n = 1000
    calls = Calls([0.002 * (r + 1) for r in range(n)])
    polls = []

    def hung(running):
        polls.append((calls.now, len(running)))
        return {}

    outcomes, _ = gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=5.0, poll_s=0.25, hung=hung,
                               clock=calls.clock)
    assert all(o.kind == "ok" for o in outcomes)
    assert 6 <= len(polls) <= 9, polls
    assert all(later - earlier >= 0.25 for (earlier, _), (later, _) in zip(polls, polls[1:]))
    # Each poll hands over the ranks still running: fewer each time.
    assert [size for _, size in polls] == sorted((size for _, size in polls), reverse=True)


def test_a_failure_wakes_the_others_once_and_gives_them_drain_s():
    # Rank 3 fails at 0.5 s; the others finish at 1 s but rank 7 never does: silent after the drain.
    done = [1.0] * 8
    done[3], done[7] = 0.5, math.inf
    calls = Calls(done, errors={3: "gloo: connection reset"})
    woken = []
    outcomes, values = gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=2.0,
                                    failed=lambda running: woken.append((calls.now, running)), clock=calls.clock)
    assert woken == [(0.5, [0, 1, 2, 4, 5, 6, 7])]
    assert [o.kind for o in outcomes] == ["ok"] * 3 + ["errored"] + ["ok"] * 3 + ["silent"]
    assert outcomes[7].error == "no answer 2s after a peer failed" and calls.now == 2.5
    assert values[3] is None and values[0] == {"rank": 0}


def test_a_hung_rank_is_given_up_and_the_others_drain():
    # Rank 1 stops making progress: the watch names it at its second poll; it is not waited for.
    calls = Calls([math.inf, math.inf, 3.0, 3.0])
    woken = []

    def hung(running):
        return {1: RankOutcome(1, "hung", error="no progress")} if calls.now >= 0.5 else {}

    outcomes, _ = gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=1.0, poll_s=0.25, hung=hung,
                               failed=lambda running: woken.append(running), clock=calls.clock)
    assert woken == [[0, 2, 3]]
    assert [o.kind for o in outcomes] == ["silent", "hung", "silent", "silent"]
    assert calls.now == 1.5  # drained for 1 s after the hang was found at 0.5 s


def test_a_settle_of_a_broken_world_waits_until_its_deadline_and_wakes_nobody_again():
    # `deadline` given: the world already failed; no further failure callback, no hang polls.
    calls = Calls([None, 0.2, 5.0])
    called = []
    outcomes, _ = gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=1.0, poll_s=0.25,
                               hung=lambda running: called.append("hung") or {},
                               failed=lambda running: called.append("failed"), deadline=1.0, clock=calls.clock)
    assert [o.kind for o in outcomes] == ["ok", "ok", "silent"] and called == []
    assert calls.now == 1.0
    assert all(size <= 2 for size, _ in calls.waits)  # rank 0 had no call: never waited for


def test_the_callers_idle_work_runs_while_the_calls_run_and_stops_at_the_first_failure():
    # A round of 3 s (poll every 1 s): the driver's own work (a save's commit) runs while it waits,
    # not after. A rank failing at 2.5 s stops it: the drain is for the failure alone.
    calls = Calls([3.0, 3.0])
    seen = []
    gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=5.0, poll_s=1.0, clock=calls.clock,
                 idle=lambda: seen.append(calls.now))
    assert seen == [1.0, 2.0]
    calls, seen = Calls([2.5, 6.0], errors={0: "boom"}), []
    outcomes, _ = gather_calls(calls.refs, calls.wait, calls.outcome_of, drain_s=5.0, poll_s=1.0, clock=calls.clock,
                               idle=lambda: seen.append(calls.now))
    assert seen == [1.0, 2.0] and outcomes[0].kind == "errored" and outcomes[1].kind == "ok"

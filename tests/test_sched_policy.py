"""The scheduler's decisions (airay.sched.policy): admission, priorities, shrink before evict, quotas, grow-back."""

import pytest

from airay.sched.policy import Cluster, Job, Policy, decide

C64 = Cluster(nodes=8, gpus_per_node=8)


def job(id, priority=0, lo=8, hi=8, team="a", submit=0.0, m=1, **kw):
    return Job(id, team, priority, lo, hi, m, submit, **kw)


def test_admits_when_min_workers_fit_and_waits_with_a_reason_when_not():
    jobs = [job("big", lo=32, hi=64), job("small", lo=8, hi=8, submit=1.0)]
    d = decide(C64, jobs, {}, policy="shrink")
    # Admitted at its min, then grown into what is left: the small job's 8 stay its own.
    assert d.targets == {"big": 56, "small": 8} and set(d.admitted) == {"big", "small"}
    d = decide(C64, [job("huge", lo=72, hi=72)], {})
    assert d.targets == {"huge": 0} and d.reasons["huge"] == "waiting: needs 72 GPUs, more than the cluster's 64"
    d = decide(C64, [job("run", priority=1, lo=40, hi=40), job("wait", lo=32, hi=32)], {"run": 40})
    assert d.targets["wait"] == 0
    assert d.reasons["wait"] == "waiting: needs 32 GPUs, 24 free; 40 by higher-priority jobs"


def test_evict_policy_admits_the_largest_size_that_fits_and_never_resizes():
    d = decide(C64, [job("a", lo=16, hi=128)], {}, policy="evict")
    assert d.targets == {"a": 64}
    d = decide(C64, [job("a", lo=16, hi=64), job("b", lo=8, hi=64, submit=1)], {"a": 48}, policy="evict")
    assert d.targets == {"a": 48, "b": 16} and d.grown == () and "fixed at admission" in d.reasons["a"]


def test_priority_first_then_submit_time():
    jobs = [job("early-low", 0, 48, 48, submit=0), job("late-high", 2, 48, 48, submit=5),
            job("mid", 1, 16, 16, submit=1), job("mid-later", 1, 16, 16, submit=2)]
    d = decide(C64, jobs, {})
    assert d.targets == {"early-low": 0, "late-high": 48, "mid": 16, "mid-later": 0}
    assert d.admitted == ("late-high", "mid")
    # The same snapshot in another order gives the same decision.
    assert decide(C64, list(reversed(jobs)), {}).targets == d.targets


def test_a_higher_priority_arrival_shrinks_the_lowest_priority_elastic_job_first_never_below_its_min():
    jobs = [job("p0", 0, 8, 32), job("p1", 1, 8, 32), job("hi", 2, 16, 16, submit=9)]
    d = decide(C64, jobs, {"p0": 32, "p1": 32})
    assert d.targets == {"p0": 16, "p1": 32, "hi": 16} and d.shrunk == ("p0",) and d.preempted == ()
    assert d.reasons["p0"] == "running at 16 of 32: shrunk for hi (priority 2)"
    # Needing more than the lowest can give: it goes to its min, then the next one shrinks.
    jobs[2] = job("hi", 2, 40, 40, submit=9)
    d = decide(C64, jobs, {"p0": 32, "p1": 32})
    assert d.targets == {"p0": 8, "p1": 16, "hi": 40} and d.preempted == ()


def test_eviction_only_when_shrinking_cannot_make_room():
    running = {"rigid": 32, "elastic": 32}
    jobs = [job("rigid", 0, 32, 32, submit=1), job("elastic", 0, 8, 32, submit=0)]
    d = decide(C64, [*jobs, job("hi", 1, 24, 24, submit=5)], running, policy="shrink")
    assert d.targets == {"rigid": 32, "elastic": 8, "hi": 24} and d.preempted == ()
    d = decide(C64, [*jobs, job("hi", 1, 40, 40, submit=5)], running, policy="shrink")
    # Shrinking gives 24 of the 40: the rigid job goes (checkpointed first), and the elastic one
    # keeps all it can.
    assert d.targets == {"rigid": 0, "elastic": 24, "hi": 40} and d.preempted == ("rigid",)
    assert d.reasons["rigid"] == "preempted for hi (priority 1); requeued"
    # The Kueue-like baseline evicts at once, the newest first, and spares what was not needed.
    d = decide(C64, [*jobs, job("hi", 1, 24, 24, submit=5)], running, policy="evict")
    assert d.targets == {"rigid": 0, "elastic": 32, "hi": 24} and d.preempted == ("rigid",)


def test_evicted_job_readmitted_in_the_same_decision_is_a_restart():
    jobs = [job("low", 0, 8, 64), job("hi", 1, 32, 32, submit=5)]
    d = decide(C64, jobs, {"low": 64}, policy="evict")
    assert d.targets == {"low": 32, "hi": 32}
    assert "low" in d.preempted and "low" in d.admitted
    assert d.reasons["low"] == "preempted for hi (priority 1); requeued, readmitted at 32"


def test_equal_priority_admission_takes_only_what_others_hold_above_their_min():
    d = decide(C64, [job("old", 1, 16, 64), job("new", 1, 16, 16, submit=5)], {"old": 64})
    assert d.targets == {"old": 48, "new": 16} and d.preempted == ()
    d = decide(C64, [job("old", 1, 64, 64), job("new", 1, 16, 16, submit=5)], {"old": 64})
    assert d.targets == {"old": 64, "new": 0} and d.preempted == ()  # never evicts its own priority
    assert "64 by jobs of its priority" in d.reasons["new"]


def test_quotas_guaranteed_gpus_of_a_team_are_never_taken_by_another_teams_lower_or_equal_priority_job():
    quotas = {"a": 32, "b": 32}
    # Team a uses its guarantee; team b borrows nothing: b's new job, of a's priority or lower, waits.
    for prio in (0, 1):
        jobs = [job("a1", 1, 16, 32, team="a"), job("b1", 1, 32, 32, team="b"), job("b2", prio, 16, 16, team="b",
                                                                                      submit=5)]
        d = decide(C64, jobs, {"a1": 32, "b1": 32}, quotas)
        assert d.targets == {"a1": 32, "b1": 32, "b2": 0}
    assert "32 of them within other teams' guarantees" in decide(C64, jobs, {"a1": 32, "b1": 32}, quotas).reasons["b2"]
    # Without quotas the same arrival of equal priority shrinks a1's surplus.
    assert decide(C64, jobs, {"a1": 32, "b1": 32}).targets["a1"] == 16
    # A higher-priority job of another team may take them: priority comes first.
    jobs[2] = job("b2", 2, 16, 16, team="b", submit=5)
    assert decide(C64, jobs, {"a1": 32, "b1": 32}, quotas).targets == {"a1": 16, "b1": 32, "b2": 16}


def test_borrowed_idle_quota_is_given_back_by_shrinking_the_borrower():
    quotas = {"a": 32, "b": 32}
    # Team a was idle: b's elastic job grew into a's quota (borrowing 32).
    d = decide(C64, [job("b1", 1, 8, 64, team="b")], {}, quotas)
    assert d.targets == {"b1": 64}
    # a's job of the same priority arrives: b's job shrinks, first to admit it, then to let it grow
    # to a's guarantee; no eviction.
    jobs = [job("b1", 1, 8, 64, team="b"), job("a1", 1, 16, 64, team="a", submit=5)]
    d = decide(C64, jobs, {"b1": 64}, quotas)
    assert d.targets == {"b1": 32, "a1": 32} and d.preempted == ()
    # Above its guarantee, a takes nothing more from b at equal priority.
    assert decide(C64, jobs, {"b1": 32, "a1": 32}, quotas).targets == {"b1": 32, "a1": 32}
    # A rigid borrower is evicted whole only if all its GPUs are borrowed.
    rigid = [job("b1", 1, 24, 24, team="b"), job("b2", 1, 40, 40, team="b", submit=1),
             job("a1", 1, 16, 16, team="a", submit=5)]
    d = decide(C64, rigid, {"b1": 24, "b2": 40}, quotas)
    assert d.targets == {"b1": 0, "b2": 40, "a1": 16} and d.preempted == ("b1",)


def test_grow_back_when_capacity_frees():
    jobs = [job("low", 0, 16, 64)]
    assert decide(C64, jobs, {"low": 32}, policy="shrink").targets == {"low": 64}
    assert decide(C64, jobs, {"low": 32}, policy="evict").targets == {"low": 32}
    # Highest priority grows first, and takes what lower-priority jobs hold above their min.
    jobs = [job("low", 0, 16, 64), job("high", 1, 16, 64, submit=3)]
    d = decide(C64, jobs, {"low": 40, "high": 16})
    assert d.targets == {"low": 16, "high": 48} and d.grown == ("high",) and d.shrunk == ("low",)


def test_world_size_multiple_is_respected():
    c = Cluster(nodes=4, gpus_per_node=8)
    jobs = [job("nodes", 0, 8, 32, m=8), job("small", 1, 4, 4, submit=1)]
    d = decide(c, jobs, {"nodes": 32})
    assert d.targets == {"nodes": 24, "small": 4}  # a whole node given up; 4 GPUs stay free
    assert decide(c, [job("nodes", 0, 8, 32, m=8)], {"nodes": 24}).targets == {"nodes": 32}
    assert decide(c, [job("odd", 0, 5, 30, m=8)], {}).targets == {"odd": 24}
    with pytest.raises(ValueError, match="no multiple of world_size_multiple \\(8\\) lies in"):
        decide(c, [job("bad", 0, 9, 15, m=8)], {})


def test_goodput_policy_grows_only_when_the_grow_pays_for_its_resize():
    c = Cluster(nodes=2, gpus_per_node=8)
    pol = Policy("goodput", resize_s=100.0, horizon_s=3600.0)
    # At 4 GPUs with 720 GPU-s left: 180 s to the end. Growing to 8 adds 4 x 180 of work in that
    # time and idles 8 x 100: not worth it (the job would end later: 100 + 90 > 180).
    lean = [job("j", 0, 4, 8, remaining_gpu_s=720.0)]
    d = decide(c, lean, {"j": 4}, policy=pol)
    assert d.targets == {"j": 4}
    assert d.reasons["j"] == ("running at 4 of 8: growing to 8 would gain 720 GPU-s within the horizon and idle "
                              "800 GPU-s in resizes; not worth it")
    assert decide(c, lean, {"j": 4}, policy="shrink").targets == {"j": 8}
    # With more work left it pays, and also where the remaining work is unknown (the horizon counts).
    assert decide(c, [job("j", 0, 4, 8, remaining_gpu_s=4000.0)], {"j": 4}, policy=pol).targets == {"j": 8}
    assert decide(c, [job("j", 0, 4, 8)], {"j": 4}, policy=pol).targets == {"j": 8}
    # A start is no resize: a new job takes all it can at once.
    assert decide(c, [job("n", 0, 4, 8, remaining_gpu_s=10.0)], {}, policy=pol).targets == {"n": 8}


def test_lost_capacity_shrinks_the_lowest_priority_first_or_evicts_it():
    c = Cluster(nodes=4, gpus_per_node=8)  # was 8 nodes
    jobs = [job("p0", 0, 8, 32), job("p1", 1, 16, 32), job("p2", 2, 8, 8)]
    alloc = {"p0": 32, "p1": 24, "p2": 8}
    d = decide(c, jobs, alloc)
    assert d.targets == {"p0": 8, "p1": 16, "p2": 8} and d.shrunk == ("p1", "p0") and d.preempted == ()
    d = decide(c, jobs, alloc, policy="evict")
    assert d.targets == {"p0": 0, "p1": 24, "p2": 8} and d.preempted == ("p0",)
    assert d.reasons["p0"] == "preempted for the cluster lost capacity; requeued"


def test_bad_snapshots_are_refused_with_what_is_wrong():
    with pytest.raises(ValueError, match="job id 'x' appears twice"):
        decide(C64, [job("x"), job("x")], {})
    with pytest.raises(ValueError, match="allocations of unknown jobs: \\['y'\\]"):
        decide(C64, [job("x")], {"y": 8})
    with pytest.raises(ValueError, match="quotas add up to 72 GPUs"):
        decide(C64, [job("x")], {}, {"a": 40, "b": 32})
    with pytest.raises(ValueError, match="policy must be one of"):
        decide(C64, [job("x")], {}, policy="fair")

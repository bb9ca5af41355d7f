import pytest

from airay import policy
from airay.policy import BatchPlan


def test_plan_keeps_global_batch_and_prefers_large_micro_batches():
    assert policy.plan_batch(24, 4, 4) == BatchPlan(4, 3, 2)
    assert policy.plan_batch(24, 4, 3) == BatchPlan(3, 4, 2)
    assert policy.plan_batch(24, 4, 2) == BatchPlan(2, 4, 3)
    assert policy.plan_batch(24, 8, 1) == BatchPlan(1, 8, 3)
    for w in (1, 2, 3, 4, 6, 8, 12, 24):
        plan = policy.plan_batch(24, 5, w)
        assert plan.global_batch_size == 24 and plan.micro_batch_size <= 5


def test_plan_refuses_uneven_split():
    assert policy.plan_batch(24, 4, 5) is None
    assert policy.plan_batch(10, 4, 4) is None


def test_batch_plans_names_impossible_sizes_and_a_fix():
    with pytest.raises(policy.PolicyError) as err:
        policy.batch_plans(16, 4, 2, 4)
    msg = str(err.value)
    assert "[3]" in msg and "12" in msg  # lcm(2,3,4) = 12 suggested
    plans = policy.batch_plans(12, 4, 2, 4)
    assert sorted(plans) == [2, 3, 4]


def test_choose_world_size():
    assert policy.choose_world_size(10, 2, 4) == 4
    assert policy.choose_world_size(3, 2, 4) == 3
    assert policy.choose_world_size(1, 2, 4) is None


def test_decide_recovery_shrinks_to_survivors_or_waits():
    assert policy.decide_recovery(3, 0, 2, 4) == policy.RecoveryDecision("resize", 3)
    assert policy.decide_recovery(3, 1, 2, 4) == policy.RecoveryDecision("resize", 4)
    assert policy.decide_recovery(1, 0, 2, 4) == policy.RecoveryDecision("wait")
    assert policy.decide_recovery(1, 1, 2, 4) == policy.RecoveryDecision("resize", 2)


def test_should_grow():
    assert policy.should_grow(3, 1, 4) == 4
    assert policy.should_grow(2, 5, 4) == 4
    assert policy.should_grow(4, 1, 4) is None
    assert policy.should_grow(3, 0, 4) is None


@pytest.mark.parametrize("step,faults,expected", [
    (0, [], 5), (5, [], 10), (3, [], 5), (0, [3], 3), (3, [3], 5), (8, [], 10), (18, [], 20),
])
def test_rounds_stop_at_checkpoints_and_before_faults(step, faults, expected):
    assert policy.next_round_end(step, 20, 5, 5, faults) == expected
    assert policy.next_round_end(step, 20, 100, 10, []) == min(20, (step // 10 + 1) * 10)


def test_failure_budget_counts_a_sliding_window():
    from airay.policy import budget_exceeded, failures_in_window

    ts = [0.0, 100.0, 200.0, 290.0]
    assert failures_in_window(ts, now=300.0, window_s=150.0) == 2
    assert not budget_exceeded(ts, now=300.0, window_s=150.0, max_failures=2)
    assert budget_exceeded(ts + [299.0], now=300.0, window_s=150.0, max_failures=2)
    assert not budget_exceeded(ts + [299.0], now=1000.0, window_s=150.0, max_failures=2)  # all aged out


def test_restart_backoff_doubles_and_caps():
    from airay.policy import restart_backoff_s

    assert [restart_backoff_s(n, 1.0, 5.0) for n in (1, 2, 3, 4, 5)] == [0.0, 1.0, 2.0, 4.0, 5.0]
    assert restart_backoff_s(6, 0.0, 5.0) == 0.0


def test_nodes_to_exclude():
    from airay.policy import nodes_to_exclude

    counts = {"a": 2, "b": 1, "c": 3}
    assert nodes_to_exclude(counts, 2, set()) == ["a", "c"]
    assert nodes_to_exclude(counts, 2, {"a"}) == ["c"]
    assert nodes_to_exclude(counts, 0, set()) == []

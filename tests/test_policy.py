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

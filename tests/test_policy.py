import pytest

from airay import policy
from airay.policy import BatchPlan


def test_plan_keeps_global_batch_and_prefers_large_micro_batches():
    assert policy.plan_batch(24, 4, 4) == BatchPlan(4, 24, 3, 2)
    assert policy.plan_batch(24, 4, 3) == BatchPlan(3, 24, 4, 2)
    assert policy.plan_batch(24, 4, 2) == BatchPlan(2, 24, 4, 3)
    assert policy.plan_batch(24, 8, 1) == BatchPlan(1, 24, 8, 3)


@pytest.mark.parametrize("gbs,micro", [(24, 4), (16, 4), (16, 1), (7, 3), (720, 8), (13, 5)])
def test_every_world_size_covers_the_global_batch_exactly(gbs, micro):
    """Any world size up to the batch: contiguous rank shares that tile the batch, the same
    number of micro-batches on every rank (DeepSpeed's collectives pair up), none larger than
    the micro-batch limit, and loss weights that make the update the global mean."""
    for w in range(1, gbs + 1):
        plan = policy.plan_batch(gbs, micro, w)
        rows = [plan.rank_rows(r) for r in range(w)]
        assert rows[0][0] == 0 and rows[-1][1] == gbs
        assert all(rows[r][1] == rows[r + 1][0] for r in range(w - 1))
        shares = [hi - lo for lo, hi in rows]
        assert max(shares) - min(shares) <= 1 and min(shares) >= 1
        for r in range(w):
            sizes = plan.micro_sizes(r)
            assert len(sizes) == plan.grad_accum_steps and sum(sizes) == shares[r]
            assert max(sizes) <= plan.micro_batch_size <= micro
        # DeepSpeed averages over world x accumulation, each micro-batch's loss is a mean over its
        # n samples: every sample must weigh 1/gbs in the update, a padded slot nothing.
        for r in range(w):
            for n in plan.micro_sizes(r):
                per_sample = plan.loss_scale(n) / (w * plan.grad_accum_steps * n) if n else plan.loss_scale(n)
                assert per_sample == pytest.approx(1 / gbs if n else 0.0)
        ds = plan.deepspeed_fields()
        assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * w


def test_uneven_split_16_over_3():
    plan = policy.plan_batch(16, 4, 3)
    assert [plan.rank_rows(r) for r in range(3)] == [(0, 6), (6, 11), (11, 16)]
    assert [plan.micro_sizes(r) for r in range(3)] == [[3, 3], [3, 2], [3, 2]]
    assert plan.loss_scale(3) == 1.125 and plan.loss_scale(2) == 0.75
    # A share smaller than the accumulation steps: a padded micro-batch, weighted 0.
    tight = policy.plan_batch(16, 1, 3)
    assert tight.grad_accum_steps == 6 and tight.micro_sizes(1) == [1, 1, 1, 1, 1, 0]
    assert tight.loss_scale(0) == 0
    # Even splits keep every weight exactly 1: the same update as before uneven worlds existed.
    even = policy.plan_batch(24, 4, 4)
    assert {even.loss_scale(n) for r in range(4) for n in even.micro_sizes(r)} == {1.0}


def test_plan_refuses_a_world_larger_than_the_batch():
    assert policy.plan_batch(8, 4, 9) is None
    with pytest.raises(policy.PolicyError) as err:
        policy.batch_plans(8, 4, [1, 2, 16])
    msg = str(err.value)
    assert "global_batch_size 8" in msg and "16" in msg and "scaling.max_workers" in msg
    plans = policy.batch_plans(16, 4, [2, 3, 4])
    assert sorted(plans) == [2, 3, 4]


def test_a_plan_over_model_parallel_replicas_gives_every_rank_of_a_replica_its_samples():
    # Worlds of 4, 8 and 12 ranks in replicas of 4 (tensor x sequence parallel): 1, 2 and 3
    # replicas split the same 12 samples; each step's rows are the same whatever the size.
    plans = policy.batch_plans(12, 2, [4, 8, 12], model_parallel=4)
    assert {w: p.world_size for w, p in plans.items()} == {4: 1, 8: 2, 12: 3}
    assert [plans[12].rank_rows(r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert plans[8].deepspeed_fields() == {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 2,
                                           "gradient_accumulation_steps": 3}  # DeepSpeed counts replicas
    with pytest.raises(policy.PolicyError, match="smaller than 4 data-parallel replicas"):
        policy.batch_plans(3, 2, [16], model_parallel=4)


def test_allowed_world_sizes_by_whole_nodes():
    assert policy.allowed_world_sizes(1, 4) == [1, 2, 3, 4]
    assert policy.allowed_world_sizes(8, 64, 8) == [8, 16, 24, 32, 40, 48, 56, 64]
    assert policy.allowed_world_sizes(1, 20, 8) == [8, 16]
    assert policy.allowed_world_sizes(9, 15, 8) == []


def test_choose_world_size():
    assert policy.choose_world_size(10, [2, 3, 4]) == 4
    assert policy.choose_world_size(3, [2, 3, 4]) == 3
    assert policy.choose_world_size(1, [2, 3, 4]) is None
    assert policy.choose_world_size(63, policy.allowed_world_sizes(8, 64, 8)) == 56


def test_decide_recovery_shrinks_to_survivors_or_waits():
    sizes = [2, 3, 4]
    assert policy.decide_recovery(3, 0, sizes) == policy.RecoveryDecision("resize", 3)
    assert policy.decide_recovery(3, 1, sizes) == policy.RecoveryDecision("resize", 4)
    assert policy.decide_recovery(1, 0, sizes) == policy.RecoveryDecision("wait")
    assert policy.decide_recovery(1, 1, sizes) == policy.RecoveryDecision("resize", 2)
    # A lost GPU of an 8-GPU node: 63 survivors, whole nodes only: 56.
    nodes = policy.allowed_world_sizes(8, 64, 8)
    assert policy.decide_recovery(63, 0, nodes) == policy.RecoveryDecision("resize", 56)
    assert policy.decide_recovery(7, 0, nodes) == policy.RecoveryDecision("wait")


def test_should_grow():
    sizes = [2, 3, 4]
    assert policy.should_grow(3, 1, sizes) == 4
    assert policy.should_grow(2, 5, sizes) == 4
    assert policy.should_grow(4, 1, sizes) is None
    assert policy.should_grow(3, 0, sizes) is None
    nodes = policy.allowed_world_sizes(8, 64, 8)
    assert policy.should_grow(56, 7, nodes) is None  # not a whole node yet
    assert policy.should_grow(56, 8, nodes) == 64


def test_ranks_to_idle_keeps_whole_nodes():
    # 16 GPUs on nodes a and b; b lost one (rank 9): 15 survivors, allowed 8: b's 7 step out.
    survivors = ["a"] * 8 + ["b"] * 7
    assert policy.ranks_to_idle(survivors, 8) == list(range(8, 15))
    # Interleaved ranks: the smaller node goes first, then the highest ranks.
    assert policy.ranks_to_idle(["a", "b", "a", "b", "a"], 3) == [1, 3]
    assert policy.ranks_to_idle(["a", "b", "c"], 3) == []
    assert policy.ranks_to_idle(["a", "a", "b", "b"], 2) == [2, 3]


@pytest.mark.parametrize("step,faults,expected", [
    (0, [], 5), (5, [], 10), (3, [], 5), (0, [3], 3), (3, [3], 5), (8, [], 10), (18, [], 20),
])
def test_rounds_stop_at_checkpoints_and_before_faults(step, faults, expected):
    assert policy.next_round_end(step, 20, 5, 5, faults) == expected
    assert policy.next_round_end(step, 20, 100, 10, []) == min(20, (step // 10 + 1) * 10)


def test_a_round_is_pipelined_unless_the_driver_has_work_at_its_end():
    assert policy.can_pipeline(5, 20, 10)
    assert not policy.can_pipeline(10, 20, 10)  # a checkpoint at 10
    assert not policy.can_pipeline(20, 20, 100)  # the run's end
    assert [e for e in range(1, 20) if policy.can_pipeline(e, 20, 1)] == []  # a checkpoint every step


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


def test_grows_are_batched_while_more_workers_are_about_to_come_up():
    from airay.policy import grow_now

    sizes = [2, 3, 4]
    # One replacement stands by, another is still starting: wait for it, up to the settle time.
    assert not grow_now(2, 1, 1, ready_for_s=1.0, settle_s=5.0, sizes=sizes)
    assert grow_now(2, 1, 1, ready_for_s=5.0, settle_s=5.0, sizes=sizes)  # it did not come: grow to 3
    assert grow_now(2, 2, 0, ready_for_s=0.0, settle_s=5.0, sizes=sizes)  # both up: one grow to 4
    assert grow_now(3, 1, 0, ready_for_s=0.0, settle_s=5.0, sizes=sizes)  # nothing else coming
    assert grow_now(3, 1, 3, ready_for_s=0.0, settle_s=5.0, sizes=sizes)  # the rest cannot make it larger
    assert not grow_now(4, 1, 0, ready_for_s=9.0, settle_s=5.0, sizes=sizes)  # already at the largest
    assert grow_now(2, 1, 1, ready_for_s=0.0, settle_s=0.0, sizes=sizes)  # settle 0: grow at once


def test_an_incident_counts_once_per_node_and_not_at_all_when_it_struck_most_nodes():
    from airay.policy import incident_nodes

    assert incident_nodes({"a"}, {"a", "b", "c"}) == ({"a"}, False)
    assert incident_nodes({"a", None}, {"a", "b"}) == ({"a"}, False)  # a rank with no node yet
    assert incident_nodes({"a"}, {"a"}) == ({"a"}, False)  # a one-node world: nothing to compare with
    assert incident_nodes({"a", "b"}, {"a", "b", "c", "d"}) == ({"a", "b"}, False)  # half is not most
    assert incident_nodes({"a", "b"}, {"a", "b", "c"}) == (set(), True)
    assert incident_nodes({"a", "b"}, {"a", "b"}) == (set(), True)

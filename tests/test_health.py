import random
import statistics

from airay.health import Failure, LocalTimeWindow, RankOutcome, classify_round, deadline, find_hung, find_stragglers, \
    median_without, merge_pipelined, node_mates, position, summarize_failures


def test_all_ok():
    assert classify_round([RankOutcome(0, "ok"), RankOutcome(1, "ok")]).kind == "ok"


def test_death_makes_survivor_errors_collateral():
    v = classify_round([RankOutcome(0, "errored", "gloo: connection reset"), RankOutcome(1, "died"),
                        RankOutcome(2, "silent")])
    assert v.kind == "lost" and v.lost_ranks == (1, 2)


def test_user_error_fails_fast_with_rank_and_traceback():
    v = classify_round([RankOutcome(0, "ok"), RankOutcome(1, "errored", "ZeroDivisionError\nTraceback", True)])
    assert v.kind == "user_error" and "rank 1" in v.message and "Traceback" in v.message


def test_comm_error_without_loss():
    v = classify_round([RankOutcome(0, "errored", "gloo timeout"), RankOutcome(1, "ok")])
    assert v.kind == "comm_error" and v.lost_ranks == ()


def test_infrastructure_errors_are_lost_ranks_not_user_errors():
    # A MemoryError inside the step is the machine's limit; a lost object is a lost node's.
    v = classify_round([RankOutcome(0, "errored", "MemoryError", cause="MemoryError"),
                        RankOutcome(1, "errored", "gloo: connection reset", cause="RuntimeError")])
    assert v.kind == "lost" and v.lost_ranks == (0,) and v.outcomes[0].fault == "oom"
    v = classify_round([RankOutcome(0, "ok"), RankOutcome(1, "errored", "lost", cause="ObjectLostError")])
    assert v.kind == "lost" and v.outcomes[1].fault == "object_lost"
    v = classify_round([RankOutcome(0, "hung", "no progress"), RankOutcome(1, "errored", "reset")])
    assert v.kind == "lost" and v.lost_ranks == (0,) and v.outcomes[0].fault == "hung"


def test_user_error_wins_over_collateral_comm_errors_but_not_over_a_loss():
    v = classify_round([RankOutcome(0, "errored", "gloo reset"),
                        RankOutcome(1, "errored", "ValueError", user_error=True, cause="UserCodeError")])
    assert v.kind == "user_error" and "rank 1" in v.message
    v = classify_round([RankOutcome(0, "died"), RankOutcome(1, "errored", "ValueError", user_error=True)])
    assert v.kind == "lost"


def test_phase_positions_order_progress_within_a_step():
    assert position({"step": 3, "micro": 0, "phase": "forward"}) < position({"step": 3, "micro": 0, "phase": "backward"})
    assert position({"step": 3, "micro": 1, "phase": "data"}) > position({"step": 3, "micro": 0, "phase": "optimizer"})
    assert position({}) < position({"step": 0, "micro": -1, "phase": "data"})


def test_collective_calls_order_ranks_inside_a_phase():
    at = {"step": 3, "micro": 1, "phase": "backward"}
    before_k = position({**at, "collectives": [4, 4]})  # left call 4, never entered call 5
    inside_k = position({**at, "collectives": [5, 4]})  # waits inside call 5
    assert before_k < inside_k < position({**at, "collectives": [5, 5]})
    assert position({**at, "collectives": [9, 9]}) < position({"step": 3, "micro": 1, "phase": "optimizer"})
    # torch's group counters (completed, started, enqueued) break a tie of the host's counts: under
    # NCCL a rank whose device never started collective 5 is behind peers whose devices did.
    host = {**at, "collectives": [5, 5]}
    assert position({**host, "groups": [4, 4, 5]}) < position({**host, "groups": [4, 5, 5]})
    assert position({**host, "groups": [4, 4, 5]}, groups=False) == position({**host, "groups": [4, 5, 5]}, groups=False)


def answered(at: float, *ranks: int) -> dict[int, float]:
    return dict.fromkeys(ranks, at)


def test_find_hung_names_the_rank_the_others_wait_for():
    fwd, coll = (5, 0, 2, 0, 0), (5, 1, 3, 1, 0)  # rank 1 stuck in forward; the others blocked in the all-reduce
    positions = {0: coll, 1: fwd, 2: coll}
    changed = {0: 7.0, 1: 2.0, 2: 7.5}
    assert find_hung(positions, changed, answered(3.9, 0, 1, 2), now=4.0, timeouts=3) == []
    assert find_hung(positions, changed, answered(7.9, 0, 1, 2), now=8.0, timeouts=3) == [1]  # others still moved
    assert find_hung(positions, changed, answered(10.9, 0, 1, 2), now=11.0, timeouts=3) == [1]  # all stalled, 1 behind
    # the furthest-behind rank still moves: the stalled ones wait on it
    assert find_hung({0: coll, 1: fwd}, {0: 0.0, 1: 10.0}, answered(10.9, 0, 1), now=11.0, timeouts=3) == []


def test_every_rank_stalled_at_one_step_phase_names_only_the_one_that_never_entered_the_collective():
    """stall_collective, or one GPU stopping under NCCL: every rank stands still in the same
    micro-batch and phase; the one that left call 2 and never entered call 3 is named alone."""
    at = {"step": 6, "micro": 0, "phase": "backward"}
    beats = {0: {**at, "collectives": [3, 2]}, 1: {**at, "collectives": [2, 2]}, 2: {**at, "collectives": [3, 2]},
             3: {**at, "collectives": [3, 2]}}
    positions = {r: position(b) for r, b in beats.items()}
    assert find_hung(positions, dict.fromkeys(beats, 0.0), answered(9.5, 0, 1, 2, 3), now=10.0, timeouts=4) == [1]
    # Without the counts (the old (step, micro, phase) place) it would be every rank:
    coarse = {r: p[:3] for r, p in positions.items()}
    assert find_hung(coarse, dict.fromkeys(beats, 0.0), answered(9.5, 0, 1, 2, 3), now=10.0, timeouts=4) == [0, 1, 2, 3]


def test_find_hung_prefers_a_rank_whose_heartbeat_stopped():
    positions = {0: (5, 0, 2, 1, 0), 1: (5, 0, 2, 1, 0)}
    assert find_hung(positions, {0: 0.0, 1: 0.0}, {0: 4.9, 1: 0.0}, now=5.0, timeouts=3) == [1]


def test_of_silent_ranks_the_one_whose_heartbeat_stopped_first_is_hung():
    positions = dict.fromkeys(range(3), (5, 0, 2, 1, 0))
    changed = dict.fromkeys(range(3), 0.0)
    # rank 2 stopped answering at 1.0, ranks 0 and 1 later (stuck behind it): rank 2 alone
    assert find_hung(positions, changed, {0: 6.0, 1: 6.0, 2: 1.0}, now=10.0, timeouts=3) == [2]
    # stopped within one heartbeat poll of each other: they cannot be told apart
    assert find_hung(positions, changed, {0: 1.5, 1: 6.0, 2: 1.0}, now=10.0, timeouts=3, poll_s=1.0) == [0, 2]


def test_find_hung_all_ranks_stuck_at_the_same_place():
    """A deadlock, or a fault every rank shares: the same collective entered and left by none."""
    positions = {0: (5, 0, 2, 3, 2), 1: (5, 0, 2, 3, 2)}
    assert find_hung(positions, {0: 0.0, 1: 0.0}, answered(4.9, 0, 1), now=5.0, timeouts=3) == [0, 1]


def test_a_ranks_first_step_in_a_world_has_its_own_deadline():
    assert deadline({}, 4.0, 20.0) == 20.0  # no heartbeat yet, in a world's first round
    assert deadline({"step": 5, "phase": "forward", "steps": 0}, 4.0, 20.0) == 20.0
    assert deadline({"step": 6, "phase": "forward", "steps": 1}, 4.0, 20.0) == 4.0  # its first step is done
    assert deadline({"step": 6, "phase": "forward", "steps": 0}, 4.0, None) == 4.0  # not a fresh rank
    # Rank 0 in its first step stood still 10 s: within its 20 s; rank 1, past its first step, is hung.
    same = (5, 0, 2, 1, 0)
    timeouts = {0: deadline({"steps": 0}, 4.0, 20.0), 1: deadline({"steps": 3}, 4.0, 20.0)}
    assert find_hung({0: (6, 0, 2, 1, 0), 1: same}, {0: 0.0, 1: 0.0}, answered(9.9, 0, 1), now=10.0,
                     timeouts=timeouts) == [1]
    assert find_hung({0: same, 1: same}, {0: 0.0, 1: 5.0}, answered(9.9, 0, 1), now=10.0, timeouts=timeouts) == []


def test_a_hung_ranks_node_goes_with_it():
    nodes = ["a", "a", "b", "b", None]
    assert node_mates(0, nodes) == [1] and node_mates(3, nodes) == [2]
    assert node_mates(4, nodes) == []  # a rank whose node is unknown: itself only
    assert node_mates(0, ["a"]) == []


def test_find_stragglers_uses_local_time_and_both_thresholds():
    fast, slow = [0.05, 0.06, 0.05], [0.45, 0.5, 0.46]
    assert find_stragglers([fast, slow, fast, fast], factor=2.0, min_excess_s=0.1) == [1]
    assert find_stragglers([fast, fast, fast], factor=2.0, min_excess_s=0.1) == []
    # twice as slow but only by 50 ms: noise on a busy machine, not a straggler
    assert find_stragglers([[0.05], [0.1], [0.05]], factor=1.5, min_excess_s=0.1) == []
    assert find_stragglers([fast], factor=2.0, min_excess_s=0.1) == []


def _stragglers_by_definition(local_s, factor, min_excess_s):
    """find_stragglers as its docstring defines it: each rank against a new list of the others."""
    if len(local_s) < 2:
        return []
    medians = [statistics.median(ts) for ts in local_s]
    out = []
    for rank, m in enumerate(medians):
        others = statistics.median(medians[:rank] + medians[rank + 1:])
        if m > factor * others and m - others >= min_excess_s:
            out.append(rank)
    return out


def test_find_stragglers_equals_the_definition_on_random_worlds():
    # Sorted once instead of a new list per rank; the answers (and the floats they compare) are the
    # definition's, for odd and even worlds, ties (values on a coarse grid) and real stragglers.
    rng = random.Random(28)
    found = 0
    for trial in range(400):
        world = rng.choice([2, 3, 4, 5, 8, 9, 16, 17, 64, 65])
        grid = rng.choice([None, 0.01, 0.05])  # ties: many ranks share a median
        local = []
        for _ in range(world):
            base = rng.choice([0.1, 0.1, 0.1, 0.35]) if trial % 2 else rng.uniform(0.05, 0.5)
            ts = [base * rng.uniform(0.9, 1.1) for _ in range(rng.choice([1, 2, 3, 4]))]
            local.append([round(t / grid) * grid for t in ts] if grid else ts)
        factor, excess = rng.choice([1.5, 2.0, 3.0]), rng.choice([0.0, 0.05, 0.1])
        expected = _stragglers_by_definition(local, factor, excess)
        assert find_stragglers(local, factor, excess) == expected, (local, factor, excess)
        found += bool(expected)
    assert found > 50  # the comparison covered worlds with stragglers, not only empty answers
    for values in ([1.0, 1.0], [1.0, 2.0], [3.0, 1.0, 2.0], [1.0, 1.0, 1.0, 5.0], [2.0, 2.0, 2.0, 2.0, 2.0]):
        ordered = sorted(values)
        for i, v in enumerate(values):
            assert median_without(ordered, v) == statistics.median(values[:i] + values[i + 1:])


def test_summarize_failures_names_kinds_ranks_nodes_steps():
    text = summarize_failures([Failure(1.0, "died", 1, "abcdef1234", 7), Failure(2.0, "died", 2, "abcdef1234", 9),
                               Failure(3.0, "hung", 0, "99999999aa", 12)])
    assert "died x2: ranks [1, 2], nodes ['abcdef12'], steps [7, 9]" in text
    assert "hung x1: ranks [0]" in text


def test_a_block_that_cannot_be_fetched_is_a_data_failure_not_a_lost_rank():
    data = RankOutcome(1, "errored", "DataFetchError: rank 1, step 7: block 00ab did not arrive", cause="DataFetchError",
                       step=7)
    v = classify_round([RankOutcome(0, "errored", "gloo: connection reset", cause="RuntimeError"), data,
                        RankOutcome(2, "ok")])
    assert v.kind == "data_lost" and v.lost_ranks == () and "rank 1" in v.message
    assert v.outcomes[1].fault == "data_lost" and not v.outcomes[1].infra and v.outcomes[1].step == 7
    # A rank really lost in the same round is still replaced; a user bug still fails fast.
    assert classify_round([RankOutcome(0, "died"), data]).kind == "lost"
    assert classify_round([RankOutcome(0, "errored", "ValueError", user_error=True), data]).kind == "user_error"


def test_a_round_queued_behind_a_failed_one_adds_only_its_lost_ranks():
    failed = [RankOutcome(0, "errored", error="peer gone", cause="DistBackendError"), RankOutcome(1, "died"),
              RankOutcome(2, "ok"), RankOutcome(3, "ok")]
    # Rank 1 was not waited for; rank 2's queued round failed as collateral; rank 3 went silent in it.
    behind = [RankOutcome(0, "errored", error="in no world", cause="RuntimeError"), None,
              RankOutcome(2, "errored", error="peer gone", cause="DistBackendError"), RankOutcome(3, "silent")]
    merged = merge_pipelined(failed, behind)
    assert [o.kind for o in merged] == ["errored", "died", "ok", "silent"]
    assert classify_round(merged).lost_ranks == (1, 3)
    assert merge_pipelined(failed, [None] * 4) == failed


def test_a_straggler_is_judged_on_a_window_of_steps_not_on_one_slow_step():
    # Seen in CI: rank 3's one step after the first checkpoint ran 0.70 s against 0.11 s, in a round
    # of that single step (the next step began a fault's round), and was reported as a straggler.
    window = LocalTimeWindow(steps=5)
    fast = [0.1] * 5
    assert window.add([fast, fast, fast, [0.1, 0.1]]) is None  # rank 3 has 2 of 5 steps: nothing judged
    judged = window.add([[0.1]] * 3 + [[0.1, 0.1, 0.1]])
    assert judged == [fast] * 4
    judged = window.add([[0.1], [0.1], [0.1], [0.7]])  # a round of one step, slow on rank 3
    assert judged[3] == [0.1, 0.1, 0.1, 0.1, 0.7]
    assert find_stragglers(judged, factor=2.0, min_excess_s=0.3) == []
    judged = window.add([[0.1] * 4, [0.1] * 4, [0.7] * 4, [0.1] * 4])  # rank 2 slow for 4 steps
    assert judged[2] == [0.1, 0.7, 0.7, 0.7, 0.7] and judged[3] == [0.7, 0.1, 0.1, 0.1, 0.1]
    assert find_stragglers(judged, factor=2.0, min_excess_s=0.3) == [2]
    assert window.add([[0.1]] * 3) is None  # a world of 3: ranks renumbered, a new window

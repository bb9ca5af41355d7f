from airay.health import RankOutcome, classify_round


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

"""Goodput and lost time per cause, on hand-built event timelines with known answers."""

import pytest

from airay import goodput


def m(step, ts, t=1.0):
    return {"step": step, "ts": ts, "step_time_s": t, "loss": 1.0}


def timeline():
    """Start at 100, first world at 110; steps 0-4 (1 s each); checkpoint at step 3; a failure
    at the round starting at step 5, detected at 117, world re-formed at 120 from the step-3
    checkpoint (steps 3 and 4 replayed); steps 3-9 kept; finished at 130."""
    events = [
        {"ts": 100.0, "type": "run_started"},
        {"ts": 110.0, "type": "world_formed", "step": 0},
        {"ts": 114.0, "type": "checkpoint_saved", "step": 3, "blocking_s": 0.5},
        {"ts": 117.5, "type": "resize_started", "step": 5, "reason": "failure"},
        {"ts": 120.0, "type": "world_formed", "step": 3},
        {"ts": 121.0, "type": "resize_finished", "step": 3, "recovery_s": 4.0, "reason": "failure"},
        {"ts": 130.0, "type": "run_finished", "step": 10},
    ]
    metrics = [m(0, 113), m(1, 113), m(2, 113), m(3, 115.5), m(4, 115.5),
               m(3, 121), m(4, 125), *[m(s, 129) for s in range(5, 10)]]
    return events, metrics


def test_kept_steps_only_and_lost_time_by_cause():
    g = goodput.compute(*timeline())
    assert g.wall_s == 30.0
    assert g.kept_steps == 10 and g.replayed_steps == 2
    assert g.kept_step_s == 10.0 and g.goodput == pytest.approx(10 / 30)
    assert g.lost_s == pytest.approx({
        "startup": 10.0,              # 100 -> first world at 110
        "recovery": 4.5,              # last progress 115.5 -> new world 120 (cut round included)
        "replayed_steps": 2.0,        # first executions of steps 3 and 4
        "checkpoint_blocking": 0.5,
        "driver_restart": 0.0,
        "other": 3.0,                 # the rest: 30 - 10 - 10 - 4.5 - 2 - 0.5
    })
    assert g.kept_step_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)


def test_a_steps_wait_for_a_saves_host_copies_is_checkpoint_blocking_not_step_time():
    events, metrics = timeline()
    metrics[-5]["checkpoint_wait_s"] = 0.25  # kept step 5 waited for the copies
    metrics[3]["checkpoint_wait_s"] = 0.125  # replayed step 3's first run waited too
    g = goodput.compute(events, metrics)
    assert g.kept_step_s == pytest.approx(9.75)
    assert g.lost_s["checkpoint_blocking"] == pytest.approx(0.875)
    assert g.lost_s["replayed_steps"] == pytest.approx(1.875)
    assert g.kept_step_s + sum(g.lost_s.values()) == pytest.approx(g.wall_s)


def test_checkpoint_inside_a_window_is_not_counted_twice():
    events, metrics = timeline()
    # The step-5 checkpoint was saved after the last round and before the round that failed.
    events.insert(3, {"ts": 116.5, "type": "checkpoint_saved", "step": 5, "blocking_s": 1.0})
    g = goodput.compute(events, metrics)
    assert g.lost_s["checkpoint_blocking"] == pytest.approx(1.5)
    assert g.lost_s["recovery"] == pytest.approx(3.5)
    # A grow checkpoints at its step first: that part of its window is checkpoint blocking.
    grow = [{"ts": 131.0, "type": "resize_started", "step": 10, "reason": "grow"},
            {"ts": 132.0, "type": "checkpoint_saved", "step": 10, "blocking_s": 0.75},
            {"ts": 133.0, "type": "world_formed", "step": 10},
            {"ts": 134.0, "type": "resize_finished", "step": 10, "recovery_s": 3.0, "reason": "grow",
             "checkpoint_s": 0.75},
            {"ts": 140.0, "type": "run_finished", "step": 11}]
    g = goodput.compute([e for e in events if e["type"] != "run_finished"] + grow, metrics + [m(10, 134)])
    assert g.lost_s["recovery"] == pytest.approx(3.5 + (133 - 131 - 0.75))
    assert g.lost_s["checkpoint_blocking"] == pytest.approx(2.25)


def test_a_run_still_going_ends_now_and_an_empty_one_is_zero():
    events, metrics = timeline()
    live = goodput.compute(events[:-1], metrics, end_ts=150.0)
    assert live.wall_s == 50.0 and live.goodput == pytest.approx(10 / 50)
    assert goodput.compute(events[:-1], metrics).wall_s == 29.0  # last record seen
    empty = goodput.compute([], [])
    assert empty.goodput == 0.0 and set(empty.lost_s) == set(goodput.CAUSES)


def test_step_end_times_within_a_round():
    from airay.plot import step_end_times

    # two rounds: steps 0-2 recorded at 10 (1, 2, 3 s each), steps 3-4 recorded at 20
    ms = [m(0, 10, 1), m(1, 10, 2), m(2, 10, 3), m(3, 20, 1), m(4, 20, 1)]
    assert step_end_times(ms) == [5, 7, 10, 19, 20]


def test_the_gap_between_runs_of_a_resumed_run_directory_is_not_lost_time():
    """A first run killed at 122 (no run_finished), resumed by a second run an hour later that
    starts at 3700, forms its world at 3705, runs steps 5-9 and finishes at 3711: wall is the
    two runs' spans, not the hour between them."""
    events, metrics = timeline()
    first = [e for e in events if e["ts"] <= 121.0]
    second = [{"ts": 3700.0, "type": "run_started"},
              {"ts": 3705.0, "type": "world_formed", "step": 5},
              {"ts": 3711.0, "type": "run_finished", "step": 10}]
    ran_first = [x for x in metrics if x["ts"] <= 121.0] + [m(4, 122)]
    ran_second = [m(s, 3710) for s in range(5, 10)]
    assert goodput.run_spans(first + second, ran_first + ran_second) == [(100.0, 122.0), (3700.0, 3711.0)]
    g = goodput.compute(first + second, ran_first + ran_second)
    assert g.wall_s == pytest.approx(22.0 + 11.0)
    assert g.lost_s["startup"] == pytest.approx(10.0 + 5.0)  # each run's start until its first world
    assert g.lost_s["other"] == pytest.approx(1.0)  # 33 - kept 10 - startup 15 - recovery 4.5 - replayed 2 - 0.5
    # Still going: the second run ends now.
    assert goodput.compute(first + second[:2], ran_first, end_ts=3720.0).wall_s == pytest.approx(22.0 + 20.0)


def test_a_restarted_driver_continues_its_run_and_the_restart_is_lost_time():
    """The driver is killed after its last record at 122; the supervisor's new driver records
    driver_restarted at 125, run_started (a continuation) and forms its world at 131 from the
    step-3 checkpoint; it finishes at 140. One span from 100 to 140: the 9 s from 122 to 131 are
    the restart's, not a gap between runs and not startup."""
    events, metrics = timeline()
    first = [e for e in events if e["ts"] <= 121.0]
    again = [{"ts": 125.0, "type": "driver_restarted", "attempt": 1},
             {"ts": 125.1, "type": "run_started", "driver_restart": 1, "launched_ts": 124.0},
             {"ts": 131.0, "type": "world_formed", "step": 3},
             {"ts": 140.0, "type": "run_finished", "step": 10}]
    ran = [x for x in metrics if x["ts"] <= 121.0] + [m(4, 122)] + [m(s, 139) for s in range(3, 10)]
    assert goodput.run_spans(first + again, ran) == [(100.0, 140.0)]
    g = goodput.compute(first + again, ran)
    assert g.wall_s == pytest.approx(40.0)
    assert g.lost_s["driver_restart"] == pytest.approx(131.0 - 122.0)
    assert g.lost_s["startup"] == pytest.approx(10.0)  # only the run's first start
    assert sum(g.lost_s.values()) + g.kept_step_s == pytest.approx(g.wall_s)


def test_status_of_a_resumed_run_directory_is_the_latest_runs(tmp_path):
    import json
    import time

    from airay import runview

    events, metrics = timeline()
    events = events + [{"ts": 3700.0, "type": "run_started"}, {"ts": 3705.0, "type": "world_formed", "step": 10}]
    shift = time.time() - 3710.0  # the second run started 10 s ago and is still going
    (tmp_path / "events.jsonl").write_text("".join(json.dumps({**e, "ts": e["ts"] + shift}) + "\n" for e in events))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({**x, "ts": x["ts"] + shift}) + "\n" for x in metrics))
    view = runview.load(tmp_path)
    assert view.status == "running"
    assert 40.0 <= view.goodput.wall_s < 60.0  # the first run's 30 s and the second's 10 s so far, not the hour

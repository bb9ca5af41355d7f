"""The supervised driver's decisions (pure); the restart itself runs in tests/test_fault_matrix.py."""

import signal

from airay.supervisor import DRIVER_FAILED_EXIT, exit_text, should_restart


def test_only_a_driver_that_died_is_restarted_and_only_within_the_budget():
    assert should_restart(-signal.SIGKILL, attempt=0, max_restarts=3, stopping=False)
    assert should_restart(DRIVER_FAILED_EXIT, attempt=2, max_restarts=3, stopping=False)  # a driver bug
    assert should_restart(137, attempt=0, max_restarts=1, stopping=False)  # a shell's "killed"
    assert not should_restart(-signal.SIGKILL, attempt=3, max_restarts=3, stopping=False)  # budget spent
    for final in (0, 1, 2):  # finished/preempted, failed with its reason, bad input: the run is over
        assert not should_restart(final, attempt=0, max_restarts=3, stopping=False)
    # SIGTERM/SIGINT reached the supervisor (a preemption, Ctrl-C): the driver's exit is final.
    assert not should_restart(-signal.SIGTERM, attempt=0, max_restarts=3, stopping=True)


def test_exits_are_named():
    assert exit_text(-9) == "SIGKILL" and exit_text(70) == "exit 70" and exit_text(-200) == "signal 200"


def test_a_run_files_last_line_cut_by_a_kill_or_still_being_written_is_left_out(tmp_path):
    """The supervisor reads the events of a driver that was SIGKILLed, `airay status` those of a
    live one: a record is whole only once its newline is written."""
    from airay.events import read_jsonl

    path = tmp_path / "events.jsonl"
    path.write_text('{"type": "run_started", "step": 0}\n{"type": "world_formed", "st')
    assert read_jsonl(path) == [{"type": "run_started", "step": 0}]
    path.write_text(path.read_text() + 'ep": 0}\n')
    assert [e["type"] for e in read_jsonl(path)] == ["run_started", "world_formed"]
    assert read_jsonl(tmp_path / "none.jsonl") == []

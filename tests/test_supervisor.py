"""The supervised driver's decisions (pure), and its withdrawal of a dead driver's autoscaler request (a real
cluster); the restart itself runs in tests/test_fault_matrix.py."""

import signal

import pytest

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


def test_the_address_of_the_autoscaler_request_is_the_drivers_cluster(monkeypatch):
    from airay.supervisor import cluster_address

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_address({"ray_address": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert cluster_address({}) == "auto"  # as ray.init() finds a cluster running on this machine
    assert cluster_address({"cluster": {"local_nodes": 2}}) is None  # the driver's own, gone with it
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert cluster_address({}) == "http://head:8265"


@pytest.mark.cluster
def test_a_supervisor_that_gives_up_withdraws_the_autoscaler_request_its_dead_driver_left(tmp_path):
    """The driver puts its request for max_workers bundles before the autoscaler, then is
    SIGKILLed (it cannot withdraw it); the supervisor gives up (no restarts left) and withdraws
    it, read where the autoscaler reads it."""
    import threading
    import time

    import psutil
    import yaml

    from airay.supervisor import supervise
    from tests.conftest import ray_cluster, standing_request

    with ray_cluster(nodes=1, cpus_per_node=2) as lc:
        spec = {"name": "withdraw", "model": {"factory": "airay.models.tiny_gpt:build"},
                "loss_fn": "airay.models.tiny_gpt:loss", "global_batch_size": 8, "micro_batch_size": 4,
                "max_steps": 50, "scaling": {"min_workers": 1, "max_workers": 2}, "ray_address": lc.address}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
        seen: list = []

        def kill_the_driver_once_it_asked():
            deadline = time.time() + 120
            while time.time() < deadline and not seen:
                request = standing_request()
                if request:
                    seen.append(request)
                    for proc in psutil.Process().children(recursive=True):
                        try:
                            if "airay.cli" in proc.cmdline() and "--driver" in proc.cmdline():
                                proc.kill()
                        except psutil.Error:
                            pass  # a process of the cluster that just ended
                time.sleep(0.05)

        killer = threading.Thread(target=kill_the_driver_once_it_asked, daemon=True)
        killer.start()
        run_dir = tmp_path / "run"
        rc = supervise(["run", str(tmp_path / "job.yaml"), "--run-dir", str(run_dir), "--driver"], str(run_dir),
                       max_restarts=0, launched_ts=None, address=lc.address)
        killer.join()
        assert seen == [[{"CPU": 1.0}] * 2]  # the driver's request stood while it ran
        assert rc == 1 and "the driver died (SIGKILL)" in (run_dir / "result.json").read_text()
        assert standing_request() == []  # withdrawn by the supervisor: the cluster may scale down

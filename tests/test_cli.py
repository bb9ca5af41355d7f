"""One consistent command line (issue 30): every command that reads a run takes RUN_DIR (or
--job ID, tested with a real submitted job in test_submit.py) and prints JSON with --json; a
live run's status shows progress, world, the last fault and an ETA. On a run directory written
by the real recorder, no Ray."""

import json

import pytest

from airay.cli import main
from airay.events import RunRecorder

NODE = "6e3cefd89d7bdaa2416f29d4dc918acd25b0bea90c9d4e2f28ae3e03"


def metric(step, ts, world=4):
    return dict(step=step, loss=5.0 - 0.1 * step, world_size=world, global_batch_size=8, samples_per_s=80.0,
                step_time_s=0.1, data_wait_s=0.0, compute_s=0.08, comm_s=0.02, tokens_per_s=2560.0, ts=ts)


@pytest.fixture
def live_run(tmp_path, monkeypatch):
    """A run 12 steps into 40, a worker lost at step 6 and the world re-formed, still going."""
    run = tmp_path / "run"
    clock = iter(range(1000, 2000))
    monkeypatch.setattr("airay.events.time.time", lambda: float(next(clock)))
    rec = RunRecorder(run, echo=False)
    rec.write_config("name: cli\nmax_steps: 40\n")
    rec.event("run_started", run_dir=str(run), max_steps=40, global_batch_size=8)
    rec.event("world_formed", step=0, world_size=4, plan={}, workers=[{"node_id": NODE, "pid": 1}] * 4)
    for step in range(6):
        rec.metric(**metric(step, 1010.0 + step))
    rec.event("checkpoint_saved", step=4, tier="durable", path=str(run / "checkpoints" / "step_00000004"))
    rec.event("worker_failed", step=6, rank=1, node_id=NODE, outcome="died", error="The actor died")
    rec.event("resize_started", step=6, old_world_size=4, new_world_size=3, reason="failure")
    rec.event("resize_finished", step=4, old_world_size=4, new_world_size=3, recovery_s=1.5, resumed_step=4,
              reason="failure")
    for step in range(4, 12):
        rec.metric(**metric(step, 1030.0 + step, world=3))
    rec.close()
    return run


def test_status_of_a_live_run_shows_progress_world_last_fault_eta_and_json(live_run, capsys):
    assert main(["status", str(live_run)]) == 0
    out = capsys.readouterr().out
    assert "running, step 12/40" in out and "eta " in out and "newest durable step 4" in out
    assert "last fault at " in out and "worker_failed rank 1 at step 6" in out
    assert main(["status", str(live_run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["status"], status["step"], status["max_steps"], status["world_size"]) == ("running", 12, 40, 3)
    assert status["durable_step"] == 4 and status["last_fault"]["rank"] == 1 and status["restarts"] == 1
    assert status["eta_s"] == pytest.approx(28 * 1.0)  # the recent pace, 1 s a step, not the recovery's gap
    assert status["resizes"] == [{"step": 4, "old_world_size": 4, "new_world_size": 3, "reason": "failure",
                                  "recovery_s": 1.5}]


def test_logs_print_the_runs_console_every_event_with_v_and_json_lines(live_run, capsys):
    assert main(["logs", str(live_run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"[airay] run directory {live_run}, 40 steps of 8 samples"
    assert "[airay] step 6: rank 1 on node 6e3cefd8 failed: The actor died" in lines
    assert "[airay] resize 4 -> 3 (failure) at step 4: recovery 1.50s" in lines
    assert main(["logs", str(live_run), "-v"]) == 0
    assert [line.split()[1] for line in capsys.readouterr().out.splitlines()] == [
        "run_started", "world_formed", "checkpoint_saved", "worker_failed", "resize_started", "resize_finished"]
    assert main(["logs", str(live_run), "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["type"] for e in events][:2] == ["run_started", "world_formed"] and len(events) == 6


def test_plot_and_checkpoints_take_the_run_the_same_way_and_print_json(live_run, tmp_path, capsys):
    assert main(["plot", str(live_run), "--out", str(tmp_path / "p.png"), "--json"]) == 0
    drawn = json.loads(capsys.readouterr().out)
    assert drawn["path"] == str(tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
    assert main(["checkpoints", str(live_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []  # the fixture wrote no checkpoint files


@pytest.mark.parametrize("command", ["status", "logs", "plot", "checkpoints", "prune", "export"])
def test_every_reading_command_wants_one_run_named_one_way(command, live_run, capsys):
    extra = {"prune": ["--keep-last", "1"], "export": ["--out", "x"]}.get(command, [])
    assert main([command, *extra]) == 2
    assert f"`airay {command}` reads one run: give RUN_DIR or --job ID, not neither" in capsys.readouterr().err
    assert main([command, str(live_run), "--job", "raysubmit_1", *extra]) == 2
    assert "not both" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("airay ")


def test_a_queued_runs_status_says_why_it_has_its_size(live_run, capsys):
    rec = RunRecorder(live_run, echo=False)
    rec.event("queue_target", step=12, job_id="cli-1234", target=2, previous=4, state="running",
              reason="running at 2 of 4: shrunk for prod-9 (priority 10)")
    rec.close()
    assert main(["status", str(live_run)]) == 0
    assert "scheduler: job cli-1234 running, target 2: running at 2 of 4: shrunk for prod-9 (priority 10)" \
        in capsys.readouterr().out
    assert main(["status", str(live_run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["queue"]["target"] == 2


def test_queue_prints_one_line_per_job_highest_priority_first():
    from airay.cli import queue_table

    def job(id, prio, state, current, target, reason, ts):
        return {"id": id, "team": "t", "priority": prio, "state": state, "current": current, "target": target,
                "min_workers": 2, "max_workers": 4, "step": 7, "max_steps": 100, "reason": reason, "submit_ts": ts}
    snap = {"policy": "shrink", "capacity": 4, "quotas": {"t": 2}}
    lines = queue_table(snap, [job("low", 0, "running", 4, 2, "running at 2 of 4: shrunk for high", 1),
                               job("high", 10, "running", 0, 2, "running at 2 (its max)", 2)]).splitlines()
    assert lines[0] == "scheduler: policy shrink, 4 workers, quotas t=2"
    assert [line.split()[0] for line in lines[2:]] == ["high", "low"]
    assert lines[3].split()[:8] == ["low", "t", "0", "running", "4", "2", "2-4", "7/100"]
    assert queue_table({"policy": None}, []).startswith("no scheduler on this cluster")


def test_priority_and_team_flags_queue_the_job_and_a_local_cluster_spec_is_refused_before_ray(tmp_path, capsys):
    spec = tmp_path / "job.yaml"
    spec.write_text("model: {factory: airay.models.tiny_gpt:build}\nloss_fn: airay.models.tiny_gpt:loss\n"
                    "global_batch_size: 8\nmicro_batch_size: 2\nmax_steps: 4\ncluster: {local_nodes: 2}\n"
                    "health: {max_driver_restarts: 0}\n")
    assert main(["run", str(spec), "--priority", "5", "--team", "prod"]) == 2
    err = capsys.readouterr().err
    assert "queue: a queued job runs on a shared cluster" in err and "remove `cluster:`" in err
    assert main(["queue", "--quota", "prod"]) == 2
    assert "give TEAM=WORKERS" in capsys.readouterr().err

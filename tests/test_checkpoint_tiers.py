"""Two-tier checkpoints, auto-resume and preemption on a real multi-node Ray cluster.

1. Durable storage on a real S3-compatible server, slow (its uploads of step 10 held until the
   run recorded step 15): the memory-tier save of step 15 does not wait for step 10's upload; a
   worker killed between durable checkpoints recovers from the memory tier; the finished job, re-run on the same run directory with a
   longer max_steps and without its memory tier (as on a new driver node), resumes from S3.
2. The driver node's memory is lost (its committer killed, its memory-tier files gone) and a
   worker killed: the run recovers from the memory tier's replica on a peer node.
3. SIGTERM to the driver of `airay run` (a spot reclaim): an emergency checkpoint, a clean exit,
   and the same command run again resumes from it.
All continue the loss curve of a fault-free run exactly (rtol as in tests/test_elastic.py:
world sizes 3 and 2 sum gradients in different orders).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import yaml

import pytest

from airay import JobConfig, fit
from airay.events import committed_losses, read_jsonl
from airay.storage import Storage
from tests.conftest import assert_released
from tests.s3server import s3_server

pytestmark = pytest.mark.cluster

RTOL = 1e-4


def spec_dict(run_dir, max_steps, checkpoint=None, chaos=()):
    return {
        "name": "tiers",
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": 0.01}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 8}},
                      "zero_optimization": {"stage": 2}},
        "global_batch_size": 12, "micro_batch_size": 6, "max_steps": max_steps, "steps_per_round": 5,
        "scaling": {"min_workers": 2, "max_workers": 3},
        "checkpoint": checkpoint or {"every_n_steps": 10},
        "timeouts": {"capacity_wait_s": 60},
        "chaos": list(chaos),
        "run_dir": str(run_dir),
    }


def spec(run_dir, max_steps, checkpoint=None, chaos=()):
    return JobConfig.from_dict(spec_dict(run_dir, max_steps, checkpoint, chaos))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Committed losses of a fault-free 30-step run."""
    import ray

    from tests.conftest import LocalCluster, LocalClusterSpec

    lc = LocalCluster(LocalClusterSpec(local_nodes=3, cpus_per_node=1))
    ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)
    try:
        result = fit(spec(tmp_path_factory.mktemp("base") / "run", 30), echo=False)
        assert result.status == "finished" and result.restarts == 0
        assert_released()
    finally:
        ray.shutdown()
        lc.shutdown()
    losses = committed_losses(result.run_dir)
    assert losses[29] < losses[0] - 0.5  # it trained: equality is not between two flat lines
    return losses


def assert_continues(run_dir, baseline):
    losses = committed_losses(run_dir)
    assert sorted(losses) == sorted(baseline) == list(range(30))
    for step, loss in baseline.items():
        assert losses[step] == pytest.approx(loss, rel=RTOL), step


def events(run_dir, type_):
    return [e for e in read_jsonl(f"{run_dir}/events.jsonl") if e["type"] == type_]


def test_memory_tier_recovery_s3_resume_and_exact_loss_curve(tmp_path, local_cluster, baseline):
    run = tmp_path / "run"
    first_hold = []

    def slow_store(path):
        """Hold step 10's uploads until the run has recorded step 15's save (a store slower than
        five steps); let go after 30 s anyway, so a save that waits for the upload ends too."""
        if "/job/step_00000010/" not in path:
            return False
        first_hold.append(time.time())
        if time.time() - first_hold[0] > 30:
            return False
        try:
            return not any(e["step"] == 15 for e in events(run, "checkpoint_saved"))
        except ValueError:  # a line being written
            return True

    with s3_server(hold=slow_store) as bucket_uri:
        local_cluster(nodes=3)
        memory = tmp_path / "node-memory"
        ckpt = {"path": bucket_uri("job"), "every_n_steps": 10, "fast_every_n_steps": 5, "keep_last": 2,
                "memory_path": str(memory)}
        first = fit(spec(run, 20, ckpt, chaos=[{"fault": "kill_worker", "at_step": 17, "rank": 1}]), echo=False)
        assert first.status == "finished" and first.final_step == 20 and first.restarts == 1
        assert_released()
        saved = events(run, "checkpoint_saved")
        # Step 15 went to memory while step 10 was still uploading (held): a save waits for the
        # previous commit to memory, never for an upload, so 15 is recorded before 10 is on S3.
        assert first_hold, "step 10's upload was never held"
        assert [(e["step"], e["tier"]) for e in saved] == [(5, "memory"), (15, "memory"), (10, "durable"),
                                                          (20, "durable")]
        by_step = {e["step"]: e for e in saved}
        assert by_step[15]["previous_commit_wait_s"] < by_step[10]["upload_s"]
        assert 0 < by_step[10]["memory_s"] < by_step[10]["total_s"] and by_step[10]["upload_wait_s"] >= 0
        for e in saved:
            assert 0 < e["blocking_s"] < e["total_s"] and e["bytes"] > 0
        # Each step after a save reports its optimizer step's wait for that save's host copies.
        assert all(m["checkpoint_wait_s"] >= 0 for m in read_jsonl(run / "metrics.jsonl"))
        assert all(e["path"].startswith("s3://") for e in saved if e["tier"] == "durable")
        # The kill at step 17 lost two steps: step 15 came from memory, not step 10 from S3.
        (loaded,) = events(run, "checkpoint_loaded")
        assert (loaded["step"], loaded["tier"], loaded["copy"], loaded["saved_world_size"]) == (15, "memory", "primary", 3)
        assert [r["resumed_step"] for r in first.resizes if r["reason"] == "failure"] == [15]
        assert Storage(ckpt["path"]).list_dirs() == ["step_00000010", "step_00000020"]

        # The same job again, 10 steps longer, on a driver node without the memory tier.
        shutil.rmtree(memory)
        second = fit(spec(run, 30, ckpt), echo=False)
        assert second.status == "finished" and second.final_step == 30
        assert_released()
        (resuming,) = events(run, "resuming")
        assert resuming["step"] == 20
        loaded = events(run, "checkpoint_loaded")[-1]
        assert (loaded["step"], loaded["tier"]) == (20, "durable") and loaded["path"].startswith("s3://")

    assert_continues(run, baseline)


def test_losing_the_driver_nodes_memory_recovers_from_the_replica_on_a_peer_node(tmp_path, local_cluster, baseline):
    import ray

    local_cluster(nodes=3)
    memory = tmp_path / "node-memory"
    ckpt = {"every_n_steps": 10, "fast_every_n_steps": 5, "keep_last": 2, "memory_path": str(memory)}
    run = tmp_path / "run"
    result = fit(spec(run, 30, ckpt, chaos=[{"fault": "lose_memory_primary", "at_step": 17, "rank": 1}]), echo=False)
    assert result.status == "finished" and result.final_step == 30 and result.restarts == 1
    driver_node = ray.get_runtime_context().get_node_id()
    assert_released()
    replicated = events(run, "checkpoint_replicated")
    assert {5, 15} <= {e["step"] for e in replicated}  # memory-tier steps (durable ones are on storage)
    assert all(e["node_id"] != driver_node and e["bytes"] > 0 for e in replicated)
    (fault,) = events(run, "fault_injected")
    assert any(p.endswith("step_00000015") for p in fault["removed"])  # the primary copy of step 15 is gone
    # Step 15 still came from memory, from the replica; not step 10 from storage.
    (loaded,) = events(run, "checkpoint_loaded")
    assert (loaded["step"], loaded["tier"], loaded["copy"]) == (15, "memory", "replica")
    assert [r["resumed_step"] for r in result.resizes if r["reason"] == "failure"] == [15]
    assert_continues(run, baseline)


def test_sigterm_to_the_driver_checkpoints_exits_cleanly_and_resumes(tmp_path, baseline):
    run = tmp_path / "run"
    data = spec_dict(run, 30)
    data["cluster"] = {"local_nodes": 3, "cpus_per_node": 1}
    data["checkpoint"] = {"every_n_steps": 10, "preemption_grace_s": 60}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "airay.cli", "run", str(job)]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        # Reclaim the driver mid-run, after its first durable checkpoint (step 10).
        deadline = time.time() + 300
        while not any(m["step"] >= 12 for m in read_jsonl(run / "metrics.jsonl")):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    (preempted,) = events(run, "preempted")
    stop = preempted["checkpoint_step"]
    assert stop == preempted["step"] and 12 < stop < 30 and stop % 5 == 0  # the end of the round in flight
    assert preempted["within_grace"]
    assert [e["step"] for e in events(run, "checkpoint_saved")] == [10, stop]
    assert events(run, "run_finished") == []
    assert json.loads((run / "result.json").read_text())["status"] == "preempted"

    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    (resuming,) = events(run, "resuming")
    assert resuming["step"] == stop
    assert events(run, "run_finished")[-1]["step"] == 30
    assert_continues(run, baseline)


def test_sigterm_to_a_worker_checkpoints_then_shrinks_without_losing_a_step(tmp_path, local_cluster, baseline):
    local_cluster(nodes=3)
    run = tmp_path / "run"

    def reclaim():  # a spot reclaim of rank 1's node, mid-round
        deadline = time.time() + 300
        while time.time() < deadline:
            if any(m["step"] >= 12 for m in read_jsonl(run / "metrics.jsonl")):
                os.kill(events(run, "world_formed")[0]["workers"][1]["pid"], signal.SIGTERM)
                return
            time.sleep(0.05)

    threading.Thread(target=reclaim, daemon=True).start()
    result = fit(spec(run, 30), echo=False)
    assert result.status == "finished" and result.final_step == 30
    assert_released()
    (preempted,) = events(run, "worker_preempted")
    assert preempted["rank"] == 1 and preempted["checkpoint_step"] == preempted["step"] > 12
    (failed,) = events(run, "worker_failed")
    assert failed["error"] == "preempted (SIGTERM)"
    failures = [r for r in result.resizes if r["reason"] == "failure"]
    assert [(r["resumed_step"], r["new_world_size"]) for r in failures] == [(preempted["step"], 2)]  # nothing replayed
    assert_continues(run, baseline)

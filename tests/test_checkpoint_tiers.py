"""Checkpoints on a real multi-node Ray cluster: every rank saves and loads its own shards.

1. Durable storage on a real S3-compatible server, slow (its uploads of step 10 held until the
   run recorded step 15): every rank uploads its own files at once; the memory-tier save of step
   15 does not wait for step 10's upload; a worker killed between durable checkpoints recovers
   from the memory tier; the finished job, re-run on the same run directory with a longer
   max_steps after its memory tier is gone, resumes from S3.
2. A node is lost with its memory-tier shards, the world shrinks (a new world size: each new rank
   reshards from the old partitions that overlap its own): the lost node's shards come from their
   peer copies on the next node.
3. A bad copy of a shard on one node (its checksum fails): that rank's load falls back to the
   peer copy; a memory tier another job left on the same path is ignored (cleared) with an event.
4. SIGTERM to the driver of `airay run` (a spot reclaim): an emergency checkpoint, a clean exit,
   and the same command run again resumes from it; SIGTERM to a worker: a checkpoint, then the
   world shrinks without losing a step.
All continue the loss curve of a fault-free run exactly (rtol as in tests/test_elastic.py:
world sizes 3 and 2 sum gradients in different orders).
"""

import json
import os
import signal
import subprocess
import sys
import time

import yaml

import pytest

from airay import JobConfig, fit
from airay.checkpoint.storage import Storage
from airay.events import committed_losses, read_jsonl
from tests.conftest import assert_released, connected, signal_rank_after
from tests.s3server import CREDENTIALS, s3_server

pytestmark = pytest.mark.cluster

RTOL = 1e-4
# One cluster for the module (tests.conftest.shared_cluster), started with the test S3 server's
# credentials in its environment, as nodes with an instance profile have them.
SHARED_NODES, SHARED_ENV = 3, CREDENTIALS


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
def baseline(shared_cluster, tmp_path_factory):
    """Committed losses of a fault-free 30-step run."""
    with connected(shared_cluster):
        result = fit(spec(tmp_path_factory.mktemp("base") / "run", 30), echo=False)
        assert result.status == "finished" and result.restarts == 0
        assert_released()
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


def test_memory_tier_recovery_s3_parallel_uploads_resume_and_exact_loss_curve(tmp_path, cluster, baseline):
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
        memory = tmp_path / "node-memory"
        ckpt = {"path": bucket_uri("job"), "every_n_steps": 10, "fast_every_n_steps": 5, "keep_last": 2,
                "memory_path": str(memory)}
        first = fit(spec(run, 20, ckpt, chaos=[{"fault": "kill_worker", "at_step": 17, "rank": 1}]), echo=False)
        assert first.status == "finished" and first.final_step == 20 and first.restarts == 1
        assert_released()
        saved = events(run, "checkpoint_saved")
        # Step 15 went to memory while step 10 was still uploading (held): a save waits for the
        # previous one's files, never for an upload, so 15 is committed before 10 is on S3.
        assert first_hold, "step 10's upload was never held"
        order = [(e["step"], e["tier"]) for e in saved]
        assert sorted(order) == [(5, "memory"), (10, "durable"), (10, "memory"), (15, "memory"), (20, "durable"),
                                 (20, "memory")]
        assert order.index((15, "memory")) < order.index((10, "durable"))
        memory_saves = {e["step"]: e for e in saved if e["tier"] == "memory"}
        durable_saves = {e["step"]: e for e in saved if e["tier"] == "durable"}
        assert memory_saves[15]["previous_commit_wait_s"] < durable_saves[10]["upload_s"]
        for e in memory_saves.values():
            # One figure for what a save held the step loop: the call, the wait for the previous
            # save, and the next step's wait for this save's live writes.
            assert e["held_s"] == pytest.approx(e["blocking_s"] + e["previous_commit_wait_s"] + e["checkpoint_wait_s"])
            # Each node's ranks copied their files to the next node: every node holds a peer copy.
            assert 0 < e["blocking_s"] < e["total_s"] and e["bytes"] > 0 and len(e["peer_nodes"]) == e["world_size"]
        # Every rank uploads its own files, all at once (step 20: the world of 2 after the kill).
        windows = durable_saves[20]["upload_windows"]
        assert len(windows) == 2 and max(a for a, _ in windows) < min(b for _, b in windows)
        # Step 10's uploads were held until after the kill at step 17: a rank lost mid-upload has
        # its files uploaded by its node's store from the node's memory instead.
        assert durable_saves[10]["retried_ranks"] in ([], [1]) and len(durable_saves[10]["upload_windows"]) == 3
        assert all(e["path"].startswith("s3://") for e in durable_saves.values())
        manifest = json.loads(Storage(ckpt["path"]).read_bytes("step_00000010/manifest.json"))
        assert sorted({entry[2] for entry in manifest["files"].values()}) == [0, 1, 2]  # [size, crc, rank, ...]
        # The kill at step 17 lost two steps: step 15 came from memory, not step 10 from S3.
        (loaded,) = events(run, "checkpoint_loaded")
        assert (loaded["step"], loaded["tier"], loaded["saved_world_size"], loaded["world_size"]) == (15, "memory", 3, 2)
        assert loaded["resharded"] and loaded["copies"]["durable"] == 0
        assert [r["resumed_step"] for r in first.resizes if r["reason"] == "failure"] == [15]
        assert Storage(ckpt["path"]).list_dirs() == ["step_00000010", "step_00000020"]
        assert not memory.exists() or not any(memory.rglob("step_*"))  # a finished run's memory tier goes

        # The same job again, 10 steps longer: it resumes from S3.
        second = fit(spec(run, 30, ckpt), echo=False)
        assert second.status == "finished" and second.final_step == 30
        assert_released()
        (resuming,) = events(run, "resuming")
        assert resuming["step"] == 20
        loaded = events(run, "checkpoint_loaded")[-1]
        assert (loaded["step"], loaded["tier"]) == (20, "durable") and loaded["path"].startswith("s3://")

    assert_continues(run, baseline)


def test_a_node_lost_with_its_shards_recovers_from_the_peer_copies(tmp_path, cluster, baseline):
    ckpt = {"every_n_steps": 10, "fast_every_n_steps": 5, "keep_last": 2, "memory_path": str(tmp_path / "mem")}
    run = tmp_path / "run"
    result = fit(spec(run, 30, ckpt, chaos=[{"fault": "remove_node", "at_step": 17, "rank": 1}]), echo=False,
                 local_cluster=cluster)
    assert result.status == "finished" and result.final_step == 30
    assert_released()
    (lost,) = events(run, "node_lost")
    # Step 15 was in memory only; the lost node's shards of it came from the next node's copies.
    loaded = events(run, "checkpoint_loaded")[0]
    assert (loaded["step"], loaded["tier"], loaded["saved_world_size"], loaded["world_size"]) == (15, "memory", 3, 2)
    assert loaded["copies"]["peer"] >= 1 and loaded["copies"]["durable"] == 0
    assert [r["resumed_step"] for r in result.resizes if r["reason"] == "failure"] == [15]
    assert_continues(run, baseline)


def test_a_bad_copy_falls_back_to_the_peer_copy_and_another_jobs_tier_is_ignored(tmp_path, cluster, baseline):
    import ray

    mem = tmp_path / "mem"
    ckpt = {"every_n_steps": 10, "fast_every_n_steps": 5, "keep_last": 2, "memory_path": str(mem)}
    run = tmp_path / "run"
    # Another job left a memory tier on this path (same checkpoint path, another model): its
    # step 25 would be the newest checkpoint if it were trusted.
    from airay.checkpoint.layout import job_identity
    from airay.checkpoint.tiers import MemoryTier, memory_base

    other = job_identity("tiers", {"factory": "airay.models.tiny_gpt:build", "kwargs": {"d_model": 128}}, 2)
    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU"))
    foreign = MemoryTier(memory_base(str(mem), str(run / "checkpoints")), node, other)
    foreign.open()
    foreign.step_dir(25).mkdir()
    result = fit(spec(run, 30, ckpt, chaos=[{"fault": "corrupt_memory_copy", "at_step": 17, "rank": 1}]), echo=False)
    assert result.status == "finished" and result.final_step == 30
    assert_released()
    (ignored,) = events(run, "checkpoint_ignored")
    assert ignored["node_id"] == node and ignored["job"]["id"] == other["id"]
    (fault,) = events(run, "fault_injected")
    assert (fault["step"], fault["checkpoint_step"], len(fault["copies"])) == (17, 15, 1)  # rank 1 copy on its node
    # Rank 1's shard of step 15 failed its checksum on its node; the peer copy served.
    bad = [e for e in events(run, "checkpoint_rejected") if e.get("fell_back")]
    assert any(e["copy"] == "local" for e in bad) and fault["killed_rank"] == 2
    assert all(e["file"] == fault["file"] and e["copy"] in ("local", f"peer:{fault['node_id']}") and "crc32" in e["reason"]
               for e in bad)
    loaded = events(run, "checkpoint_loaded")[0]
    assert (loaded["step"], loaded["tier"]) == (15, "memory") and loaded["copies"]["peer"] >= 1
    assert_continues(run, baseline)


def test_sigterm_to_the_driver_checkpoints_exits_cleanly_and_resumes(tmp_path, baseline):
    run = tmp_path / "run"
    data = spec_dict(run, 30)
    data["model"]["kwargs"]["forward_delay_s"] = 0.1  # steps 12-30 outlast the 0.2 s poll for step 12 below
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
    # The periodic saves before the signal (on a slow machine the run may pass step 20 before the
    # signal lands), then the preemption's own, once.
    periodic = list(range(10, stop, 10))
    assert [e["step"] for e in events(run, "checkpoint_saved") if e["tier"] == "durable"] == periodic + [stop]
    assert events(run, "run_finished") == []
    assert json.loads((run / "result.json").read_text())["status"] == "preempted"

    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    (resuming,) = events(run, "resuming")
    assert resuming["step"] == stop
    assert events(run, "run_finished")[-1]["step"] == 30
    assert_continues(run, baseline)


def test_sigterm_to_a_worker_checkpoints_then_shrinks_without_losing_a_step(tmp_path, cluster, baseline):
    run = tmp_path / "run"

    signal_rank_after(run, 12, 1, signal.SIGTERM)  # a spot reclaim of rank 1's node, mid-round
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


def test_a_small_memory_budget_is_kept_on_disk_and_a_fault_on_most_nodes_excludes_none(tmp_path, cluster,
                                                                                          baseline):
    """Each node's tier may hold 3 MB: about one step with its peer copy (a step is ~2.2 MB over
    three nodes, each node holding its own files and its predecessor's). Saves every 5 steps drop
    the step before; a thread measures every node's tier on disk meanwhile (every 50 ms). At
    step 12 ranks on two of the three nodes are killed at once: one incident striking most
    nodes, which counts toward no node's exclusion (threshold 1)."""
    from benchmarks.memory_pressure import TierSampler

    run, shm = tmp_path / "run", tmp_path / "shm"
    budget = 3_000_000
    data = spec_dict(run, 30, {"every_n_steps": 10, "fast_every_n_steps": 5, "memory_keep_last": 3,
                               "memory_path": str(shm), "memory_budget_gb": budget / 1e9},
                     chaos=[{"fault": "kill_worker", "at_step": 12, "rank": 0},
                            {"fault": "kill_worker", "at_step": 12, "rank": 1}])
    data["health"] = {"exclude_node_after_failures": 1}
    with TierSampler(shm, "ckpt-*/node-*") as tiers:
        result = fit(JobConfig.from_dict(data), echo=False)
    peak = tiers.peak
    assert result.status == "finished" and result.final_step == 30
    assert_released()
    (checked,) = events(run, "memory_budget")
    assert checked["budget_bytes"] == budget
    dropped = [e for e in events(run, "checkpoint_budget") if e["action"] == "dropped"]
    assert dropped and all(e["planned_bytes"] <= budget for e in dropped)
    assert len(peak) == 3 and 1_000_000 < max(peak.values()) <= budget, peak
    assert events(run, "node_excluded") == []
    (not_counted,) = events(run, "incident_not_counted")
    assert (not_counted["nodes"], not_counted["world_nodes"]) == (2, 3)
    assert_continues(run, baseline)

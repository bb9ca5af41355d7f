"""Two jobs under the cluster's scheduler, on a real local cluster of 2 nodes x 2 CPUs (4 workers).

A low-priority elastic job (2-4 workers) trains at 4; a high-priority job of 2 arrives; the
scheduler lowers the first job's target to 2, its driver gives back two workers' placement groups
at a step boundary (a planned shrink: no failure, no replayed step) and the second job places and
trains; when it ends the first job is raised to 4 and grows back. The first job's per-step losses
equal its run alone. Each driver is its own `airay run` process, as two users' jobs are.

The low job's steps are paced with a sleep in the model's forward (tiny_gpt's forward_delay_s, no
CPU burnt) so that it is still training when the high job ends; its run alone has no sleep: the
sleep changes no number it computes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from airay import JobConfig, fit
from airay.events import committed_losses, read_jsonl
from airay.sched.actor import scheduler
from tests.conftest import assert_released, ray_cluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster():
    """One cluster for the module: its scheduler actor lives as long as the cluster does."""
    with ray_cluster(2, cpus_per_node=2) as lc:
        yield lc

RTOL = 1e-4
LOW_STEPS = 160


def spec(tmp_path, name, address, delay=0.0, queue=None, **overrides):
    data = {
        "name": name,
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": delay}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2}},
        "global_batch_size": 8, "micro_batch_size": 2, "max_steps": LOW_STEPS, "steps_per_round": 5,
        "scaling": {"min_workers": 2, "max_workers": 4},
        "checkpoint": {"every_n_steps": 100},
        "timeouts": {"capacity_wait_s": 120},
        "ray_address": address,
        "run_dir": str(tmp_path / name),
    }
    if queue is not None:
        data["queue"] = queue
    data.update(overrides)
    return JobConfig.from_dict(data)


def airay_run(cfg: JobConfig, path: Path) -> subprocess.Popen:
    path.write_text(cfg.to_yaml())
    return subprocess.Popen([sys.executable, "-m", "airay.cli", "run", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(m["step"] >= step for m in read_jsonl(run_dir / "metrics.jsonl")):
            return
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"{run_dir.name} did not reach step {step}")


def test_a_high_priority_job_shrinks_a_low_priority_one_which_grows_back_with_the_same_losses(tmp_path, cluster):
    lc = cluster
    alone = fit(spec(tmp_path, "alone", lc.address), echo=False)
    assert alone.status == "finished" and alone.world_sizes == [4]

    low_cfg = spec(tmp_path, "low", lc.address, delay=0.1, queue={"priority": 0, "team": "research"})
    high_cfg = spec(tmp_path, "high", lc.address, queue={"priority": 10, "team": "prod"}, max_steps=10,
                    scaling={"min_workers": 2, "max_workers": 2})
    low = airay_run(low_cfg, tmp_path / "low.yaml")
    wait_for_step(tmp_path / "low", 8, low)
    high = airay_run(high_cfg, tmp_path / "high.yaml")
    high_out, _ = high.communicate(timeout=300)
    low_out, _ = low.communicate(timeout=300)
    assert high.returncode == 0, high_out[-3000:]
    assert low.returncode == 0, low_out[-3000:]

    low_events = read_jsonl(tmp_path / "low" / "events.jsonl")
    resizes = [e for e in low_events if e["type"] == "resize_started"]
    assert [(e["reason"], e["old_world_size"], e["new_world_size"]) for e in resizes] == \
        [("scheduler", 4, 2), ("grow", 2, 4)]
    assert resizes[0]["released_ranks"] == [2, 3] and "shrunk for" in resizes[0]["why"]
    assert not [e for e in low_events if e["type"] in ("worker_failed", "node_lost", "run_failed")]
    # No replayed step: every step's metric was written once, and the losses are the run alone's.
    steps = [m["step"] for m in read_jsonl(tmp_path / "low" / "metrics.jsonl")]
    assert steps == list(range(LOW_STEPS))
    mine, theirs = committed_losses(tmp_path / "low"), committed_losses(alone.run_dir)
    for step in range(LOW_STEPS):
        assert mine[step] == pytest.approx(theirs[step], rel=RTOL), step
    # The high job started after the shrink gave its workers back, and the grow came after it ended.
    high_events = read_jsonl(tmp_path / "high" / "events.jsonl")
    high_formed = next(e for e in high_events if e["type"] == "world_formed")
    high_last_step = read_jsonl(tmp_path / "high" / "metrics.jsonl")[-1]
    shrink_done = next(e for e in low_events if e["type"] == "placement_released" and e["reason"] == "scheduler")
    assert high_formed["world_size"] == 2 and high_formed["ts"] >= shrink_done["ts"]
    assert resizes[1]["ts"] >= high_last_step["ts"]
    # The scheduler's record of both: ended, nothing held.
    jobs = ray.get(scheduler(create=False).snapshot.remote(), timeout=30)["jobs"]
    assert sorted((j["name"], j["state"], j["target"]) for j in jobs) == [("high", "done", 0), ("low", "done", 0)]
    assert_released()  # both drivers gave back every worker and placement group


def queued(id, team, lo, hi, priority=0):
    return {"id": id, "name": id, "team": team, "priority": priority, "min_workers": lo, "max_workers": hi}


def test_the_scheduler_keeps_its_jobs_across_a_restart_of_its_actor_and_a_teams_quota_is_never_taken(cluster):
    lc, actor = cluster, scheduler()
    ended = {j["id"] for j in ray.get(actor.snapshot.remote(), timeout=60)["jobs"]}  # an earlier test's
    ray.get(actor.configure.remote({"prod": 2}, None), timeout=60)
    ray.get(actor.submit.remote(queued("research-a", "research", 1, 4)), timeout=60)
    ray.get(actor.submit.remote(queued("prod-a", "prod", 2, 2)), timeout=60)
    ray.get(actor.submit.remote(queued("research-b", "research", 2, 4)), timeout=60)
    before = ray.get(actor.snapshot.remote(), timeout=60)
    sizes = {j["id"]: (j["state"], j["target"]) for j in before["jobs"] if j["id"] not in ended}
    # prod's 2 guaranteed workers stay prod's: research-a gave back what it borrowed, research-b waits.
    assert sizes == {"research-a": ("running", 2), "prod-a": ("running", 2), "research-b": ("queued", 0)}
    assert before["capacity"] == 4

    ray.kill(actor, no_restart=False)  # its process dies; Ray restarts it from the state on disk
    # ray.kill is asynchronous: a call made at once may still reach the old process.
    deadline = time.time() + 120
    after = ray.get(scheduler(create=False).snapshot.remote(), timeout=120)
    while after["started"] == before["started"] and time.time() < deadline:
        time.sleep(0.2)
        after = ray.get(scheduler(create=False).snapshot.remote(), timeout=120)
    assert after["started"] > before["started"]
    assert {j["id"]: (j["state"], j["target"]) for j in after["jobs"] if j["id"] not in ended} == sizes
    assert after["quotas"] == {"prod": 2}

    cli = [sys.executable, "-m", "airay.cli", "queue", "--address", lc.address]
    listed = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == "scheduler: policy shrink, 4 workers, quotas prod=2"
    row = next(line for line in lines if line.startswith("research-b"))
    assert row.split()[:7] == ["research-b", "research", "0", "queued", "0", "0", "2-4"] and "waiting" in row
    as_json = subprocess.run(cli + ["--json"], capture_output=True, text=True, timeout=120)
    assert {j["id"] for j in json.loads(as_json.stdout)["jobs"]} == set(sizes)  # the live ones
    for job_id in sizes:
        ray.get(actor.finish.remote(job_id, "done"), timeout=60)

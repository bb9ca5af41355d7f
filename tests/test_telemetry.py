"""A run with a fault, watched from outside: Ray's metrics endpoint, TensorBoard event files,
`airay status` and `airay plot` must show what metrics.jsonl and result.json recorded."""

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import ray

from airay import JobConfig, fit, goodput
from airay.events import committed_losses, read_jsonl
from tests.conftest import assert_released

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


def small_spec(tmp_path, name):
    return JobConfig.from_yaml(ROOT / "jobs" / "small.yaml",
                               [f"name={name}", f"run_dir={tmp_path / name}", "max_steps=16"])


def scrape(port: int, metric: str, run: str) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(metric + "{") and f'run="{run}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    """One 2-worker run with a worker killed at step 6 (resumes from the step-4 checkpoint)."""
    from tests.conftest import LocalCluster, LocalClusterSpec

    lc = LocalCluster(LocalClusterSpec(local_nodes=2, cpus_per_node=1))
    ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)
    try:
        result = fit(small_spec(tmp_path_factory.mktemp("tel"), "telemetry"), echo=False)
        assert result.status == "finished" and result.restarts == 1
        # The driver (this process) keeps its gauges; Ray exports them from the head's metrics port.
        head = next(n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"])
        port = head["MetricsExportPort"]
        last = read_jsonl(Path(result.run_dir) / "metrics.jsonl")[-1]
        exported = {}
        deadline = time.time() + 60  # Ray reports metrics every few seconds
        while time.time() < deadline:
            exported = {m: scrape(port, f"ray_airay_{m}", "telemetry") for m in ("loss", "world_size", "step")}
            # Ray exports each gauge on its own schedule: wait until all of them show the last step.
            if (exported["step"] == last["step"] and exported["world_size"] == last["world_size"]
                    and exported["loss"] is not None and abs(exported["loss"] - last["loss"]) <= 1e-6 * abs(last["loss"])):
                break
            time.sleep(1)
        assert_released()
    finally:
        ray.shutdown()
        lc.shutdown()
    return result, exported


def test_ray_metrics_endpoint_shows_the_last_committed_step(faulty_run):
    result, exported = faulty_run
    last = read_jsonl(Path(result.run_dir) / "metrics.jsonl")[-1]
    assert exported["step"] == last["step"] == 15
    assert exported["loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert exported["world_size"] == last["world_size"]


def test_tensorboard_events_equal_metrics_jsonl(faulty_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, _ = faulty_run
    acc = EventAccumulator(str(Path(result.run_dir) / "tensorboard"))
    acc.Reload()
    # The replayed steps 4 and 5 were written twice; the reader keeps the later (kept) points.
    tb_loss = {e.step: e.value for e in acc.Scalars("airay/loss")}
    kept = committed_losses(result.run_dir)
    assert sorted(tb_loss) == sorted(kept) == list(range(16))
    for step, loss in kept.items():
        assert tb_loss[step] == pytest.approx(loss, rel=1e-6), step
    world = {e.step: e.value for e in acc.Scalars("airay/world_size")}
    records = goodput.kept_records(read_jsonl(Path(result.run_dir) / "metrics.jsonl"))
    assert world == {s: float(r["world_size"]) for s, r in records.items()}
    assert {e.step: e.value for e in acc.Scalars("airay/restarts")}[15] == 1.0


def test_step_split_tokens_and_goodput_breakdown(faulty_run):
    result, _ = faulty_run
    records = read_jsonl(Path(result.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in records].count(4) == 2 and [r["step"] for r in records].count(5) == 2
    for r in records:
        assert r["compute_s"] + r["comm_s"] + r["data_wait_s"] == pytest.approx(r["step_time_s"], rel=1e-6)
        # forward_delay_s (50 ms) per micro-batch is compute outside any collective: 8 / world / 4 of them
        assert r["compute_s"] >= 0.05 * (8 // r["world_size"] // 4) and r["comm_s"] >= 0
        if r["world_size"] > 1:
            assert r["comm_s"] > 0  # ZeRO-2 reduces gradients across ranks every step
        # tiny_gpt's samples are 33 token ids each
        assert r["tokens_per_s"] == pytest.approx(33 * r["samples_per_s"])
    saved = json.loads((Path(result.run_dir) / "result.json").read_text())
    lost = saved["time_lost_s"]
    assert set(lost) == set(goodput.CAUSES) and all(v >= 0 for v in lost.values())
    assert lost["startup"] > 0 and lost["recovery"] > 0 and lost["checkpoint_blocking"] > 0
    # steps 4 and 5 ran twice: their first executions are the replayed time
    first_runs = [r for r in records if r["step"] in (4, 5)][:2]
    assert lost["replayed_steps"] == pytest.approx(sum(r["step_time_s"] for r in first_runs), abs=1e-3)
    kept_s = sum(r["step_time_s"] for r in goodput.kept_records(records).values())
    assert saved["goodput"] == pytest.approx(kept_s / saved["wall_s"], rel=1e-3)
    assert kept_s + sum(lost.values()) == pytest.approx(saved["wall_s"], rel=1e-3)


def test_plot_and_status_show_the_fault(faulty_run, tmp_path):
    import matplotlib.image

    from airay.plot import plot_run

    result, _ = faulty_run
    drawn = plot_run(result.run_dir, tmp_path / "run.png")
    png = (tmp_path / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert matplotlib.image.imread(tmp_path / "run.png").shape[:2] == (900, 1000)
    assert [(f["type"], f["step"], f["rank"]) for f in drawn["faults"]] == [("worker_failed", 6, 1)]
    assert drawn["replayed"][0] == [4, 5]
    assert drawn["loss"] == (list(range(16)), [committed_losses(result.run_dir)[s] for s in range(16)])
    assert 4 in drawn["checkpoint_steps"] and 16 in drawn["checkpoint_steps"]
    assert f"goodput {result.goodput:.2f}" in drawn["title"]
    assert sorted(set(drawn["world_size"][1])) == [1, 2]

    out = subprocess.run([sys.executable, "-m", "airay.cli", "status", result.run_dir], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert f"goodput {result.goodput:.2f}" in out.stdout and "finished, step 16/16" in out.stdout
    assert re.search(r"worker_failed rank 1 at step 6", out.stdout)
    assert "restarts 1, replayed step executions 2" in out.stdout

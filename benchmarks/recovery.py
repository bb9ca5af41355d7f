"""Warm recovery vs cold restart, measured in one invocation on one local multi-node cluster.

For a 4-worker run that loses one worker (SIGKILL mid-step), from the run's own events:
  detection_s  fault injected -> the driver knows a rank is gone
  drain_s      detection -> every surviving rank is out of its collective
  reform_s     new process group + fresh DeepSpeed engine on the surviving (warm) processes
  reload_s     loading the newest checkpoint resharded to the new world size
  recovery_s   detection -> first completed step at the new size (the event's own number)
and, as the baseline, a cold restart: a fresh fit() of the same job resuming from the same
checkpoint on the same cluster (new actors: process start, imports, engine, load, first step).

Usage: python benchmarks/recovery.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from airay import JobConfig, fit  # noqa: E402
from airay.config import LocalClusterSpec  # noqa: E402
from airay.events import read_jsonl  # noqa: E402
from airay.local_cluster import LocalCluster  # noqa: E402

KILL_STEP = 7


def job(run_dir: Path, chaos: list, max_steps: int, checkpoint_path: str | None = None) -> JobConfig:
    return JobConfig.from_dict({
        "name": "recovery-bench",  # one job: the cold run resumes the seed run's checkpoint
        "model": {"factory": "airay.models.tiny_gpt:build"},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}},
        "global_batch_size": 24, "micro_batch_size": 4, "max_steps": max_steps,
        "scaling": {"min_workers": 2, "max_workers": 4},
        "checkpoint": {"every_n_steps": 5, "path": checkpoint_path},
        "chaos": chaos, "run_dir": str(run_dir),
    })


def warm_recovery(root: Path, i: int) -> dict[str, float]:
    run = root / f"warm{i}"
    result = fit(job(run, [{"fault": "kill_worker", "at_step": KILL_STEP, "rank": 1}], max_steps=KILL_STEP + 3),
                 echo=False)
    assert result.status == "finished", result.error
    ev = read_jsonl(run / "events.jsonl")
    failed = next(e for e in ev if e["type"] == "worker_failed")
    resize = next(e for e in ev if e["type"] == "resize_finished" and e["reason"] == "failure")
    return {"detection_s": failed["detection_s"], "drain_s": resize["drain_s"], "reform_s": resize["reform_s"],
            "reload_s": resize["reload_s"], "recovery_s": resize["recovery_s"]}


def cold_restart(root: Path, i: int) -> float:
    """A fresh run resuming from a step-5 checkpoint: run start -> first completed step."""
    seed_run = root / f"seed{i}"
    assert fit(job(seed_run, [], max_steps=5), echo=False).status == "finished"
    run = root / f"cold{i}"
    result = fit(job(run, [], max_steps=7, checkpoint_path=str(seed_run / "checkpoints")), echo=False)
    assert result.status == "finished", result.error
    ev = read_jsonl(run / "events.jsonl")
    started = next(e["ts"] for e in ev if e["type"] == "run_started")
    first_step = read_jsonl(run / "metrics.jsonl")[0]
    assert first_step["step"] == 5  # it really resumed
    return first_step["ts"] - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()

    lc = LocalCluster(LocalClusterSpec(local_nodes=4, cpus_per_node=1))
    ray.init(address=lc.address, logging_level="ERROR", log_to_driver=False)
    warm, cold = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for i in range(args.repeats):
                warm.append(warm_recovery(root, i))
                cold.append(cold_restart(root, i))
    finally:
        ray.shutdown()
        lc.shutdown()

    med = {k: statistics.median(w[k] for w in warm) for k in warm[0]}
    cold_med = statistics.median(cold)
    print(f"recovery of a 4-worker ZeRO-2 run losing 1 worker (tiny_gpt, CPU/gloo), median of {args.repeats}:")
    for k, v in med.items():
        spread = [round(w[k], 3) for w in warm]
        print(f"  {k:<12} {v:7.3f} s   runs {spread}")
    print(f"  {'cold start':<12} {cold_med:7.3f} s   runs {[round(c, 3) for c in cold]}  "
          "(fresh actors resuming the same checkpoint)")
    print(f"  cold / warm recovery ratio: {cold_med / med['recovery_s']:.1f}x")
    print(f"  targets: recovery_s < 3 s -> {'met' if med['recovery_s'] < 3 else 'MISSED'}; "
          f">= 5x faster than cold -> {'met' if cold_med / med['recovery_s'] >= 5 else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"warm": warm, "cold_s": cold, "median": med,
                                               "cold_median_s": cold_med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

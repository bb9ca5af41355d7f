"""Warm recovery vs cold restart, measured in one invocation on one local multi-node cluster.

For a 4-worker run that loses one worker (SIGKILL mid-step), from the run's own events:
  detection_s  fault injected -> the driver knows a rank is gone
  drain_s      detection -> every surviving rank is out of its collective
  reform_s     new process group + fresh DeepSpeed engine on the surviving (warm) processes
  reload_s     loading the newest checkpoint resharded to the new world size
  recovery_s   detection -> first completed step at the new size (the event's own number)
and, as the baseline, a plain cold restart: fresh Ray actors with no airay in the path (process
start, imports, torch.distributed + deepspeed.initialize through benchmarks.plain, DeepSpeed's own
load_checkpoint, first step), timed from the restart's start to the end of its first step.

Usage: python benchmarks/recovery.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from airay import JobConfig, fit  # noqa: E402
from airay.config import LocalClusterSpec  # noqa: E402
from airay.events import read_jsonl  # noqa: E402
from airay.local_cluster import LocalCluster  # noqa: E402
import benchmarks.plain  # noqa: E402
from benchmarks.plain import plain_job, train_step  # noqa: E402

ray.cloudpickle.register_pickle_by_value(benchmarks.plain)  # Ray's workers cannot import `benchmarks`

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


class PlainRank:
    """One rank of a plain restart: a fresh Ray actor doing what a restarted DeepSpeed job does."""

    def run(self, rank: int, world: int, port: int, load_dir: str | None, save_dir: str | None,
            first_step: int, steps: int) -> float:
        """Imports, join, engine (benchmarks.plain), load `load_dir` (DeepSpeed's own loader),
        train `steps` steps from `first_step`, save to `save_dir`. Returns when its last step ended."""
        cfg = job(Path("/nonexistent"), [], max_steps=first_step + steps)
        engine, plan, loss_fn, data = plain_job(cfg, rank=rank, world=world, port=port)
        if load_dir is not None:
            engine.load_checkpoint(load_dir, tag="restart")
        for step in range(first_step, first_step + steps):
            train_step(engine, loss_fn, data, step, rank, plan)
        if save_dir is not None:
            engine.save_checkpoint(save_dir, tag="restart")
        return time.time()


def plain_world(world: int, load_dir: str | None, save_dir: str | None, first_step: int, steps: int) -> float:
    """A fresh world of `world` plain actors, one per node; returns when its last rank's last step ended."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from airay.worker.dist import free_port

    pg = placement_group([{"CPU": 1}] * world, strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    cls = ray.remote(num_cpus=1)(PlainRank)
    actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r))
              .remote() for r in range(world)]
    try:
        port = free_port()  # one machine: the actors reach rank 0 at 127.0.0.1
        return max(ray.get([a.run.remote(r, world, port, load_dir, save_dir, first_step, steps)
                            for r, a in enumerate(actors)], timeout=600))
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)


def cold_restart(root: Path, i: int) -> float:
    """A plain restart: fresh processes (no airay warm-up engine) start, import, join, build the
    engine, load a step-5 checkpoint with DeepSpeed's own loader and train one step. Timed from
    the restart's start to the end of that step, as recovery_s is from detection to the end of the
    first step. Same world size (4): no resharding, the case most favourable to a cold restart."""
    ckpt = str(root / f"plain-seed{i}")
    plain_world(4, None, ckpt, 0, 5)  # the checkpoint to restart from (not timed)
    time.sleep(2.0)  # the seed's processes gone
    t0 = time.time()
    return plain_world(4, ckpt, None, 5, 1) - t0


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
          "(plain restart: fresh actors, DeepSpeed load, same world size)")
    print(f"  cold / warm recovery ratio: {cold_med / med['recovery_s']:.1f}x")
    print(f"  targets: recovery_s < 3 s -> {'met' if med['recovery_s'] < 3 else 'MISSED'}; "
          f">= 5x faster than cold -> {'met' if cold_med / med['recovery_s'] >= 5 else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"warm": warm, "cold_s": cold, "median": med,
                                               "cold_median_s": cold_med, "cold_kind": "plain"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""airay's steady-state overhead: samples/s under airay vs the same training without it.

Both sides train the same model (tiny_gpt), DeepSpeed config (ZeRO-2, AdamW), batch plan, world
size and synthetic samples on this machine:
  plain  one OS process per rank started here, torch.distributed (gloo) + deepspeed.initialize,
         a bare step loop: no Ray, no driver, no rounds
  airay  airay.fit on a local Ray cluster (one node per worker): actors, rounds driven by the
         controller, per-round metrics and capacity checks
Throughput is wall time over the steady-state steps (after `--warmup` steps), measured the same
way on both sides: from the end of step warmup-1 to the end of the last step, no checkpoint in
between. The two are run alternately, `--repeats` times each, in one invocation.

Usage: python benchmarks/overhead.py [--workers 2] [--steps 300] [--warmup 20] [--repeats 3]
       [--steps-per-round 10] [--json F]
Target: airay / plain >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 0.97
SPEC = {
    "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"vocab_size": 256, "seq_len": 32, "d_model": 64,
                                                                 "n_layers": 2, "n_heads": 4}},
    "loss_fn": "airay.models.tiny_gpt:loss",
    "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}},
    "global_batch_size": 16, "micro_batch_size": 4,
}


def plain_rank(rank: int, world: int, port: int, steps: int, warmup: int, out: str) -> None:
    """One rank of the baseline: what a user would write by hand with DeepSpeed alone."""
    import deepspeed.comm as dist

    from airay.config import JobConfig, resolve_callable
    from airay.data.source import SyntheticSource
    from airay.policy import plan_batch
    from airay.worker.engine import backward_micro_batch
    from benchmarks.plain import plain_engine

    cfg = JobConfig.from_dict({**SPEC, "max_steps": steps, "scaling": {"min_workers": world, "max_workers": world}})
    plan = plan_batch(cfg.global_batch_size, cfg.micro_batch_size, world)
    model = resolve_callable(cfg.model.factory)(seed=cfg.seed, **cfg.model.kwargs)
    engine = plain_engine(model, cfg.deepspeed, plan, rank=rank, world=world, port=port)
    loss_fn = resolve_callable(cfg.loss_fn)
    data = SyntheticSource(resolve_callable(cfg.data.sample_fn), cfg.data.seed, cfg.data.kwargs)
    ends = []
    for step in range(steps):
        for batch, samples in zip(data.micro_batches(step, rank, plan), plan.micro_sizes(rank)):
            backward_micro_batch(engine, loss_fn(engine, batch), samples, plan)
        ends.append(time.time())
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"ends": ends}))


def run_plain(world: int, steps: int, warmup: int, tmp: Path) -> float:
    from airay.worker import free_port

    port, out = free_port(), tmp / f"plain-{time.time_ns()}.json"
    procs = [subprocess.Popen([sys.executable, __file__, "--plain-rank", str(r), "--workers", str(world),
                               "--port", str(port), "--steps", str(steps), "--warmup", str(warmup), "--out", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"plain rank failed: {err.decode()[-2000:]}")
    ends = json.loads(out.read_text())["ends"]
    gbs = SPEC["global_batch_size"]
    return (steps - warmup) * gbs / (ends[-1] - ends[warmup - 1])


def run_airay(world: int, steps: int, warmup: int, per_round: int, tmp: Path) -> float:
    from airay import JobConfig, fit
    from airay.events import read_jsonl

    run = tmp / f"airay-{time.time_ns()}"
    cfg = JobConfig.from_dict({**SPEC, "max_steps": steps, "steps_per_round": per_round,
                               "scaling": {"min_workers": world, "max_workers": world},
                               "checkpoint": {"every_n_steps": steps}, "run_dir": str(run)})
    result = fit(cfg, echo=False)
    assert result.status == "finished", result.error
    ts = {m["step"]: m["ts"] for m in read_jsonl(run / "metrics.jsonl")}
    return (steps - warmup) * cfg.global_batch_size / (ts[steps - 1] - ts[warmup - 1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps-per-round", type=int, default=10, help="airay's steps per driver call")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--plain-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_rank is not None:
        plain_rank(args.plain_rank, args.workers, args.port, args.steps, args.warmup, args.out)
        return 0
    k = args.steps_per_round
    if args.warmup % k or args.steps % k or args.warmup >= args.steps:
        ap.error(f"--warmup and --steps must be multiples of --steps-per-round ({k}), warmup < steps")

    import ray

    from airay.config import LocalClusterSpec
    from airay.local_cluster import LocalCluster

    lc = LocalCluster(LocalClusterSpec(local_nodes=args.workers, cpus_per_node=1))
    ray.init(address=lc.address, logging_level="ERROR", log_to_driver=False)
    plain, airay = [], []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):
                plain.append(run_plain(args.workers, args.steps, args.warmup, Path(tmp)))
                airay.append(run_airay(args.workers, args.steps, args.warmup, k, Path(tmp)))
    finally:
        ray.shutdown()
        lc.shutdown()
    ratios = [a / p for a, p in zip(airay, plain)]
    med = {"plain": statistics.median(plain), "airay": statistics.median(airay), "ratio": statistics.median(ratios)}
    print(f"steady-state samples/s, {args.workers} workers, tiny_gpt ZeRO-2 (CPU/gloo), steps "
          f"{args.warmup}..{args.steps}, airay steps_per_round {k}, median of {args.repeats}:")
    print(f"  plain DeepSpeed  {med['plain']:8.1f}   runs {[round(x, 1) for x in plain]}")
    print(f"  airay            {med['airay']:8.1f}   runs {[round(x, 1) for x in airay]}")
    print(f"  airay / plain ratio: {med['ratio']:.3f} (per pair {[round(r, 3) for r in ratios]}); "
          f"target >= {TARGET} -> {'met' if med['ratio'] >= TARGET else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"plain": plain, "airay": airay, "ratios": ratios, "median": med},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""airay's steady-state overhead: samples/s under airay vs the same training without it.

Both sides train the same model (tiny_gpt), DeepSpeed config (ZeRO-2, AdamW), batch plan, world
size and synthetic samples on this machine:
  plain  one OS process per rank started here, torch.distributed (gloo) + deepspeed.initialize,
         a bare step loop: no Ray, no driver, no rounds
  airay  airay.fit on a local Ray cluster (one node per worker): actors, rounds driven by the
         controller, per-round metrics and capacity checks
Throughput is wall time over the steady-state steps (after `--warmup` steps), measured the same
way on both sides: from the end of step warmup-1 to the end of the last step, no checkpoint in
between. The model has no sleep in it: a step is CPU work. The two run in interleaved pairs (the
order alternating), in one invocation, until the 95% confidence interval of the ratio (Student's t
over the pairs' log ratios) is within +-`--width` (3%), at least `--min-pairs`, at most `--max-pairs`.

Where the CPU goes: during each run's steady state every process's CPU time is sampled, and the
cores each kind of process used are reported per side (median over the runs): the training
ranks, the driver (this process: airay's controller runs in it; the plain side's only waits),
airay's checkpoint stores, Ray's daemons (raylets, GCS, agents, monitors; up on both sides: one
cluster serves the whole invocation) and the rest of the machine.

The round boundary: in each airay run, the median interval between step ends inside a round and
at a round's first step (the driver gathers the round, records it, launches the next): the
difference is what one round boundary costs, against the steps_per_round steps it serves.

Usage: python benchmarks/overhead.py [--workers 2] [--steps 200] [--warmup 20] [--min-pairs 5]
       [--max-pairs 14] [--width 0.03] [--steps-per-round 10] [--json F]
Target: the interval's lower bound >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sampler import Sampler  # noqa: E402

TARGET = 0.97
MODEL_NOTE = "tiny_gpt d_model 128 x 4 layers, seq 64 (unpaced)"
SPEC = {
    # Sized so a step is CPU work (no sleep in the model): about 0.1 s of compute per step here.
    "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"vocab_size": 256, "seq_len": 64, "d_model": 128,
                                                                 "n_layers": 4, "n_heads": 4}},
    "loss_fn": "airay.models.tiny_gpt:loss",
    "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}},
    "global_batch_size": 16, "micro_batch_size": 4,
}


def plain_rank(rank: int, world: int, port: int, steps: int, warmup: int, out: str) -> None:
    """One rank of the baseline: what a user would write by hand with DeepSpeed alone."""
    import deepspeed.comm as dist

    from airay.config import JobConfig
    from benchmarks.plain import plain_job, train_step

    cfg = JobConfig.from_dict({**SPEC, "max_steps": steps, "scaling": {"min_workers": world, "max_workers": world}})
    engine, plan, loss_fn, data = plain_job(cfg, rank=rank, world=world, port=port)
    ends = []
    for step in range(steps):
        train_step(engine, loss_fn, data, step, rank, plan)
        ends.append(time.time())
    dist.barrier()
    if rank == 0:
        Path(out).write_text(json.dumps({"ends": ends}))


CPU_KINDS = ("ranks", "driver", "stores", "ray", "other")
RAY_DAEMONS = ("raylet", "gcs_server", "DashboardAgent", "RuntimeEnvAgent", "dashboard.py", "log_monitor", "monitor.py")


def cpu_kind(pid: int, name: str, cmdline: str) -> str:
    """Which kind of process this is, for the steady state's CPU shares."""
    if "--plain-rank" in cmdline or name.startswith("ray::TrainWorker") or "ray::TrainWorker" in cmdline:
        return "ranks"
    if pid == os.getpid():
        return "driver"
    if "ray::NodeStore" in cmdline or name.startswith("ray::NodeStore"):
        return "stores"
    if any(d in cmdline or d in name for d in RAY_DAEMONS):
        return "ray"
    return "other"


class CpuSampler(Sampler):
    """Every process's CPU seconds, sampled in a thread (every 0.5 s), so the cores each kind used
    over a window can be read afterwards (`cores`)."""

    def __init__(self):
        super().__init__()
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []

    def sample(self):
        import psutil

        now, snap = time.time(), {}
        for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
            info = proc.info
            if info["cpu_times"] is not None:
                snap[info["pid"]] = (cpu_kind(info["pid"], info["name"] or "", " ".join(info["cmdline"] or [])),
                                     info["cpu_times"].user + info["cpu_times"].system)
        self.samples.append((now, snap))

    def cores(self, t0: float, t1: float) -> dict[str, float]:
        """Cores used by each kind between the first sample at or after t0 and the last at or before t1."""
        inside = [(t, snap) for t, snap in self.samples if t0 <= t <= t1]
        if len(inside) < 2:
            return {}
        (ta, a), (tb, b) = inside[0], inside[-1]
        used = dict.fromkeys(CPU_KINDS, 0.0)
        for pid, (kind, cpu) in b.items():
            used[kind] += max(0.0, cpu - a.get(pid, (kind, 0.0))[1])
        return {kind: v / (tb - ta) for kind, v in used.items()}


def run_plain(world: int, steps: int, warmup: int, tmp: Path) -> tuple[float, float, float]:
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
    return (steps - warmup) * gbs / (ends[-1] - ends[warmup - 1]), ends[warmup - 1], ends[-1]


def round_gap(ts: dict[int, float], first: int, last: int, per_round: int) -> dict[str, float]:
    """Median step-end interval inside rounds and at a round's first step, over steps first..last."""
    inside = [ts[s] - ts[s - 1] for s in range(first + 1, last + 1) if s % per_round]
    at_start = [ts[s] - ts[s - 1] for s in range(first + 1, last + 1) if not s % per_round]
    return {"step_s": statistics.median(inside), "first_step_s": statistics.median(at_start)}


def run_airay(world: int, steps: int, warmup: int, per_round: int, tmp: Path, gaps: list | None = None
              ) -> tuple[float, float, float]:
    from airay import JobConfig, fit
    from airay.events import read_jsonl

    run = tmp / f"airay-{time.time_ns()}"
    cfg = JobConfig.from_dict({**SPEC, "max_steps": steps, "steps_per_round": per_round,
                               "scaling": {"min_workers": world, "max_workers": world},
                               "checkpoint": {"every_n_steps": steps}, "run_dir": str(run)})
    result = fit(cfg, echo=False)
    assert result.status == "finished", result.error
    ts = {m["step"]: m["ts"] for m in read_jsonl(run / "metrics.jsonl")}
    if gaps is not None:
        gaps.append(round_gap(ts, warmup - 1, steps - 1, per_round))
    return (steps - warmup) * cfg.global_batch_size / (ts[steps - 1] - ts[warmup - 1]), ts[warmup - 1], ts[steps - 1]


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086}


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-pair ratios and its 95% confidence interval (Student's t on the log
    ratios: a pair shares the machine's state, so pairs are the independent samples)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = T95[min(len(logs) - 1, 20)] * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def narrow_enough(ratios: list[float], width: float) -> bool:
    """The interval lies within +-`width` of the estimate."""
    r, lo, hi = ratio_interval(ratios)
    return hi / r - 1 <= width and 1 - lo / r <= width


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--min-pairs", type=int, default=5)
    ap.add_argument("--max-pairs", type=int, default=14)
    ap.add_argument("--width", type=float, default=0.03, help="stop once the 95%% interval is within +-this")
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
    plain, airay, ratios = [], [], []
    cores: dict[str, list[dict[str, float]]] = {"plain": [], "airay": []}
    gaps: list[dict[str, float]] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, CpuSampler() as sampler:
            while len(ratios) < args.max_pairs and not (len(ratios) >= args.min_pairs
                                                         and narrow_enough(ratios, args.width)):
                # Each pair in alternating order, so a drift of the machine favours neither side.
                order = ("plain", "airay") if len(ratios) % 2 == 0 else ("airay", "plain")
                got = {}
                for side in order:
                    got[side], t0, t1 = run_plain(args.workers, args.steps, args.warmup, Path(tmp)) \
                        if side == "plain" else run_airay(args.workers, args.steps, args.warmup, k, Path(tmp), gaps)
                    cores[side].append(sampler.cores(t0, t1))
                plain.append(got["plain"])
                airay.append(got["airay"])
                ratios.append(got["airay"] / got["plain"])
                r, lo, hi = ratio_interval(ratios)
                print(f"pair {len(ratios)}: plain {got['plain']:.1f}, airay {got['airay']:.1f} samples/s, "
                      f"ratio {ratios[-1]:.3f}; so far {r:.3f} [{lo:.3f}, {hi:.3f}]", flush=True)
    finally:
        ray.shutdown()
        lc.shutdown()
    r, lo, hi = ratio_interval(ratios)
    med = {"plain": statistics.median(plain), "airay": statistics.median(airay), "ratio": r,
           "ci95": [lo, hi], "pairs": len(ratios), "narrow_enough": narrow_enough(ratios, args.width),
           "round_gap": {key: statistics.median(g[key] for g in gaps) for key in ("step_s", "first_step_s")},
           "cores": {side: {kind: statistics.median(c.get(kind, 0.0) for c in runs) for kind in CPU_KINDS}
                     for side, runs in cores.items()}}
    print(f"steady-state samples/s, {args.workers} workers, {MODEL_NOTE}, ZeRO-2 (CPU/gloo), steps "
          f"{args.warmup}..{args.steps}, airay steps_per_round {k}, {len(ratios)} interleaved pairs:")
    print(f"  plain DeepSpeed  {med['plain']:8.1f}   runs {[round(x, 1) for x in plain]}")
    print(f"  airay            {med['airay']:8.1f}   runs {[round(x, 1) for x in airay]}")
    print(f"  airay / plain ratio: {r:.3f}, 95% CI [{lo:.3f}, {hi:.3f}] "
          f"({'within' if med['narrow_enough'] else 'NOT within'} +-{args.width:.0%}); target lower bound >= "
          f"{TARGET} -> {'met' if lo >= TARGET else 'MISSED'}")
    gap = med["round_gap"]["first_step_s"] - med["round_gap"]["step_s"]
    med["round_gap"]["share"] = gap / (k * med["round_gap"]["step_s"] + gap)
    print(f"  round boundary: a step inside a round {med['round_gap']['step_s'] * 1e3:.1f} ms, a round's first step "
          f"{med['round_gap']['first_step_s'] * 1e3:.1f} ms: {gap * 1e3:.1f} ms per {k} steps "
          f"({med['round_gap']['share']:.1%} of the steady state)")
    print(f"  cores used in the steady state (median; {os.cpu_count()} cores): "
          + "; ".join(f"{side} " + ", ".join(f"{kind} {v:.3f}" for kind, v in used.items())
                      for side, used in med["cores"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"plain": plain, "airay": airay, "ratios": ratios, "median": med,
                                               "cores": cores, "round_gaps": gaps, "args": vars(args), "cores_total": os.cpu_count()},
                                              indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""airay's steady-state overhead: samples/s under airay vs the same training without it.

Both sides train the same model (tiny_gpt), DeepSpeed config (ZeRO-2, AdamW), batch plan, world
size and synthetic samples on this machine:
  plain  one OS process per rank started here, torch.distributed (gloo) + deepspeed.initialize,
         a bare step loop: no Ray, no driver, no rounds
  airay  airay.fit in a driver process of its own on a local Ray cluster (one node per worker):
         actors, rounds driven by the controller (pipelined), per-step metrics and TensorBoard,
         the nodes' checkpoint stores
The model has no sleep in it: a step is CPU work.

Time-sliced: both sides are started once and train "forever"; after both pass `--warmup` steps,
they take turns: one side runs for `--window` seconds while every process of the other (ranks,
and airay's driver and stores) is stopped (SIGSTOP), then the other. A pair is two adjacent
windows, the order alternating (ABBA), so a drift of the machine favours neither side. Each
window's samples/s is taken between its step ends (the step cut by the pause before it is left
out), the same way on both sides. The machine's noise is mostly seconds-long (the same process
measured over 5 s windows varies by about 5%), so many short adjacent windows resolve the ratio far
better than whole runs in turn: pairs are added until the 95% confidence interval of the ratio
(Student's t over the pairs' log ratios) is within +-`--width`, at least `--min-pairs`, at most
`--max-pairs`.

Where the CPU goes: during each window every process's CPU time is sampled, and the cores each
kind of process used are reported per side (median over the windows): the training ranks,
airay's driver, airay's checkpoint stores, Ray's daemons (up on both sides: one cluster serves
the whole invocation) and the rest (this benchmark's process among it).

The round boundary: the median interval between step ends inside a round and at a round's
first step (the rank goes from one round's call to the next; the driver gathers, records and
launches meanwhile): the difference is what one round boundary costs, against the
steps_per_round steps it serves.

Usage: python benchmarks/overhead.py [--workers 2] [--window 4] [--warmup 20] [--min-pairs 10]
       [--max-pairs 60] [--width 0.01] [--steps-per-round 10] [--json F]
Target: the interval's lower bound >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airay.events import read_jsonl  # noqa: E402
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


FOREVER = 10**7  # steps: both sides train until this benchmark stops them


def plain_rank(rank: int, world: int, port: int, out: str) -> None:
    """One rank of the baseline: what a user would write by hand with DeepSpeed alone. Rank 0
    appends each step's end time to `out` (the step number and time, one line per step)."""
    from airay.config import JobConfig
    from benchmarks.plain import plain_job, train_step

    cfg = JobConfig.from_dict({**SPEC, "max_steps": FOREVER,
                               "scaling": {"min_workers": world, "max_workers": world}})
    engine, plan, loss_fn, data = plain_job(cfg, rank=rank, world=world, port=port)
    with open(out, "w", buffering=1) if rank == 0 else open(os.devnull, "w") as f:
        for step in range(FOREVER):
            train_step(engine, loss_fn, data, step, rank, plan)
            f.write(f"{step} {time.time()}\n")


def airay_driver(run_dir: str, world: int, per_round: int) -> None:
    """airay's side: a driver process of its own (so it can be paused with its ranks)."""
    import ray

    from airay import JobConfig, fit

    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    cfg = JobConfig.from_dict({**SPEC, "max_steps": FOREVER, "steps_per_round": per_round,
                               "scaling": {"min_workers": world, "max_workers": world},
                               "checkpoint": {"every_n_steps": FOREVER}, "run_dir": run_dir})
    fit(cfg, echo=False)


CPU_KINDS = ("ranks", "driver", "stores", "ray", "other")
RAY_DAEMONS = ("raylet", "gcs_server", "DashboardAgent", "RuntimeEnvAgent", "dashboard.py", "log_monitor", "monitor.py")


def cpu_kind(pid: int, name: str, cmdline: str) -> str:
    """Which kind of process this is, for the steady state's CPU shares."""
    if "--plain-rank" in cmdline or name.startswith("ray::TrainWorker") or "ray::TrainWorker" in cmdline:
        return "ranks"
    if "--airay-driver" in cmdline:
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


class Side:
    """One side's processes: started once, then paused and resumed by the windows."""

    def __init__(self, name: str, procs: list[subprocess.Popen], ends: Callable[[], dict[int, float]],
                 find_pids: Callable[[], list[int] | None] | None = None):
        self.name, self.procs, self.ends, self.find_pids = name, procs, ends, find_pids
        self.pids: list[int] = [p.pid for p in procs]  # plus airay's actors once they are up

    def up(self) -> bool:
        """Every process of this side is known (airay's actors: once its world is formed)."""
        if self.find_pids is not None:
            found = self.find_pids()
            if found is None:
                return False
            self.pids = found
        return True

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def check(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{self.name}'s process {p.args[-6:]} exited ({p.returncode}): "
                                   + (p.stderr.read().decode()[-2000:] if p.stderr else ""))


def plain_side(world: int, tmp: Path) -> Side:
    from airay.worker import free_port

    port, out = free_port(), tmp / "plain-ends.txt"
    procs = [subprocess.Popen([sys.executable, __file__, "--plain-rank", str(r), "--workers", str(world),
                               "--port", str(port), "--out", str(out)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(world)]

    def ends() -> dict[int, float]:
        lines = out.read_text().split("\n")[:-1] if out.exists() else []  # whole lines only
        return {int(a): float(b) for a, b in (x.split() for x in lines)}
    return Side("plain", procs, ends)


def airay_side(world: int, per_round: int, tmp: Path, address: str) -> Side:
    run = tmp / "airay-run"
    proc = subprocess.Popen([sys.executable, __file__, "--airay-driver", str(run), "--workers", str(world),
                             "--steps-per-round", str(per_round)], env={**os.environ, "RAY_ADDRESS": address},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def ends() -> dict[int, float]:
        return {m["step"]: m["ts"] for m in read_jsonl(run / "metrics.jsonl")}

    def find_pids() -> list[int] | None:  # the driver, the ranks (world_formed) and the checkpoint stores
        formed = [e for e in read_jsonl(run / "events.jsonl") if e["type"] == "world_formed"]
        if not formed:
            return None
        stores = [p.pid for p in psutil.process_iter(["cmdline"]) if "ray::NodeStore" in " ".join(p.info["cmdline"] or [])]
        return [proc.pid] + [w["pid"] for w in formed[0]["workers"]] + stores
    return Side("airay", [proc], ends, find_pids)


def window_rate(ends: dict[int, float], t0: float, t1: float) -> tuple[float, list[int]] | None:
    """Steps per second between the step ends inside [t0, t1] (the first of them ends the step the
    pause cut, so only the intervals after it count), and those steps."""
    steps = sorted(s for s, t in ends.items() if t0 <= t <= t1)
    if len(steps) < 3 or steps[-1] - steps[0] != len(steps) - 1:
        return None
    return (len(steps) - 1) / (ends[steps[-1]] - ends[steps[0]]), steps[1:]


def round_gap(ts: dict[int, float], steps: list[int], per_round: int) -> dict[str, float]:
    """Median step-end interval inside rounds and at a round's first step, over `steps` (each one's
    interval from the step before it)."""
    inside = [ts[s] - ts[s - 1] for s in steps if s % per_round]
    at_start = [ts[s] - ts[s - 1] for s in steps if not s % per_round]
    return {"step_s": statistics.median(inside), "first_step_s": statistics.median(at_start)}


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
       21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042}


def ratio_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-pair ratios and its 95% confidence interval (Student's t on the log
    ratios: a pair shares the machine's state, so pairs are the independent samples)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), 0.0, math.inf
    half = T95[min(len(logs) - 1, 30)] * statistics.stdev(logs) / math.sqrt(len(logs))  # past 30: t(30), wider
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def interval_text(lo: float, hi: float) -> str:
    """The interval at 3 decimals, rounded outwards: a bound never reads better than it is."""
    def out(x: float, rnd) -> str:
        return f"{rnd(x * 1000) / 1000:.3f}" if math.isfinite(x) else "inf"
    return f"[{out(lo, math.floor)}, {out(hi, math.ceil)}]"


def narrow_enough(ratios: list[float], width: float) -> bool:
    """The interval lies within +-`width` of the estimate."""
    r, lo, hi = ratio_interval(ratios)
    return hi / r - 1 <= width and 1 - lo / r <= width


def wait_warm(sides: list[Side], warmup: int, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        for side in sides:
            side.check()
        if all(len(side.ends()) >= warmup for side in sides) and all(side.up() for side in sides):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the sides did not pass {warmup} steps within {timeout_s:.0f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--window", type=float, default=4.0, help="seconds each side runs per turn")
    ap.add_argument("--warmup", type=int, default=20, help="steps each side trains before the first window")
    ap.add_argument("--min-pairs", type=int, default=10)
    ap.add_argument("--max-pairs", type=int, default=60)
    ap.add_argument("--width", type=float, default=0.01, help="stop once the 95%% interval is within +-this")
    ap.add_argument("--steps-per-round", type=int, default=10, help="airay's steps per driver call")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("--plain-rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--airay-driver", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    k = args.steps_per_round
    if args.plain_rank is not None:
        plain_rank(args.plain_rank, args.workers, args.port, args.out)
        return 0
    if args.airay_driver is not None:
        airay_driver(args.airay_driver, args.workers, k)
        return 0

    import ray

    from airay.config import LocalClusterSpec
    from airay.local_cluster import LocalCluster

    lc = LocalCluster(LocalClusterSpec(local_nodes=args.workers, cpus_per_node=1))
    ray.init(address=lc.address, logging_level="ERROR", log_to_driver=False)
    gbs = SPEC["global_batch_size"]
    rates: dict[str, list[float]] = {"plain": [], "airay": []}
    ratios: list[float] = []
    cores: dict[str, list[dict[str, float]]] = {"plain": [], "airay": []}
    windows: list[tuple[str, float, float]] = []
    sides: list[Side] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, CpuSampler() as sampler:
            sides = [plain_side(args.workers, Path(tmp)), airay_side(args.workers, k, Path(tmp), lc.address)]
            by_name = {s.name: s for s in sides}
            wait_warm(sides, args.warmup)
            while len(ratios) < args.max_pairs and not (len(ratios) >= args.min_pairs
                                                         and narrow_enough(ratios, args.width)):
                order = ("plain", "airay") if len(ratios) % 2 == 0 else ("airay", "plain")  # ABBA
                for name in order:
                    for other in sides:
                        if other.name != name:
                            other.signal(signal.SIGSTOP)
                    by_name[name].signal(signal.SIGCONT)
                    t0 = time.time()
                    time.sleep(args.window)
                    windows.append((name, t0, time.time()))
                    by_name[name].check()
                for side in sides:  # let airay's driver write the steps its ranks ended
                    side.signal(signal.SIGSTOP if side.name == "plain" else signal.SIGCONT)
                time.sleep(0.3)
                pair = windows[-2:]
                got = {}
                for name, t0, t1 in pair:
                    got[name] = window_rate(by_name[name].ends(), t0, t1)
                if any(v is None for v in got.values()):
                    raise RuntimeError(f"a window of {args.window}s held too few steps: {got}")
                for name, t0, t1 in pair:
                    rates[name].append(got[name][0] * gbs)
                    cores[name].append(sampler.cores(t0, t1))
                ratios.append(rates["airay"][-1] / rates["plain"][-1])
                r, lo, hi = ratio_interval(ratios)
                print(f"pair {len(ratios)}: plain {rates['plain'][-1]:.1f}, airay {rates['airay'][-1]:.1f} samples/s, "
                      f"ratio {ratios[-1]:.3f}; so far {r:.3f} {interval_text(lo, hi)}", flush=True)
            time.sleep(1.0)  # airay runs on: its driver records the last window's steps
            airay_ends = by_name["airay"].ends()
            gap_steps = [s for name, t0, t1 in windows if name == "airay"
                         for s in (window_rate(airay_ends, t0, t1) or (0, []))[1]]
            gap = round_gap(airay_ends, gap_steps, k)
    finally:
        for side in sides:
            side.signal(signal.SIGCONT)
            for p in side.procs:
                p.kill()
                p.wait()
        ray.shutdown()
        lc.shutdown()
    r, lo, hi = ratio_interval(ratios)
    med = {"plain": statistics.median(rates["plain"]), "airay": statistics.median(rates["airay"]), "ratio": r,
           "ci95": [lo, hi], "pairs": len(ratios), "narrow_enough": narrow_enough(ratios, args.width),
           "round_gap": gap,
           "cores": {side: {kind: statistics.median(c.get(kind, 0.0) for c in runs) for kind in CPU_KINDS}
                     for side, runs in cores.items()}}
    print(f"steady-state samples/s, {args.workers} workers, {MODEL_NOTE}, ZeRO-2 (CPU/gloo), time-sliced windows "
          f"of {args.window:g}s after {args.warmup} warm-up steps, airay steps_per_round {k}, {len(ratios)} pairs:")
    print(f"  plain DeepSpeed  {med['plain']:8.1f}   windows {[round(x, 1) for x in rates['plain']]}")
    print(f"  airay            {med['airay']:8.1f}   windows {[round(x, 1) for x in rates['airay']]}")
    print(f"  airay / plain ratio: {r:.3f}, 95% CI {interval_text(lo, hi)} "
          f"({'within' if med['narrow_enough'] else 'NOT within'} +-{args.width:.0%}); target lower bound >= "
          f"{TARGET} -> {'met' if lo >= TARGET else 'MISSED'}")
    extra = gap["first_step_s"] - gap["step_s"]
    gap["share"] = extra / (k * gap["step_s"] + extra)
    print(f"  round boundary (a rank going from one round's call to the next): a step inside a round {gap['step_s'] * 1e3:.1f} ms, a round's first step "
          f"{gap['first_step_s'] * 1e3:.1f} ms: {extra * 1e3:.1f} ms per {k} steps ({gap['share']:.1%} of the steady state)")
    print(f"  cores used in the steady state (median; {os.cpu_count()} cores): "
          + "; ".join(f"{side} " + ", ".join(f"{kind} {v:.3f}" for kind, v in used.items())
                      for side, used in med["cores"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"plain": rates["plain"], "airay": rates["airay"], "ratios": ratios,
                                               "median": med, "cores": cores, "windows": windows,
                                               "args": vars(args), "cores_total": os.cpu_count()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

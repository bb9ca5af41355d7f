"""Goodput over a long failure schedule: airay vs Ray Train's elastic TorchTrainer.

Both sides train the job of benchmarks/raytrain.py (tiny_gpt with no sleep in it: a step is CPU
work; ZeRO-2, AdamW, global batch 24, 2 to 4 workers) on a fresh 4-node local cluster (one CPU
each) per run, measured over the same fixed window of `--window` seconds (20 min by default) from
the start of training (fit(); the cluster is started before, the same for both). The same faults
strike both at the same offsets into the window, from a driver thread, as the world outside would:
  kill     SIGKILL to the process of rank 1 (a worker crash)
  preempt  SIGTERM to the process of rank 3 (a spot reclaim of one worker)
  node     the node of rank 2 dies with its processes; a node is added back `--regrow` s later
Each side checkpoints at the interval Young/Daly give for its own measured checkpoint cost C and
the schedule's failure rate (MTBF = window / faults): tau = sqrt(2 C M) - C, in steps of its
measured step time. C and the step time come from a short calibration run per side (no faults):
airay's `held_s` of a memory-tier save; Ray Train's save + report on rank 0.

goodput = seconds of kept steps / window seconds (airay.goodput's definition; a step's time counts
once, at its last execution). Reported per side: median over `--repeats` runs and each run; for
airay also where the rest went (airay.goodput's causes) and the simulator's prediction for the same
schedule (airay.simulate.predicted_goodput: the same faults at the same moments, this run's
measured step, checkpoint, recovery and replacement times, start-up added).

Usage: python benchmarks/goodput.py [--window 1200] [--repeats 2] [--regrow 60] [--json F]
Target: airay >= 0.95 (median).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from airay import JobConfig, fit, goodput  # noqa: E402
from airay.config import LocalClusterSpec  # noqa: E402
from airay.events import read_jsonl  # noqa: E402
from airay.local_cluster import LocalCluster  # noqa: E402
from airay.simulate import predicted_goodput, young_daly_interval  # noqa: E402
from benchmarks import raytrain  # noqa: E402
from benchmarks.raytrain import DEEPSPEED, GLOBAL_BATCH, MICRO_BATCH, MODEL_KWARGS, read_progress  # noqa: E402

TARGET = 0.95
KINDS = ("node", "kill", "preempt")
RANK = {"kill": 1, "node": 2, "preempt": 3}


def schedule(window_s: float, faults: int) -> list[tuple[float, str]]:
    """`faults` faults spread evenly over the window (the first half a gap in), cycling the kinds."""
    gap = window_s / faults
    return [(gap * (i + 0.5), KINDS[i % len(KINDS)]) for i in range(faults)]


def interval_steps(checkpoint_s: float, mtbf_s: float, step_s: float) -> int:
    """Young/Daly's interval for this checkpoint cost and failure rate, in whole steps."""
    return max(1, round(young_daly_interval(checkpoint_s, mtbf_s) / step_s))


class Injector(threading.Thread):
    """Strikes the schedule at its offsets after `t0`, at the process or node `target(rank)` names."""

    def __init__(self, plan: list[tuple[float, str]], t0: float, target, local: LocalCluster, regrow_s: float):
        super().__init__(daemon=True)
        self.plan, self.t0, self.target, self.local, self.regrow_s = plan, t0, target, local, regrow_s
        self.stop = threading.Event()
        self.strikes: list[dict] = []

    def run(self) -> None:
        for offset, kind in self.plan:
            if self.stop.wait(max(0.0, self.t0 + offset - time.time())):
                return
            strike = {"ts": time.time(), "kind": kind}
            try:
                pid, node = self.target(RANK[kind])
                strike.update(pid=pid, node=node)
                if kind == "kill":
                    os.kill(pid, signal.SIGKILL)
                elif kind == "preempt":
                    os.kill(pid, signal.SIGTERM)
                else:
                    self.local.remove_node(node)
                    threading.Timer(self.regrow_s, self._regrow, args=(strike,)).start()
            except Exception as exc:  # the target was gone already: recorded, the schedule goes on
                strike["missed"] = f"{type(exc).__name__}: {exc}"
            self.strikes.append(strike)

    def _regrow(self, strike: dict) -> None:
        if not self.stop.is_set():
            strike["regrown_ts"] = time.time()
            self.local.add_node()


# ---- airay -------------------------------------------------------------------------------------

def airay_config(run: Path, steps: int, every: int, durable_every: int) -> JobConfig:
    return JobConfig.from_dict({
        "name": run.name, "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": MODEL_KWARGS},
        "loss_fn": "airay.models.tiny_gpt:loss", "deepspeed": DEEPSPEED,
        "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH, "max_steps": steps,
        "scaling": {"min_workers": 2, "max_workers": 4},
        "checkpoint": {"fast_every_n_steps": every, "every_n_steps": durable_every},
        "max_failures": 100, "run_dir": str(run)})


def airay_target(run: Path):
    def target(rank: int) -> tuple[int, str]:
        formed = [e for e in read_jsonl(run / "events.jsonl") if e["type"] == "world_formed"][-1]
        worker = formed["workers"][min(rank, len(formed["workers"]) - 1)]
        return worker["pid"], worker["node_id"]
    return target


def airay_window(root: Path, local: LocalCluster, window_s: float, plan, every: int, regrow_s: float) -> dict:
    """One airay run, stopped (SIGTERM to this driver: checkpoint and exit) at the end of the window."""
    run = root / f"airay-{time.time_ns()}"
    cfg = airay_config(run, steps=10**7, every=every, durable_every=every * 10)
    t0 = time.time()
    injector = Injector(plan, t0, airay_target(run), local, regrow_s)
    stopper = threading.Timer(window_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
    injector.start()
    stopper.start()
    try:
        result = fit(cfg, echo=False, local_cluster=local, launched_ts=t0)
    finally:
        injector.stop.set()
        stopper.cancel()
    assert result.status in ("preempted", "finished"), result.error
    end = t0 + window_s
    events = [e for e in read_jsonl(run / "events.jsonl") if e["ts"] <= end]
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if m["ts"] <= end]
    g = goodput.compute(events, metrics, end_ts=end)
    return {"goodput": g.goodput, "lost_s": g.lost_s, "kept_steps": g.kept_steps, "replayed_steps": g.replayed_steps,
            "strikes": injector.strikes, "measured": measured(events, metrics, injector.strikes, t0, end)}


def measured(events: list[dict], metrics: list[dict], strikes: list[dict], t0: float, end: float) -> dict:
    """What the simulator needs to replay this run (airay.simulate.replay_measured)."""
    formed = next(e["ts"] for e in events if e["type"] == "world_formed")
    ready = [e["ts"] for e in events if e["type"] == "worker_ready" and e["ts"] > formed]
    full = max(m["world_size"] for m in metrics)
    waits = [min(r for r in ready if r > s["ts"]) - s["ts"] for s in strikes if any(r > s["ts"] for r in ready)]
    held = [e["held_s"] for e in events if e["type"] == "checkpoint_saved" and e["tier"] == "memory"]
    rec = [e["recovery_s"] for e in events if e["type"] == "resize_finished" and e["reason"] == "failure"]
    return {"window_s": end - formed, "startup_s": formed - t0, "full_world": full,
            "step_s": statistics.median(m["step_time_s"] for m in metrics if m["world_size"] == full),
            "blocking_s": statistics.median(held) if held else 0.0,
            "recovery_s": statistics.median(rec) if rec else 0.0,
            "replacement_s": statistics.median(waits) if waits else None,
            "fault_offsets_s": [s["ts"] - formed for s in strikes], "kept_steps": len({m["step"] for m in metrics})}


def airay_calibrate(root: Path, local: LocalCluster, steps: int = 40, every: int = 5) -> dict:
    run = root / f"airay-calibrate-{time.time_ns()}"
    result = fit(airay_config(run, steps, every, every), echo=False, local_cluster=local)
    assert result.status == "finished", result.error
    ev, met = read_jsonl(run / "events.jsonl"), read_jsonl(run / "metrics.jsonl")
    return {"checkpoint_s": statistics.median(e["held_s"] for e in ev if e["type"] == "checkpoint_saved"
                                              and e["tier"] == "memory"),
            "step_s": statistics.median(m["step_time_s"] for m in met if m["step"] >= every)}


# ---- Ray Train -------------------------------------------------------------------------------------

def ray_train_target(progress: Path):
    def target(rank: int) -> tuple[int, str]:
        rows = read_progress(progress)
        world = rows[-1]["world"]
        mine = [r for r in rows if r["rank"] == min(rank, world - 1)]
        return mine[-1]["pid"], mine[-1]["node"]
    return target


def ray_train_fit(progress: Path, storage: Path, steps: int, every: int, deadline: float | None,
                  max_failures: int) -> Path:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Its best settings, as in benchmarks/raytrain.py: health checks every 0.2 s (default 2 s).
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(raytrain.HEALTH_CHECK_INTERVAL_S)
    progress.mkdir(parents=True)
    trainer = TorchTrainer(
        raytrain.ray_train_loop, train_loop_config={"steps": steps, "progress_dir": str(progress),
                                                    "ckpt_every": every, "deadline": deadline},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=(2, 4), use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=progress.parent.name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    trainer.fit()
    return progress


def ray_train_window(root: Path, local: LocalCluster, window_s: float, plan, every: int, regrow_s: float) -> dict:
    progress = root / f"raytrain-{time.time_ns()}" / "progress"
    t0 = time.time()
    injector = Injector(plan, t0, ray_train_target(progress), local, regrow_s)
    injector.start()
    try:
        ray_train_fit(progress, root / "storage", 10**7, every, t0 + window_s, max_failures=100)
    finally:
        injector.stop.set()
    end = t0 + window_s
    rows = [r for r in read_progress(progress) if r["ts"] <= end]
    kept = goodput.kept_step_s([r for r in rows if r["rank"] == 0])
    steps = [r["step"] for r in rows if r["rank"] == 0]
    return {"goodput": kept / window_s, "kept_steps": len(set(steps)), "replayed_steps": len(steps) - len(set(steps)),
            "strikes": injector.strikes}


def ray_train_calibrate(root: Path, steps: int = 40, every: int = 5) -> dict:
    progress = ray_train_fit(root / f"raytrain-calibrate-{time.time_ns()}" / "progress", root / "storage", steps,
                             every, None, max_failures=0)
    rows = [r for r in read_progress(progress) if r["rank"] == 0]
    return {"checkpoint_s": statistics.median(r["ckpt_s"] for r in rows if "ckpt_s" in r),
            "step_s": statistics.median(r["step_time_s"] for r in rows if r["step"] >= every)}


# ---- the comparison --------------------------------------------------------------------------------

def fresh_cluster() -> LocalCluster:
    local = LocalCluster(LocalClusterSpec(local_nodes=4, cpus_per_node=1))
    ray.init(address=local.address, logging_level="ERROR", log_to_driver=False)
    return local


def close(local: LocalCluster) -> None:
    ray.shutdown()
    local.shutdown()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=1200.0, help="seconds each run is measured over")
    p.add_argument("--faults", type=int, default=6, help="faults per window (cycling node, kill, preempt)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side (alternating)")
    p.add_argument("--regrow", type=float, default=60.0, help="seconds until a lost node is added back")
    p.add_argument("--json")
    args = p.parse_args(argv)
    plan = schedule(args.window, args.faults)
    mtbf = args.window / args.faults
    sides = {"airay": airay_window, "ray_train": ray_train_window}
    out: dict = {"args": vars(args), "schedule": plan, "mtbf_s": mtbf, "calibration": {}, "runs": {s: [] for s in sides},
                 "model_kwargs": MODEL_KWARGS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for side in sides:  # the costs Young/Daly need, each side's own
            local = fresh_cluster()
            try:
                cal = airay_calibrate(root, local) if side == "airay" else ray_train_calibrate(root)
            finally:
                close(local)
            cal["interval_steps"] = interval_steps(cal["checkpoint_s"], mtbf, cal["step_s"])
            out["calibration"][side] = cal
            print(f"{side}: checkpoint {cal['checkpoint_s']:.3f} s, step {cal['step_s']:.3f} s -> Young/Daly "
                  f"interval {cal['interval_steps']} steps (MTBF {mtbf:.0f} s)", flush=True)
        for i in range(args.repeats):
            for side, window_run in sides.items():
                local = fresh_cluster()
                try:
                    run = window_run(root, local, args.window, plan, out["calibration"][side]["interval_steps"],
                                     args.regrow)
                finally:
                    close(local)
                if side == "airay":
                    run["predicted"] = predicted_goodput(run["measured"], out["calibration"][side]["interval_steps"])
                out["runs"][side].append(run)
                print(f"run {i} {side}: goodput {run['goodput']:.3f}"
                      + (f" (simulator {run['predicted']:.3f}; lost " + ", ".join(
                          f"{c} {v:.1f}" for c, v in run["lost_s"].items()) + ")" if side == "airay" else ""),
                      flush=True)
    med = {side: statistics.median(r["goodput"] for r in runs) for side, runs in out["runs"].items()}
    out["median"] = med
    out["predicted_median"] = statistics.median(r["predicted"] for r in out["runs"]["airay"])
    print(f"goodput over {args.window:.0f} s windows, {args.faults} faults each ({', '.join(k for _, k in plan)}), "
          f"median of {args.repeats}: airay {med['airay']:.3f}, Ray Train {med['ray_train']:.3f} "
          f"({med['airay'] / med['ray_train']:.2f}x); simulator for airay {out['predicted_median']:.3f}; "
          f"target airay >= {TARGET} -> {'met' if med['airay'] >= TARGET else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

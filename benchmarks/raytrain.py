"""Recovery after a worker loss and a node loss: airay vs Ray Train's elastic TorchTrainer.

Both sides train the same job on the same 4-node local Ray cluster (real raylets, one CPU each):
tiny_gpt, DeepSpeed ZeRO-2 with AdamW, global batch 24 split over the world, the same synthetic
samples per step, a checkpoint every 5 steps, `--steps` steps in all. The fault strikes at the
start of step `--fault-step`: rank 1 is SIGKILLed (worker loss) or the node of rank 2 dies with
all its processes (node loss).

  airay      airay.fit with the fault in its chaos spec.
  Ray Train  ray.train.torch.TorchTrainer (Train V2) with ScalingConfig(num_workers=(2, 4)),
             FailureConfig(max_failures=3), given its best settings as we know them: the
             canonical DeepSpeed pattern (every rank saves its ZeRO partition and reports it;
             Ray Train merges them into one checkpoint), gloo, DeepSpeed's shared-memory op
             disabled as airay does (a 30 s JIT build neither side uses), and on a restart at
             another world size the checkpoint is converted to DeepSpeed's universal format
             (what loading ZeRO state at a new world size requires). A driver thread injects the
             fault when rank 1 (or 2) has finished step fault_step - 1.

Reported per side (medians over `--repeats`):
  recovery_s    fault -> the first step completed after recovery (the same definition on both
                sides; for airay: fault_injected -> resize_finished of the shrink)
  steps_redone  fault step - the step training resumed at
  wall_s        training wall time for the fixed number of steps (cluster start excluded)

Usage: python benchmarks/raytrain.py [--faults worker,node] [--repeats 3] [--steps 30] [--json F]
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

from airay import JobConfig, fit  # noqa: E402
from airay.config import LocalClusterSpec  # noqa: E402
from airay import goodput  # noqa: E402
from airay.events import read_jsonl  # noqa: E402
from airay.local_cluster import LocalCluster  # noqa: E402
from airay.simulate import predicted_goodput  # noqa: E402
import benchmarks.plain  # noqa: E402
from benchmarks.plain import join_world, plain_engine, train_step  # noqa: E402

# Ray Train's workers cannot import `benchmarks` (not installed): its helpers travel by value.
ray.cloudpickle.register_pickle_by_value(benchmarks.plain)

GLOBAL_BATCH = 24
MICRO_BATCH = 4
CKPT_EVERY = 5
MODEL_KWARGS: dict = {}  # no sleep in the model: a step is CPU work (about 0.1-0.3 s here)
DEEPSPEED = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
FAULT_RANK = {"worker": 1, "node": 2}
HEALTH_CHECK_INTERVAL_S = 0.2


# ---- airay ---------------------------------------------------------------------------------------

def airay_run(root: Path, fault: str, steps: int, fault_steps: list[int], local: LocalCluster,
              ckpt_every: int = CKPT_EVERY) -> dict:
    kind = {"worker": "kill_worker", "node": "remove_node"}[fault]
    run = root / f"airay-{fault}-{time.time_ns()}"
    cfg = JobConfig.from_dict({
        "name": run.name, "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": MODEL_KWARGS},
        "loss_fn": "airay.models.tiny_gpt:loss", "deepspeed": DEEPSPEED,
        "global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH, "max_steps": steps,
        "scaling": {"min_workers": 2, "max_workers": 4}, "checkpoint": {"every_n_steps": ckpt_every},
        "max_failures": len(fault_steps) + 1,
        "chaos": [{"fault": kind, "at_step": f, "rank": FAULT_RANK[fault]} for f in fault_steps],
        "run_dir": str(run)})
    result = fit(cfg, echo=False, local_cluster=local)
    assert result.status == "finished", result.error
    ev = read_jsonl(run / "events.jsonl")
    struck = [e["ts"] for e in ev if e["type"] == "fault_injected"]
    shrinks = [e for e in ev if e["type"] == "resize_finished" and e["reason"] == "failure"]
    assert len(struck) == len(shrinks) == len(fault_steps), (struck, shrinks)
    return {"recovery_s": [e["ts"] - t for e, t in zip(shrinks, struck)],
            "steps_redone": sum(f - e["resumed_step"] for f, e in zip(fault_steps, shrinks)),
            "wall_s": result.wall_s, "final_loss": result.final_loss,
            "goodput": goodput.of_run(run).goodput, "lost_s": goodput.of_run(run).lost_s, "measured": measured_costs(ev, read_jsonl(run / "metrics.jsonl"))}


def measured_costs(events: list[dict], metrics: list[dict]) -> dict:
    """What the goodput simulator needs to replay this run: its costs as measured here, and when
    the faults struck (seconds after the first world formed: the simulator has no startup)."""
    formed = next(e["ts"] for e in events if e["type"] == "world_formed")
    end = next(e["ts"] for e in events if e["type"] in ("run_finished", "run_failed"))
    struck = [e["ts"] for e in events if e["type"] == "fault_injected"]
    ready = [e["ts"] for e in events if e["type"] == "worker_ready" and e["ts"] > formed]
    full = max(m["world_size"] for m in metrics)
    return {"window_s": end - formed, "startup_s": formed - events[0]["ts"], "full_world": full,
            "step_s": statistics.median(m["step_time_s"] for m in metrics if m["world_size"] == full),
            # What a save held the step loop (the memory-tier event of each save carries it).
            "blocking_s": statistics.median(e["held_s"] for e in events
                                            if e["type"] == "checkpoint_saved" and e["tier"] == "memory"),
            "recovery_s": statistics.median(e["recovery_s"] for e in events
                                            if e["type"] == "resize_finished" and e["reason"] == "failure"),
            # None when no replacement came (a node loss with no spare node)
            "replacement_s": statistics.median(waits) if (waits := [
                min(r for r in ready if r > t) - t for t in struck if any(r > t for r in ready)]) else None,
            "fault_offsets_s": [t - formed for t in struck], "kept_steps": len({m["step"] for m in metrics})}


# ---- Ray Train -------------------------------------------------------------------------------------

def convert_to_universal(path: Path) -> None:
    """DeepSpeed's universal checkpoint of `path/native` in `path/universal`: how a Ray Train user
    loads ZeRO partitions at another world size (in one process, as ds_to_universal runs)."""
    import contextlib
    import io
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(input_folder=str(path / "native"), output_folder=str(path / "universal"), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def ray_train_loop(config: dict) -> None:
    """One Ray Train worker: DeepSpeed on the process group Ray Train made, resumed from its checkpoint."""
    import ray.train
    import torch
    import torch.distributed as tdist

    from airay.data.source import SyntheticSource
    from airay.models.tiny_gpt import build, loss, synthetic_sample
    from airay.policy import plan_batch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    plan = plan_batch(GLOBAL_BATCH, MICRO_BATCH, world)
    join_world(rank, world, None)   # the process group Ray Train made

    start, load_dir, tag = 0, None, None
    ckpt = ray.train.get_checkpoint()
    with (Path(config["progress_dir"]) / "starts.jsonl").open("a") as f:
        f.write(json.dumps({"ts": time.time(), "rank": rank, "world": world,
                            "checkpoint": ckpt.path if ckpt else None}) + "\n")
    ckpt_ctx = ckpt.as_directory() if ckpt else None
    if ckpt_ctx is not None:
        load_dir = Path(ckpt_ctx.__enter__())
        meta = json.loads((load_dir / "meta.json").read_text())
        start, tag = meta["step"], "native"
        if meta["world_size"] != world:
            # ZeRO partitions are per rank: a new world size needs DeepSpeed's universal format.
            if rank == 0 and not (load_dir / "universal").exists():
                convert_to_universal(load_dir)
            tdist.barrier()
            tag = "universal"
    engine = plain_engine(build(seed=0, **MODEL_KWARGS), DEEPSPEED, plan, rank=rank, world=world, port=None,
                          load_universal=tag == "universal")
    if load_dir is not None:
        engine.load_checkpoint(str(load_dir), tag=tag)
        ckpt_ctx.__exit__(None, None, None)
    data = SyntheticSource(synthetic_sample, 0, {})
    progress = Path(config["progress_dir"]) / f"rank{rank}.jsonl"
    node = ray.get_runtime_context().get_node_id()
    deadline = config.get("deadline")  # a run measured over a fixed window (benchmarks/goodput.py)
    loss_sum = 0.0  # a restart past the deadline runs no step
    for step in range(start, config["steps"]):
        if deadline is not None:  # every rank stops at the same step: they agree through a collective
            late = torch.tensor([1.0 if time.time() > deadline else 0.0])
            tdist.all_reduce(late, op=tdist.ReduceOp.MAX)
            if late.item():
                break
        t_step = time.time()
        loss_sum = train_step(engine, loss, data, step, rank, plan)
        row = {"ts": time.time(), "step": step, "pid": os.getpid(), "node": node, "world": world,
               "step_time_s": time.time() - t_step}
        if (step + 1) % config["ckpt_every"] == 0 or step + 1 == config["steps"]:
            t_ckpt = time.time()
            with tempfile.TemporaryDirectory() as tmp:
                engine.save_checkpoint(tmp, tag="native", save_latest=False)
                if rank == 0:
                    (Path(tmp) / "meta.json").write_text(json.dumps({"step": step + 1, "world_size": world}))
                ray.train.report({"step": step + 1},
                                 checkpoint=ray.train.Checkpoint.from_directory(tmp))
            row["ckpt_s"] = time.time() - t_ckpt  # what the save held the step loop (save + report)
        with progress.open("a") as f:
            f.write(json.dumps(row) + "\n")
    # Every rank's loss sum -> the global mean, as airay records it.
    total = torch.tensor([loss_sum])
    tdist.all_reduce(total)
    if rank == 0:
        (Path(config["progress_dir"]) / "final.json").write_text(json.dumps({"loss": float(total) / GLOBAL_BATCH}))


def read_progress(progress_dir: Path) -> list[dict]:
    rows = []
    for p in progress_dir.glob("rank*.jsonl"):
        # The last line may be half written (a rank appends while this reads): only whole lines.
        lines = p.read_text().split("\n")[:-1]
        rows += [dict(json.loads(line), rank=int(p.stem[4:])) for line in lines if line]
    return sorted(rows, key=lambda r: r["ts"])


def inject_when_ready(progress_dir: Path, fault: str, fault_steps: list[int], local: LocalCluster,
                      strikes: list, stop: threading.Event) -> None:
    """Driver thread: strike at each fault step, once the fault rank has finished the step before."""
    rank = FAULT_RANK[fault]
    for fault_step in fault_steps:
        since = strikes[-1]["ts"] if strikes else 0.0
        while not stop.is_set():
            done = [r for r in read_progress(progress_dir)
                    if r["rank"] == rank and r["step"] == fault_step - 1 and r["ts"] > since]
            if done:
                strikes.append({"ts": time.time(), "step": fault_step,
                                "pids_before": {r["pid"] for r in read_progress(progress_dir)}})
                if fault == "worker":
                    os.kill(done[0]["pid"], signal.SIGKILL)
                else:
                    local.remove_node(done[0]["node"])
                break
            time.sleep(0.005)


def ray_train_run(root: Path, fault: str, steps: int, fault_steps: list[int], local: LocalCluster,
                  ckpt_every: int = CKPT_EVERY) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Best settings: Ray Train polls its workers every 2 s by default; polling every 0.2 s detects
    # the fault sooner and registers a just-reported checkpoint before a failure can drop it.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(HEALTH_CHECK_INTERVAL_S)
    name = f"raytrain-{fault}-{time.time_ns()}"
    progress = root / name / "progress"
    progress.mkdir(parents=True)
    strikes: list[dict] = []
    stop = threading.Event()
    watcher = threading.Thread(target=inject_when_ready, args=(progress, fault, fault_steps, local, strikes, stop),
                               daemon=True)
    trainer = TorchTrainer(
        ray_train_loop, train_loop_config={"steps": steps, "progress_dir": str(progress), "ckpt_every": ckpt_every},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=(2, 4), use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=str(root / "storage"),
                             failure_config=FailureConfig(max_failures=len(fault_steps) + 1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    watcher.start()
    t0 = time.time()
    try:
        trainer.fit()
    finally:
        stop.set()
    wall = time.time() - t0
    assert len(strikes) == len(fault_steps), f"only {len(strikes)} of {len(fault_steps)} faults fired"
    rows = read_progress(progress)
    recovery, redone = [], 0
    for strike in strikes:
        first = next(r for r in rows if r["ts"] > strike["ts"] and r["pid"] not in strike["pids_before"])
        recovery.append(first["ts"] - strike["ts"])
        redone += strike["step"] - first["step"]
    final = json.loads((progress / "final.json").read_text())
    return {"recovery_s": recovery, "steps_redone": redone, "wall_s": wall, "final_loss": final["loss"],
            # airay.goodput's definition: kept step time over the wall time from the start of training
            # (fit(); the cluster was started before, as for airay's runs here).
            "goodput": goodput.kept_step_s([r for r in rows if r["rank"] == 0]) / wall}


# ---- the comparison ----------------------------------------------------------------------------------

def compare(fault: str, steps: int, fault_steps: list[int], repeats: int, root: Path,
            ckpt_every: int = CKPT_EVERY) -> dict[str, list[dict]]:
    """Run both sides `repeats` times, alternating, each on a fresh 4-node cluster (a node loss
    leaves 3 nodes behind)."""
    runs: dict[str, list[dict]] = {"airay": [], "ray_train": []}
    for _ in range(repeats):
        for side, run in (("airay", airay_run), ("ray_train", ray_train_run)):
            local = LocalCluster(LocalClusterSpec(local_nodes=4, cpus_per_node=1))
            ray.init(address=local.address, logging_level="ERROR", log_to_driver=False)
            try:
                runs[side].append(run(root, fault, steps, fault_steps, local, ckpt_every))
            finally:
                ray.shutdown()
                local.shutdown()
    return runs


def schedule_fault_steps(steps: int, every: int, ckpt_every: int) -> list[int]:
    """A fault every `every` steps, each half-way between two checkpoints: the expected loss of a
    fault that is not correlated with the checkpoints (one at a boundary would cost nothing or a
    whole interval)."""
    return list(range(every + ckpt_every // 2, steps, every))


def median_of(runs: list[dict], key: str) -> tuple[float, float, float]:
    values = [r[key][0] if isinstance(r[key], list) else r[key] for r in runs]
    return statistics.median(values), min(values), max(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", default="worker,node",
                        help="single-fault recovery runs: worker, node (none: only the goodput run)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault-step", type=int, default=12)
    parser.add_argument("--schedule-steps", type=int, default=0,
                        help="also a goodput run of this many steps with a worker killed every --every steps")
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--schedule-repeats", type=int, default=1, help="repeats of the (long) goodput run")
    parser.add_argument("--schedule-ckpt-every", type=int, default=CKPT_EVERY,
                        help="checkpoint interval (steps) of the goodput run, on both sides")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    faults = [f for f in args.faults.split(",") if f and f != "none"]
    bad = [f for f in faults if f not in FAULT_RANK]
    if bad or not 0 < args.fault_step < args.steps:
        parser.error(f"--faults takes {sorted(FAULT_RANK)}; --fault-step must lie in (0, --steps)")

    out: dict = {"args": vars(args), "recovery": {}, "schedule": None, "model_kwargs": MODEL_KWARGS}
    with tempfile.TemporaryDirectory() as tmp:
        for fault in faults:
            out["recovery"][fault] = compare(fault, args.steps, [args.fault_step], args.repeats, Path(tmp))
        if args.schedule_steps:
            schedule = schedule_fault_steps(args.schedule_steps, args.every, args.schedule_ckpt_every)
            out["schedule"] = {"fault_steps": schedule,
                               "runs": compare("worker", args.schedule_steps, schedule, args.schedule_repeats, Path(tmp),
                                               args.schedule_ckpt_every)}

    if faults:
        print(f"recovery: {args.steps} steps, fault at step {args.fault_step}, checkpoint every {CKPT_EVERY}; "
              f"4 workers on a 4-node local cluster; median of {args.repeats} (min-max)")
        print(f"{'fault':<7} {'side':<10} {'recovery_s':>22} {'steps_redone':>12} {'wall_s':>20} {'final loss':>12}")
    out["median"] = {}
    for fault, sides in out["recovery"].items():
        med = out["median"][fault] = {}
        for side, runs in sides.items():
            med[side] = {k: median_of(runs, k) for k in ("recovery_s", "steps_redone", "wall_s", "final_loss")}
            rec, red, wall, loss = (med[side][k] for k in ("recovery_s", "steps_redone", "wall_s", "final_loss"))
            print(f"{fault:<7} {side:<10} {rec[0]:>8.2f} ({rec[1]:.2f}-{rec[2]:.2f}) {red[0]:>12.0f} "
                  f"{wall[0]:>7.1f} ({wall[1]:.1f}-{wall[2]:.1f}) {loss[0]:>12.6f}")
        a, b = med["airay"], med["ray_train"]
        print(f"{fault:<7} Ray Train / airay: recovery {b['recovery_s'][0] / a['recovery_s'][0]:.1f}x, "
              f"wall {b['wall_s'][0] / a['wall_s'][0]:.2f}x")
    if out["schedule"]:
        sched = out["schedule"]
        print(f"goodput: {args.schedule_steps} steps, checkpoint every {args.schedule_ckpt_every}, a worker "
              f"killed at steps {sched['fault_steps']}; "
              f"goodput = time of kept steps / wall; median of {args.schedule_repeats} (min-max)")
        gp = out["median"]["schedule"] = {}
        for side, runs in sched["runs"].items():
            gp[side] = {k: median_of(runs, k) for k in ("goodput", "wall_s", "steps_redone")}
            g, w, r = gp[side]["goodput"], gp[side]["wall_s"], gp[side]["steps_redone"]
            print(f"  {side:<10} goodput {g[0]:.3f} ({g[1]:.3f}-{g[2]:.3f})  wall {w[0]:.1f} s  steps redone {r[0]:.0f}")
            if side == "airay":
                lost = {c: statistics.median(r["lost_s"][c] for r in runs) for c in runs[0]["lost_s"]}
                gp[side]["lost_s"] = lost
                print("             lost s (median): " + ", ".join(f"{c} {v:.1f}" for c, v in lost.items()))
                pairs = [(predicted_goodput(r["measured"], args.schedule_ckpt_every), r["goodput"]) for r in runs]
                gp["simulator"] = {"predicted": statistics.median(p for p, _ in pairs),
                                   "measured": statistics.median(m for _, m in pairs)}
                print(f"             simulator replay of this run (same faults, measured costs): goodput "
                      f"{gp['simulator']['predicted']:.3f} predicted vs {gp['simulator']['measured']:.3f} "
                      "measured (airay.goodput's definition: start-up included on both)")
        print(f"  airay / Ray Train goodput: {gp['airay']['goodput'][0] / gp['ray_train']['goodput'][0]:.2f}x; "
              f"target airay >= 0.9 -> {'met' if gp['airay']['goodput'][0] >= 0.9 else 'MISSED'}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

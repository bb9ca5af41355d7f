"""Start-up: from launching a run to its first completed step, airay vs Ray Train, in parts.

Both sides start what a user starts on this machine: a 4-node local Ray cluster (real raylets,
one CPU each, head with no CPUs), 4 workers, the demo job's model and batch (tiny_gpt, ZeRO-2,
AdamW, global batch 24), no sleep in the model (`forward_delay_s` 0: the first step is CPU work).
Each launch is a fresh process, timed from just before it is spawned; the sides alternate.

  airay      `airay run JOB` (max_steps 1, steps_per_round 1). Parts, from the run's events:
             driver     process start -> fit() (Python, imports, the job's checks)
             cluster    the local cluster's start (head + 4 nodes)
             connect    ray.init and the controller, to run_started
             placement  run_started -> the workers' bundles reserved
             actor      bundles reserved -> the slowest worker's __init__ begins (process, Ray, modules)
             imports    -> the slowest worker is ready (torch, DeepSpeed, airay's worker state)
             engine     -> the world is formed (process group, DeepSpeed engine of the world)
             first step -> the first step's record (the step and its round trip)
  Ray Train  a driver script as a Ray Train user writes it: LocalCluster, ray.init, a TorchTrainer
             (Train V2) of 4 workers whose loop builds the same engine with benchmarks.plain and
             runs one step. Parts: driver (imports), cluster, trainer (fit() -> the slowest worker
             enters the loop: controller, worker group, torch process group), engine, first step.
  --baseline REF  also airay at git REF (a worktree), measured from outside only: the "before".
  floor      the CPU one cold worker spends before it can train (a fresh process: import torch,
             DeepSpeed, Ray and airay's worker, build a one-rank engine of the job, one step),
             times 4 workers over this machine's cores: wall time no start-up of 4 fresh worker
             processes can go below here, whoever starts them (Ray's own daemons not counted).
             Measured twice, alternating: DeepSpeed imported as airay's workers import it
             (airay.worker.deepspeed_compat.import_deepspeed) and with a plain `import deepspeed`.

Usage: python benchmarks/startup.py [--repeats 3] [--baseline REF] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airay.events import read_jsonl  # noqa: E402
from benchmarks.plain import plain_job, train_step  # noqa: E402

WORKERS = 4
AIRAY_PARTS = ("driver", "cluster", "connect", "placement", "actor", "imports", "engine", "first_step")
RAY_TRAIN_PARTS = ("driver", "cluster", "trainer", "engine", "first_step")


def job_spec(run_dir: Path) -> dict:
    """The demo job, unpaced, one step, no faults."""
    spec = yaml.safe_load((ROOT / "jobs" / "demo.yaml").read_text())
    spec.pop("chaos", None)
    spec["model"]["kwargs"]["forward_delay_s"] = 0.0
    spec.update(name="startup-bench", max_steps=1, steps_per_round=1, run_dir=str(run_dir))
    spec["cluster"] = {"local_nodes": WORKERS, "cpus_per_node": 1}
    spec["scaling"] = {"min_workers": WORKERS, "max_workers": WORKERS}
    return spec


def airay_parts(run_dir: Path, t_spawn: float) -> dict[str, float]:
    """The parts of one airay start-up from its run directory (they add up to the total)."""
    events, metrics = read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    started = next(e for e in events if e["type"] == "run_started")
    placed = next(e["ts"] for e in events if e["type"] == "workers_placed")
    formed = next(e for e in events if e["type"] == "world_formed")
    timelines = [w["timeline"] for w in formed["workers"]]
    init = max(t["init_ts"] for t in timelines)
    ready = max(t["ready_ts"] for t in timelines)
    marks = {"driver": started["fit_ts"], "cluster": started["fit_ts"] + started["cluster_s"],
             "connect": started["ts"], "placement": placed, "actor": max(init, placed),
             "imports": max(ready, init, placed), "engine": formed["ts"], "first_step": metrics[0]["ts"]}
    out, prev = {}, t_spawn
    for part in AIRAY_PARTS:
        out[part] = max(0.0, marks[part] - prev)
        prev = max(prev, marks[part])
    out["total"] = metrics[0]["ts"] - t_spawn
    return out


def run_airay(tmp: Path, src: Path | None = None) -> dict[str, float]:
    """`airay run` once; `src`: another checkout of airay to run instead (the baseline)."""
    run_dir = tmp / f"airay-{time.time_ns()}"
    spec = tmp / f"job-{time.time_ns()}.yaml"
    spec.write_text(yaml.safe_dump(job_spec(run_dir)))
    env = dict(os.environ)
    cmd = [sys.executable, "-c", "import sys; from airay.cli import main; sys.exit(main())", "run", str(spec)]
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    t_spawn = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=src or ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"airay run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    if src is not None:  # an older airay records no parts
        return {"total": read_jsonl(run_dir / "metrics.jsonl")[0]["ts"] - t_spawn}
    return airay_parts(run_dir, t_spawn)


# ---- Ray Train ---------------------------------------------------------------------------------

def ray_train_loop(config: dict) -> None:
    """One Ray Train worker: the engine of the same model and plan, then one step."""
    t_enter = time.time()
    import ray.train

    from airay.config import JobConfig

    cfg = JobConfig.from_dict(config["spec"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    engine, plan, loss_fn, data = plain_job(cfg, rank=rank, world=world, port=None)
    t_engine = time.time()
    train_step(engine, loss_fn, data, 0, rank, plan)
    t_step = time.time()
    with open(config["out"], "a") as f:
        f.write(json.dumps({"rank": rank, "enter": t_enter, "engine": t_engine, "step": t_step}) + "\n")


def ray_train_child(out: str, spec_path: str) -> None:
    """The Ray Train user's driver script (run as its own process)."""
    import psutil

    t_proc = psutil.Process().create_time()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    import benchmarks.plain
    from airay.config import LocalClusterSpec
    from airay.local_cluster import LocalCluster

    ray.cloudpickle.register_pickle_by_value(benchmarks.plain)
    t_imports = time.time()
    local = LocalCluster(LocalClusterSpec(local_nodes=WORKERS, cpus_per_node=1))
    try:
        ray.init(address=local.address, logging_level="ERROR", log_to_driver=False)
        t_cluster = time.time()
        spec = yaml.safe_load(Path(spec_path).read_text())
        trainer = TorchTrainer(ray_train_loop, train_loop_config={"spec": spec, "out": out + ".ranks"},
                               torch_config=TorchConfig(backend="gloo"),
                               scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False,
                                                            resources_per_worker={"CPU": 1}),
                               run_config=RunConfig(name=f"startup-{time.time_ns()}",
                                                    storage_path=str(Path(out).parent / "storage")))
        trainer.fit()
    finally:
        ray.shutdown()
        local.shutdown()
    Path(out).write_text(json.dumps({"process_start": t_proc, "imports": t_imports, "cluster": t_cluster}))


def run_ray_train(tmp: Path) -> dict[str, float]:
    out = tmp / f"raytrain-{time.time_ns()}.json"
    spec = tmp / f"job-{time.time_ns()}.yaml"
    spec.write_text(yaml.safe_dump(job_spec(tmp / "unused")))
    t_spawn = time.time()
    proc = subprocess.run([sys.executable, __file__, "--ray-train-child", str(out), "--spec", str(spec)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"Ray Train run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    driver = json.loads(out.read_text())
    ranks = read_jsonl(Path(str(out) + ".ranks"))
    marks = {"driver": driver["imports"], "cluster": driver["cluster"], "trainer": max(r["enter"] for r in ranks),
             "engine": max(r["engine"] for r in ranks), "first_step": max(r["step"] for r in ranks)}
    parts, prev = {}, t_spawn
    for part in RAY_TRAIN_PARTS:
        parts[part] = max(0.0, marks[part] - prev)
        prev = max(prev, marks[part])
    parts["total"] = marks["first_step"] - t_spawn
    return parts


# ---- the floor: one cold worker's CPU ------------------------------------------------------------

def cpu_child(spec_path: str, plain_import: bool = False) -> None:
    """A fresh process doing one worker's start-up work; prints its CPU seconds (and its children's).
    `plain_import`: DeepSpeed imported plainly (everywhere: benchmarks.plain's bootstrap included)."""
    import resource

    import ray  # noqa: F401
    import torch  # noqa: F401

    import airay.worker.actor  # noqa: F401
    from airay.worker import deepspeed_compat

    if plain_import:
        def plain():
            import deepspeed

            return deepspeed

        deepspeed_compat.import_deepspeed = plain
    deepspeed_compat.import_deepspeed()  # as a worker does
    from airay.config import JobConfig
    from airay.worker.dist import free_port

    cfg = JobConfig.from_dict(yaml.safe_load(Path(spec_path).read_text()))
    engine, plan, loss_fn, data = plain_job(cfg, rank=0, world=1, port=free_port())
    train_step(engine, loss_fn, data, 0, 0, plan)
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print(json.dumps({"cpu_s": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime}))


def worker_cpu(tmp: Path, plain_import: bool = False) -> float:
    spec = tmp / f"job-{time.time_ns()}.yaml"
    spec.write_text(yaml.safe_dump(job_spec(tmp / "unused")))
    proc = subprocess.run([sys.executable, __file__, "--cpu-child", str(spec)] + ["--plain-import"] * plain_import,
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"the cold-worker process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["cpu_s"]


# ---- the comparison --------------------------------------------------------------------------------

def worktree(ref: str, tmp: Path) -> Path:
    path = tmp / "baseline-src"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), ref], cwd=ROOT, check=True, capture_output=True)
    return path


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline", metavar="REF", help="also airay at this git ref (the start-up before a change)")
    p.add_argument("--no-ray-train", action="store_true")
    p.add_argument("--json")
    p.add_argument("--ray-train-child", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--cpu-child", help=argparse.SUPPRESS)
    p.add_argument("--plain-import", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ray_train_child:
        ray_train_child(args.ray_train_child, args.spec)
        return {}
    if args.cpu_child:
        cpu_child(args.cpu_child, args.plain_import)
        return {}

    runs: dict[str, list[dict[str, float]]] = {"airay": [], "ray_train": [], "baseline": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        src = worktree(args.baseline, tmp) if args.baseline else None
        try:
            for i in range(args.repeats):
                runs["airay"].append(run_airay(tmp))
                if not args.no_ray_train:
                    runs["ray_train"].append(run_ray_train(tmp))
                if src is not None:
                    runs["baseline"].append(run_airay(tmp, src))
                print(f"repeat {i}: " + ", ".join(f"{side} {r[-1]['total']:.1f} s" for side, r in runs.items() if r),
                      flush=True)
            cpu, cpu_plain = [], []
            for _ in range(args.repeats):  # alternating
                cpu.append(worker_cpu(tmp))
                cpu_plain.append(worker_cpu(tmp, plain_import=True))
        finally:
            if src is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(src)], cwd=ROOT, capture_output=True)
    med = {side: medians(r) for side, r in runs.items() if r}
    print(f"start-up: launch -> first completed step, {WORKERS} workers on a {WORKERS}-node local cluster, "
          f"unpaced demo model; median of {args.repeats}")
    for side, parts in (("airay", AIRAY_PARTS), ("ray_train", RAY_TRAIN_PARTS)):
        if side in med:
            print(f"  {side:<10} {med[side]['total']:6.1f} s   " + "  ".join(f"{k} {med[side][k]:.2f}" for k in parts))
    if "baseline" in med:
        print(f"  before ({args.baseline}) {med['baseline']['total']:6.1f} s   "
              f"speed-up {med['baseline']['total'] / med['airay']['total']:.2f}x (target >= 2)")
    if "ray_train" in med:
        print(f"  Ray Train / airay: {med['ray_train']['total'] / med['airay']['total']:.2f}x (target > 1)")
    cores = os.cpu_count() or 1
    floor = {"worker_cpu_s": statistics.median(cpu), "runs": cpu, "workers": WORKERS, "cores": cores,
             "wall_floor_s": WORKERS * statistics.median(cpu) / min(cores, WORKERS),
             "plain_import_worker_cpu_s": statistics.median(cpu_plain), "plain_import_runs": cpu_plain}
    print(f"  floor: one cold worker's imports, first engine and step take {floor['worker_cpu_s']:.2f} CPU-s "
          f"({floor['plain_import_worker_cpu_s']:.2f} with DeepSpeed imported plainly); "
          f"{WORKERS} workers on {cores} cores >= {floor['wall_floor_s']:.1f} s of wall")
    out = {"args": vars(args), "runs": runs, "median": med, "floor": floor}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out

if __name__ == "__main__":
    main()

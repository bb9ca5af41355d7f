"""Three jobs on one real local cluster under the scheduler: shrink-instead-of-evict vs evict-and-requeue.

A local cluster of 2 nodes x 2 CPUs (4 workers). Three `airay run` drivers, each its own process
as users' jobs are, arrive staggered:

- `low-a` (priority 0, 2-4 workers) at 0 s;
- `low-b` (priority 0, 2-4 workers) at `--stagger` s;
- `high` (priority 10, 2 workers) at 2 x `--stagger` s.

Per policy (the scheduler's `evict`: Kueue-like, sizes fixed at admission, whole lower-priority
jobs evicted and requeued; `shrink`: lower-priority elastic jobs shrunk at a step boundary, a whole
job preempted only when shrinking cannot make room, grow-back when capacity frees), on a fresh
cluster each, it reports for every job: the wait from its launch to its first trained step, its
completion time (launch to end), and its lost worker-seconds (worker-seconds it held, from each
placement of its workers to the end or a suspension, less the worker-seconds of the steps it kept:
start-ups and restarts, resizes, suspensions' checkpoints, replayed steps; a grow's new workers
count from when they join, not while they start). Evicted jobs are checkpointed
before they go (airay's scheduler asks for it; Kueue does not): the baseline gets that for free.

The low jobs' steps are paced with a sleep in the model's forward (tiny_gpt's forward_delay_s)
so that they are still training when the others arrive on this 2-core machine; the high job is
not paced. Every job's per-step losses are compared across the policies (they must be equal: a
resize changes no sample). One run per policy by default: a single run each, noisy.

Usage: python benchmarks/sched_cluster.py [--stagger 15] [--low-steps 150] [--high-steps 30]
           [--repeats 1] [--json FILE]
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

import ray  # noqa: E402

from airay.config import JobConfig, LocalClusterSpec  # noqa: E402
from airay.events import committed_losses, read_jsonl  # noqa: E402
from airay.local_cluster import LocalCluster  # noqa: E402
from airay.sched.actor import scheduler  # noqa: E402

POLICIES = ("evict", "shrink")


def job_spec(name: str, run_dir: Path, address: str, priority: int, steps: int, lo: int, hi: int,
             delay: float) -> JobConfig:
    return JobConfig.from_dict({
        "name": name,
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": delay}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2}},
        "global_batch_size": 8, "micro_batch_size": 2, "max_steps": steps, "steps_per_round": 5,
        "scaling": {"min_workers": lo, "max_workers": hi},
        "checkpoint": {"every_n_steps": 50},
        "timeouts": {"capacity_wait_s": 300},
        "queue": {"priority": priority, "team": "prod" if priority else "research"},
        "ray_address": address, "run_dir": str(run_dir)})


def held_and_kept(run_dir: Path, end_ts: float) -> tuple[float, float]:
    """Worker-seconds the job held (from each placement of its workers, as the first world starts
    up or a suspended job restarts, then each world from its forming, to a suspension or the
    end) and worker-seconds of its kept steps."""
    events = read_jsonl(run_dir / "events.jsonl")
    held, world, since = 0.0, 0, None
    for e in events:
        if e["type"] in ("workers_placed", "world_formed", "suspended") and since is not None:
            held += world * (e["ts"] - since)
        if e["type"] in ("workers_placed", "world_formed"):
            world, since = e.get("world_size", e.get("workers")), e["ts"]
        elif e["type"] == "suspended":
            world, since = 0, None
    if since is not None:
        held += world * (end_ts - since)
    kept = {m["step"]: m for m in read_jsonl(run_dir / "metrics.jsonl")}
    return held, sum(m["step_time_s"] * m["world_size"] for m in kept.values())


def measure(run_dir: Path, launched: float) -> dict:
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    end = next(e["ts"] for e in events if e["type"] in ("run_finished", "run_failed"))
    held, kept = held_and_kept(run_dir, end)
    admitted = next((e["ts"] for e in events if e["type"] == "queue_target" and e["target"] > 0), None)
    return {"status": next(e["type"] for e in events if e["type"] in ("run_finished", "run_failed")),
            "queue_wait_s": admitted - launched if admitted else None,
            "first_step_s": metrics[0]["ts"] - launched, "completion_s": end - launched,
            "lost_worker_s": held - kept, "held_worker_s": held, "kept_worker_s": kept,
            "world_sizes": [e["world_size"] for e in events if e["type"] == "world_formed"],
            "resizes": sum(1 for e in events if e["type"] == "resize_started"),
            "suspensions": sum(1 for e in events if e["type"] == "suspended")}


def run_policy(policy: str, args, tmp: Path) -> dict:
    lc = LocalCluster(LocalClusterSpec(local_nodes=2, cpus_per_node=2))
    procs = {}
    try:
        ray.init(address=lc.address, logging_level="ERROR", log_to_driver=False)
        ray.get(scheduler().configure.remote({}, policy), timeout=120)
        jobs = [("low-a", 0, args.low_steps, 2, 4, args.delay, 0.0),
                ("low-b", 0, args.low_steps, 2, 4, args.delay, args.stagger),
                ("high", 10, args.high_steps, 2, 2, 0.0, 2 * args.stagger)]
        t0 = time.time()
        launched = {}
        for name, prio, steps, lo, hi, delay, at in jobs:
            time.sleep(max(0.0, t0 + at - time.time()))
            cfg = job_spec(name, tmp / policy / name, lc.address, prio, steps, lo, hi, delay)
            spec = tmp / policy / f"{name}.yaml"
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(cfg.to_yaml())
            launched[name] = time.time()
            procs[name] = subprocess.Popen([sys.executable, "-m", "airay.cli", "run", str(spec)],
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = {}
        for name, proc in procs.items():
            text, _ = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{policy}/{name} failed:\n{text[-3000:]}")
            out[name] = measure(tmp / policy / name, launched[name])
            print(f"[sched_cluster] {policy} {name}: {json.dumps({k: out[name][k] for k in ('first_step_s', 'completion_s', 'lost_worker_s', 'world_sizes')})}",
                  flush=True)
        return out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
        ray.shutdown()
        lc.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stagger", type=float, default=15.0, help="seconds between the arrivals")
    ap.add_argument("--low-steps", type=int, default=150)
    ap.add_argument("--high-steps", type=int, default=30)
    ap.add_argument("--delay", type=float, default=0.1, help="the low jobs' sleep per forward (pacing)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    runs = {p: [] for p in POLICIES}
    losses: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for policy in POLICIES:
                runs[policy].append(run_policy(policy, args, Path(tmp)))
                losses[policy] = {name: committed_losses(Path(tmp) / policy / name) for name in runs[policy][-1]}
    names = list(runs["evict"][0])
    median = {p: {n: {k: statistics.median(r[n][k] for r in runs[p]) for k in
                      ("first_step_s", "completion_s", "lost_worker_s")} for n in names} for p in POLICIES}
    diff = max(abs(losses["shrink"][n][s] - losses["evict"][n][s]) / abs(losses["evict"][n][s])
               for n in names for s in losses["evict"][n])
    result = {"args": vars(args), "runs": runs, "median": median, "max_loss_rel_diff": diff,
              "high_first_step_ratio": median["shrink"]["high"]["first_step_s"] / median["evict"]["high"]["first_step_s"],
              "low_lost_worker_s": {p: sum(median[p][n]["lost_worker_s"] for n in names if n != "high")
                                    for p in POLICIES},
              "mean_completion_s": {p: statistics.fmean(median[p][n]["completion_s"] for n in names)
                                    for p in POLICIES}}
    for p in POLICIES:
        print(f"{p:>7}: " + "; ".join(f"{n} first step {median[p][n]['first_step_s']:.1f}s, done {median[p][n]['completion_s']:.1f}s, "
                                       f"lost {median[p][n]['lost_worker_s']:.1f} worker-s" for n in names))
    print(f"high job's first step, shrink/evict: {result['high_first_step_ratio']:.3f}; low jobs' lost worker-s "
          f"{result['low_lost_worker_s']}; mean completion {result['mean_completion_s']}; losses agree within {diff:.1e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

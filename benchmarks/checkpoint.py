"""Checkpoint cost at model sizes up to ~100M parameters: what a save holds the step loop, what it
costs in memory where, and how fast a new world reloads it.

Per ZeRO stage (2 and 3) and model size (the tiny GPT at d_model 256, 512 and 1024, 8 layers;
6.5M, 25M and 100M parameters), one airay run on a local cluster of 4 one-CPU nodes and a driver
node (the head, 0 CPUs), and the same job without the fault: 4 workers, AdamW, a memory-tier save every 2 steps, a durable one every 4 (to
local disk), a worker killed at step 7 (the world shrinks to 3 and reloads step 6, resharded) and
its replacement grows the world back to 4 (resharded again). Reported per size:

  bytes              the checkpoint (model and optimizer state, all ranks' files)
  driver-node RSS    peak RSS of the driver process and of every Ray process on the driver's node
                     (GCS, raylet and its workers: none trains there), sampled every 0.2 s
  worker RSS         peak RSS of each training worker over the run, against its footprint
                     before the first save (training without checkpoints); the worst ratio
  held per save      blocking_s + previous_commit_wait_s + the next step's checkpoint_wait_s
                     (`held_s` of checkpoint_saved), median, against DeepSpeed's synchronous
                     save_checkpoint of the same state (same model, ZeRO-2, 4 gloo processes,
                     no Ray) to a local directory, timed on the slowest rank
  commit to memory   from the save to every rank's files written in its node's memory (slowest
                     rank), and the shard bytes per second that commits, aggregated over the
                     ranks; then each node's files are copied to the next node in the background
                     (peer copy, reported apart)
  reshard reload     checkpoint_loaded.load_s of the shrink (4 -> 3), from the memory tier
  read / needed      of every resharded load, the worst rank's bytes read over the bytes its
                     reshard used (checkpoint_loaded.read_vs_needed: chunks, airay.checkpoint.ranges)
  recovery_s         detection of the kill to the first step at the new size
  loss difference    the worst relative difference between the faulty run's loss and the
                     fault-free run's, at every step
  build              a rank's peak RSS while the regrown world of 4 built its model, then its
                     engine (world_formed's build_rss; warm processes, whose imports are done),
                     over the model's fp32 bytes

Every step is CPU work (no forward_delay_s sleep). Usage:
  python benchmarks/checkpoint.py [--sizes 256,512,1024] [--stages 2,3] [--json OUT] [--reduced]
  --reduced: d_model 64, ZeRO-3 only (what the suite's reduced run uses)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sampler import Sampler  # noqa: E402

WORKERS, LAYERS, SEQ = 4, 8, 32
SAVE_EVERY = 2  # checkpoint.fast_every_n_steps: a save to node memory every 2 steps


def deepspeed_config(stage: int) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}


def model_kwargs(d_model: int) -> dict:
    return {"d_model": d_model, "n_layers": LAYERS, "n_heads": 8, "seq_len": SEQ}


def job(run_dir: Path, d_model: int, work: Path, stage: int = 2, kill: bool = True) -> dict:
    return {"name": f"ckpt-bench-{d_model}-z{stage}", "model": {"factory": "airay.models.tiny_gpt:build",
                                                               "kwargs": model_kwargs(d_model)},
            "loss_fn": "airay.models.tiny_gpt:loss", "deepspeed": deepspeed_config(stage),
            "data": {"kwargs": {"seq_len": SEQ}},
            "global_batch_size": 4, "micro_batch_size": 1, "max_steps": 16, "steps_per_round": 2,
            "scaling": {"min_workers": 3, "max_workers": WORKERS},
            "checkpoint": {"path": str(work / "durable"), "every_n_steps": 4, "fast_every_n_steps": SAVE_EVERY,
                           "keep_last": 2, "memory_path": str(work / "memory")},
            "chaos": [{"fault": "kill_worker", "at_step": 7, "rank": 1}] if kill else [],
            "timeouts": {"capacity_wait_s": 300}, "run_dir": str(run_dir)}


class RssSampler(Sampler):
    """Peak RSS of processes, sampled in a thread: the driver and the driver node's Ray processes
    (by pid, found anew each sample), and the training workers (by pid, once known)."""

    period_s = 0.2

    def __init__(self, driver_node_pids, worker_pids):
        super().__init__()
        self.driver_node_pids, self.worker_pids = driver_node_pids, worker_pids
        self.driver_node: dict[int, int] = {}
        self.workers: dict[int, list[tuple[float, int]]] = {}
        # Each worker's peak of its own (anonymous) memory: RSS less its mapped files' resident
        # pages (RssFile + RssShmem; a checkpoint a load maps is page cache, counted once a node).
        self.workers_anon: dict[int, int] = {}

    def sample(self):
        import psutil

        now = time.time()
        for pid in self.driver_node_pids():
            try:
                self.driver_node[pid] = max(self.driver_node.get(pid, 0), psutil.Process(pid).memory_info().rss)
            except psutil.Error:
                pass
        for pid in self.worker_pids():
            try:
                mem = psutil.Process(pid).memory_info()
                self.workers.setdefault(pid, []).append((now, mem.rss))
                self.workers_anon[pid] = max(self.workers_anon.get(pid, 0), mem.rss - mem.shared)
            except psutil.Error:
                pass


def worker_pids(run_dir: Path) -> list[int]:
    """The pids of every training worker of a run so far (its world_formed events)."""
    from airay.events import read_jsonl

    events = run_dir / "events.jsonl"
    if not events.exists():
        return []
    return sorted({w["pid"] for e in read_jsonl(events) if e["type"] == "world_formed" for w in e["workers"]})


def airay_run(d_model: int, work: Path, stage: int = 2, kill: bool = True) -> dict:
    import psutil
    import ray

    from airay import JobConfig, fit
    from airay.config import LocalClusterSpec
    from airay.events import read_jsonl
    from airay.local_cluster import LocalCluster

    run = work / "run"
    lc = LocalCluster(LocalClusterSpec(local_nodes=WORKERS, cpus_per_node=1, object_store_memory=256 * 1024**2))
    ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)
    head = lc.cluster.head_node
    head_raylet = psutil.Process(head.all_processes["raylet"][0].process.pid)
    gcs = [info.process.pid for info in head.all_processes.get("gcs_server", [])]

    def driver_node_pids():
        try:
            return [os.getpid(), *gcs, head_raylet.pid, *(c.pid for c in head_raylet.children(recursive=True))]
        except psutil.Error:
            return [os.getpid(), *gcs]

    try:
        with RssSampler(driver_node_pids, lambda: worker_pids(run)) as rss:
            result = fit(JobConfig.from_dict(job(run, d_model, work, stage, kill)), echo=False)
    finally:
        ray.shutdown()
        lc.shutdown()
    assert result.status == "finished", result.error
    from airay.events import committed_losses

    losses = committed_losses(run)
    if not kill:
        return {"losses": losses}
    events = read_jsonl(run / "events.jsonl")
    saves = [e for e in events if e["type"] == "checkpoint_saved" and e["tier"] == "memory"]
    first_save = min(e["ts"] - e["total_s"] for e in saves)
    ratios = []
    for samples in rss.workers.values():
        before = [r for t, r in samples if t < first_save]
        if before:
            ratios.append(max(r for _, r in samples) / max(before))
    loaded = [e for e in events if e["type"] == "checkpoint_loaded" and e["resharded"]]
    shrink = next(e for e in events if e["type"] == "resize_finished" and e["reason"] == "failure")
    commit = [e["write_s"] for e in saves]  # every rank's files written: the step can be committed
    copies = [e["copy_s"] for e in events if e["type"] == "checkpoint_copied"]
    return {
        "bytes": saves[-1]["bytes"], "saves": len(saves),
        "driver_node_peak_rss": sum(rss.driver_node.values()), "driver_peak_rss": rss.driver_node.get(os.getpid(), 0),
        "driver_node_processes": len(rss.driver_node),
        "worker_peak_rss": max(max(r for _, r in s) for s in rss.workers.values()),
        "worker_rss_vs_footprint": max(ratios) if ratios else None,
        "held_s": [e["held_s"] for e in saves], "commit_s": commit, "copy_s": copies,
        # What held the loop, part by part (medians): the save call on every rank, the wait for
        # the previous save's commit, the next optimizer step's wait for live-tensor writes.
        "held_parts": {k: statistics.median(e.get(k, 0.0) for e in saves)
                       for k in ("blocking_s", "plan_s", "rank_save_s", "previous_commit_wait_s", "checkpoint_wait_s")},
        "commit_gb_per_s": statistics.median(e["bytes"] / c / 1e9 for e, c in zip(saves, commit)),
        "reshard_load_s": [e["load_s"] for e in loaded], "reshard_copies": [e["copies"] for e in loaded],
        "recovery_s": shrink["recovery_s"], "world_sizes": result.world_sizes, "losses": losses,
        # Where the recovery's seconds went (the controller's parts: drain, the wait for the save
        # in flight, re-forming the world, the reload, and the workers' own timings).
        "recovery_parts": {k: v for k, v in shrink.items() if k.endswith("_s") and k != "recovery_s"},
        # The new world's first step against a steady step of the first world (its first step left
        # out: imports, allocation), as the workers timed them: what a step itself costs here.
        **step_times(read_jsonl(run / "metrics.jsonl"), shrink["ts"] - shrink["recovery_s"], SAVE_EVERY),
        # The worst rank of any resharded load: bytes it read over the bytes its reshard used.
        "read_vs_needed": max(e["read_vs_needed"] for e in loaded),
        # Peak RSS of the ranks of the regrown world of 4 (warm processes: the first world's builds
        # also pay the process's first imports) while building the model, then the engine.
        "build_rss": [w.get("build_rss") for w in [e for e in events if e["type"] == "world_formed"
                                                   and e["world_size"] == WORKERS][-1]["workers"]],
    }


def step_times(metrics: list[dict], recovery_t0: float, save_every: int) -> dict:
    """Step times of the first world before the failure (its first step left out), as the
    workers timed them: `step_s`, the median of steps that began with no save in flight;
    `step_after_save_s`, of steps that began just after a save (the save's writes, peer copies
    and uploads run beside them); `first_step_s`: the first step after the failure."""
    before = [m for m in metrics if m["ts"] < recovery_t0 and m["world_size"] == WORKERS and m["step"] > 0]
    after = [m["step_time_s"] for m in metrics if m["ts"] > recovery_t0]
    clean = [m["step_time_s"] for m in before if m["step"] % save_every]
    behind_save = [m["step_time_s"] for m in before if not m["step"] % save_every]
    return {"step_s": statistics.median(clean) if clean else None,
            "step_after_save_s": statistics.median(behind_save) if behind_save else None,
            "first_step_s": after[0] if after else None}


def _sync_rank(rank: int, world: int, port: int, d_model: int, stage: int, out: str, results) -> None:
    import deepspeed.comm as dist
    import torch

    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.engine import backward_micro_batch
    from benchmarks.plain import plain_engine

    plan = plan_batch(4, 1, world)
    engine = plain_engine(tiny_gpt.build(seed=0, **model_kwargs(d_model)), deepspeed_config(stage), plan, rank=rank,
                          world=world,
                          port=port)
    batch = {"tokens": torch.randint(0, 256, (1, SEQ + 1))}
    backward_micro_batch(engine, tiny_gpt.loss(engine, batch), 1, plan)  # the optimizer state exists
    times = []
    for i in range(2):
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(f"{out}/sync{i}", tag="native", save_latest=False)
        times.append(time.perf_counter() - t0)
    results[rank] = times


def synchronous_save_s(d_model: int, work: Path, stage: int = 2) -> float:
    """DeepSpeed's own synchronous save of the same state (same ZeRO stage, 4 ranks) to a local
    directory: the slowest rank's time, the better of two saves."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_sync_rank, args=(WORKERS, port, d_model, stage, str(work / "sync"), results), nprocs=WORKERS)
    return min(max(results[r][i] for r in range(WORKERS)) for i in range(2))


def _num(v: float | None) -> str:
    """A ratio, or "-" where the run had none (no worker was sampled before its first save: a
    short run whose first save comes within the sampler's first interval)."""
    return "-" if v is None else f"{v:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512,1024", help="d_model of each size")
    ap.add_argument("--stages", default="2,3", help="ZeRO stages to run at each size")
    ap.add_argument("--reduced", action="store_true", help="d_model 64 only, ZeRO-3 only")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    sizes = [64] if args.reduced else [int(s) for s in args.sizes.split(",")]
    stages = [3] if args.reduced else [int(s) for s in args.stages.split(",")]
    med = statistics.median
    rows = []
    for stage in stages:
        for d_model in sizes:
            rows.append(measure(d_model, stage, med))
    out = {"sizes": rows, "workers": WORKERS}
    for stage in stages:
        at = [r for r in rows if r["stage"] == stage]
        out[f"zero{stage}"] = {
            "driver_node_rss_growth": max(r["driver_node_peak_rss"] for r in at) / min(r["driver_node_peak_rss"] for r in at),
            "worst_worker_rss_vs_footprint": max((r["worker_rss_vs_footprint"] for r in at
                                                  if r["worker_rss_vs_footprint"] is not None), default=None),
            "min_commit_gb_per_s": min(r["commit_gb_per_s"] for r in at), "largest_recovery_s": at[-1]["recovery_s"],
            "worst_held_vs_sync": max(r["held_vs_sync"] for r in at),
            "worst_loss_rel_diff": max(r["loss_rel_diff"] for r in at),
            "worst_read_vs_needed": max(r["read_vs_needed"] for r in at)}
        t = out[f"zero{stage}"]
        print(f"ZeRO-{stage}: driver-node peak RSS, largest / smallest size: x{t['driver_node_rss_growth']:.2f} "
              f"(target <= 1.5); worker peak RSS / footprint, worst: x{_num(t['worst_worker_rss_vs_footprint'])} "
              f"(target <= 1.5); commit to memory, slowest size: {t['min_commit_gb_per_s']:.2f} GB/s (target >= 1); "
              f"recovery_s at the largest size: {t['largest_recovery_s']:.2f} s (target < 10); held per save / "
              f"DeepSpeed sync save, worst size: {t['worst_held_vs_sync']:.3f} (target <= 0.10); loss after the "
              f"resharded reloads, worst relative difference: {t['worst_loss_rel_diff']:.1e} (target < 1e-5); bytes "
              f"read / needed, worst rank: {t['worst_read_vs_needed']:.2f} (target <= 1.2)")
    if 3 in stages:
        out["zero3_build_model_vs_bytes"] = max(r["build_model_vs_bytes"] for r in rows if r["stage"] == 3)
        print(f"ZeRO-3 build: a rank's peak RSS while building its model / the model's bytes, worst: "
              f"{out['zero3_build_model_vs_bytes']:.2f} (target <= 0.5)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def measure(d_model: int, stage: int, med) -> dict:
    """One row: the faulty run, its fault-free twin and DeepSpeed's synchronous save, at one size and stage."""
    import torch

    from airay.models import tiny_gpt

    with tempfile.TemporaryDirectory() as disk:
        sync = synchronous_save_s(d_model, Path(disk), stage)
    with tempfile.TemporaryDirectory() as disk:
        r = airay_run(d_model, Path(disk), stage)
    with tempfile.TemporaryDirectory() as disk:
        plain = airay_run(d_model, Path(disk), stage, kill=False)["losses"]
    faulty = r.pop("losses")
    assert sorted(faulty) == sorted(plain), (sorted(faulty), sorted(plain))
    with torch.device("meta"):
        params = sum(p.numel() for p in tiny_gpt.build(**model_kwargs(d_model)).parameters())
    builds = [b for b in r.pop("build_rss") if b]
    row = {"d_model": d_model, "stage": stage, "parameters": params, **r, "sync_save_s": sync,
           "held_median_s": med(r["held_s"]), "held_vs_sync": med(r["held_s"]) / sync,
           "commit_median_s": med(r["commit_s"]), "copy_median_s": med(r["copy_s"]) if r["copy_s"] else None,
           "reshard_load_median_s": med(r["reshard_load_s"]),
           "loss_rel_diff": max(abs(faulty[s] - plain[s]) / abs(plain[s]) for s in plain),
           "build_model_vs_bytes": max(b["model"] for b in builds) / (4 * params),
           "build_engine_vs_bytes": max(b["engine"] for b in builds) / (4 * params)}
    print(f"ZeRO-{stage}, d_model {d_model} ({params / 1e6:.1f}M parameters): checkpoint {row['bytes'] / 2**20:.0f} MiB; "
          f"driver-node peak RSS {row['driver_node_peak_rss'] / 2**20:.0f} MiB over {row['driver_node_processes']} "
          f"processes (driver {row['driver_peak_rss'] / 2**20:.0f} MiB); worker peak RSS "
          f"{row['worker_peak_rss'] / 2**20:.0f} MiB, x{_num(row['worker_rss_vs_footprint'])} its footprint; "
          f"held per save {row['held_median_s']:.3f} s vs DeepSpeed sync save {sync:.3f} s "
          f"(ratio {row['held_vs_sync']:.3f}; " + ", ".join(f"{k} {v:.3f}" for k, v in row["held_parts"].items())
          + f"); commit to memory {row['commit_median_s']:.2f} s "
          f"({row['commit_gb_per_s']:.2f} GB/s), peer copy {row['copy_median_s'] or 0:.2f} s; reshard reload "
          f"{row['reshard_load_median_s']:.2f} s, bytes read / needed {row['read_vs_needed']:.2f}; recovery_s "
          f"{row['recovery_s']:.2f} (" + ", ".join(f"{k} {v:.2f}" for k, v in row.get("recovery_parts", {}).items())
          + f"); worlds {row['world_sizes']}; loss vs fault-free, worst relative difference "
          f"{row['loss_rel_diff']:.1e}; build peak RSS / model bytes: model {row['build_model_vs_bytes']:.2f}, "
          f"engine {row['build_engine_vs_bytes']:.2f}", flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())

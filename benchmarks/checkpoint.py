"""Checkpoint cost: time the step loop is blocked per save, and recovery from each tier.

One invocation, one model (tiny GPT with larger dims: about 25M parameters, ~300 MB of model and
AdamW state at the defaults), durable storage on a real S3-compatible server (moto, started here):

  blocked per save   airay: `checkpoint_saved.blocking_s` of a real run (the ranks' save call:
                     buffers and module state copied to host memory, parameter and optimizer
                     copies queued) plus the `checkpoint_wait_s` of the step after it (the wait
                     of its optimizer step for those copies, which run beside its forward and
                     backward); writing the files, assembling, the manifest and the upload go
                     on in the background; `previous_commit_wait_s` is reported beside it.
                     Saves with no step after them (the run's last) are left out. Beside it, the
                     step time of the steps that overlap a copy against the other steps of the
                     same runs (step 0 and replayed steps left out),
                     against DeepSpeed's synchronous `save_checkpoint` of the same
                     state in this process: to a local directory and then uploaded to the same
                     S3 server before training may go on (what a synchronous checkpoint to S3
                     costs), and to the local directory alone (no upload).
  recovery load      airay: `checkpoint_loaded.load_s` (fetch + DeepSpeed load) when a killed
                     worker's world reloads from the memory tier, against a re-run of the same
                     job on a driver without the memory tier, which loads from S3.

Medians over --repeats; ratios. Usage: python benchmarks/checkpoint.py [--repeats 3] [--reduced] [--json OUT]
  --reduced: a small model (~5 MiB of state) and one repeat, so the suite's reduced run stays short
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 32}
REDUCED_MODEL = {"d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 32}
DEEPSPEED = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}}


def job(run_dir: Path, max_steps: int, checkpoint: dict, chaos: list, model: dict) -> dict:
    return {"name": "ckpt-bench", "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": model},
            "loss_fn": "airay.models.tiny_gpt:loss", "deepspeed": DEEPSPEED,
            "data": {"kwargs": {"seq_len": model["seq_len"]}},
            "global_batch_size": 2, "micro_batch_size": 2, "max_steps": max_steps, "steps_per_round": 2,
            "scaling": {"min_workers": 1, "max_workers": 2}, "checkpoint": checkpoint, "chaos": chaos,
            "timeouts": {"capacity_wait_s": 120}, "run_dir": str(run_dir)}


def synchronous_saves(repeats: int, uri: str, work: Path, model_kwargs: dict) -> dict:
    """DeepSpeed's own synchronous save of the same model and optimizer state, in this process."""
    import deepspeed
    import torch

    from airay.models import tiny_gpt
    from airay.storage import Storage
    from airay.worker import free_port
    from airay.worker.deepspeed_compat import disable_cpu_shm_comm as _disable_cpu_shm_comm
    from airay.worker.engine import engine_config
    from airay.policy import BatchPlan

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    _disable_cpu_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    model = tiny_gpt.build(**model_kwargs)
    cfg = engine_config(DEEPSPEED, BatchPlan(1, 2, 2, 1), on_cpu=True, load_universal=False)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batch = {"tokens": torch.randint(0, 256, (2, model_kwargs["seq_len"] + 1))}
    engine.backward(tiny_gpt.loss(engine, batch))
    engine.step()  # the optimizer state exists, as in training
    storage = Storage(uri)
    local, upload = [], []
    for i in range(repeats):
        d = work / f"sync{i}"
        t0 = time.perf_counter()
        engine.save_checkpoint(str(d), tag="native", save_latest=False)
        t1 = time.perf_counter()
        files = sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
        nbytes = storage.upload(d, f"sync/{i}", files)
        t2 = time.perf_counter()
        local.append(t1 - t0)
        upload.append(t2 - t0)
        shutil.rmtree(d)
    engine.destroy()
    import deepspeed.comm as dist

    dist.destroy_process_group()
    return {"local_dir_s": local, "local_dir_then_s3_s": upload, "bytes": nbytes}


def airay_runs(repeats: int, bucket_uri, work: Path, model: dict) -> dict:
    import ray

    from airay import JobConfig, fit
    from airay.config import LocalClusterSpec
    from airay.events import read_jsonl
    from airay.local_cluster import LocalCluster

    blocking, total, memory_load, durable_load, memory_fetch, durable_fetch, waited = [], [], [], [], [], [], []
    save_call, copy_wait, overlap_steps, other_steps = [], [], [], []
    nbytes = 0
    lc = LocalCluster(LocalClusterSpec(local_nodes=2, cpus_per_node=1, object_store_memory=1024**3))
    ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)
    try:
        for i in range(repeats):
            run, mem = work / f"run{i}", work / f"mem{i}"
            ckpt = {"path": bucket_uri(f"bench{i}"), "every_n_steps": 4, "fast_every_n_steps": 2, "keep_last": 2,
                    "memory_path": str(mem)}
            # A kill at step 7: the memory tier has step 6 (S3 has step 4).
            first = fit(JobConfig.from_dict(job(run, 8, ckpt, [{"fault": "kill_worker", "at_step": 7, "rank": 1}], model)),
                        echo=False)
            assert first.status == "finished", first.error
            ev = read_jsonl(run / "events.jsonl")
            saves = [e for e in ev if e["type"] == "checkpoint_saved"]
            records, first_record = read_jsonl(run / "metrics.jsonl"), {}
            for m in records:  # a replayed step's later record is left out
                first_record.setdefault(m["step"], m)
            followed = [e for e in saves if e["step"] in first_record]
            for e in followed:
                # The largest wait any record of the next step saw (a replay after a reload included).
                wait = max(m.get("checkpoint_wait_s", 0.0) for m in records if m["step"] == e["step"])
                blocking.append(e["blocking_s"] + wait)
                save_call.append(e["blocking_s"])
                copy_wait.append(wait)
            overlapping = {e["step"] for e in followed}
            for step, m in first_record.items():
                if step > 0:
                    (overlap_steps if step in overlapping else other_steps).append(m["step_time_s"])
            waited += [e["previous_commit_wait_s"] for e in saves]
            total += [e["total_s"] for e in saves if e["tier"] == "durable"]
            nbytes = saves[-1]["bytes"]
            loaded = [e for e in ev if e["type"] == "checkpoint_loaded"]
            assert loaded[-1]["tier"] == "memory", loaded
            memory_load.append(loaded[-1]["load_s"])
            memory_fetch.append(loaded[-1]["fetch_s"])
            shutil.rmtree(mem)  # a new driver node: only S3 is left
            second = fit(JobConfig.from_dict(job(run, 9, ckpt, [], model)), echo=False)
            assert second.status == "finished", second.error
            loaded = [e for e in read_jsonl(run / "events.jsonl") if e["type"] == "checkpoint_loaded"]
            assert loaded[-1]["tier"] == "durable", loaded
            durable_load.append(loaded[-1]["load_s"])
            durable_fetch.append(loaded[-1]["fetch_s"])
    finally:
        ray.shutdown()
        lc.shutdown()
    return {"blocking_s": blocking, "save_call_s": save_call, "copy_wait_s": copy_wait,
            "step_s_overlapping_copy": overlap_steps, "step_s_other": other_steps, "previous_commit_wait_s": waited, "durable_total_s": total, "memory_load_s": memory_load,
            "durable_load_s": durable_load, "memory_fetch_s": memory_fetch, "durable_fetch_s": durable_fetch,
            "bytes": nbytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reduced", action="store_true", help="small model, one repeat")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    model = REDUCED_MODEL if args.reduced else MODEL
    if args.reduced:
        args.repeats = 1
    from tests.s3server import s3_server

    med = statistics.median
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm, \
            tempfile.TemporaryDirectory() as disk, s3_server() as bucket_uri:
        sync = synchronous_saves(args.repeats, bucket_uri("sync"), Path(disk), model)
        runs = airay_runs(args.repeats, bucket_uri, Path(shm), model)
    out = {
        "model": model, "state_bytes": runs["bytes"], "repeats": args.repeats,
        "airay_blocking_s": med(runs["blocking_s"]), "save_call_s": med(runs["save_call_s"]),
        "copy_wait_s": med(runs["copy_wait_s"]),
        "step_s_overlapping_copy": med(runs["step_s_overlapping_copy"]), "step_s_other": med(runs["step_s_other"]),
        "previous_commit_wait_s": med(runs["previous_commit_wait_s"]),
        "previous_commit_wait_max_s": max(runs["previous_commit_wait_s"]), "airay_durable_total_s": med(runs["durable_total_s"]),
        "sync_local_dir_s": med(sync["local_dir_s"]), "sync_local_dir_then_s3_s": med(sync["local_dir_then_s3_s"]),
        "memory_recovery_load_s": med(runs["memory_load_s"]), "durable_recovery_load_s": med(runs["durable_load_s"]),
        "memory_fetch_s": med(runs["memory_fetch_s"]), "durable_fetch_s": med(runs["durable_fetch_s"]),
        "samples": {**runs, **{f"sync_{k}": v for k, v in sync.items()}},
    }
    out["blocking_vs_sync_s3"] = out["airay_blocking_s"] / out["sync_local_dir_then_s3_s"]
    out["blocking_vs_sync_local"] = out["airay_blocking_s"] / out["sync_local_dir_s"]
    out["step_inflation_overlapping_copy"] = out["step_s_overlapping_copy"] / out["step_s_other"]
    out["recovery_speedup_memory_vs_s3"] = out["durable_recovery_load_s"] / out["memory_recovery_load_s"]
    print(f"model {model}, checkpoint {out['state_bytes'] / 2**20:.0f} MiB, medians of {args.repeats}")
    print(f"blocked per save, airay async (save call + copy wait)       {out['airay_blocking_s']:.3f} s "
          f"(background commit to S3 done after {out['airay_durable_total_s']:.2f} s)")
    print(f"  = save call {out['save_call_s']:.3f} s "
          f" + next optimizer step's wait for the copies {out['copy_wait_s']:.3f} s")
    print(f"  and waiting for the previous save's commit before it        {out['previous_commit_wait_s']:.3f} s "
          f"(max {out['previous_commit_wait_max_s']:.3f} s)")
    print(f"step time, steps overlapping a copy {out['step_s_overlapping_copy']:.3f} s, other steps {out['step_s_other']:.3f} s "
          f"(x{out['step_inflation_overlapping_copy']:.2f})")
    print(f"blocked per save, DeepSpeed sync save_checkpoint + S3 upload {out['sync_local_dir_then_s3_s']:.3f} s")
    print(f"blocked per save, DeepSpeed sync save_checkpoint, local dir  {out['sync_local_dir_s']:.3f} s")
    print(f"blocking ratio async / sync-to-S3   {out['blocking_vs_sync_s3']:.3f}  (target <= 0.10)")
    print(f"blocking ratio async / sync-local   {out['blocking_vs_sync_local']:.3f}")
    print(f"recovery load from memory tier {out['memory_recovery_load_s']:.3f} s (fetch {out['memory_fetch_s']:.3f} s), "
          f"from S3 {out['durable_recovery_load_s']:.3f} s (fetch {out['durable_fetch_s']:.3f} s)")
    print(f"recovery speedup memory vs S3   {out['recovery_speedup_memory_vs_s3']:.2f}x  (target >= 3x)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

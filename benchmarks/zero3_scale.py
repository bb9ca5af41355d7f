"""A model of 300M parameters trained with ZeRO-3 on 4 ranks of a local cluster, through a kill
and a regrow, against its fault-free run: does it fit, what does each rank hold, and are the
losses the same?

The tiny GPT at d_model 1792, 8 layers (308M parameters, 1.23 GB in fp32), sequence 8, global
batch 4, micro-batch 1, 10 steps, ZeRO-3, AdamW, on a local cluster of 4 one-CPU nodes; a
memory-tier save every 2 steps (its directory on disk, as a node's memory tier would be on a
node with room for it), durable every 4; rank 1 SIGKILLed at step 5 (the world shrinks to 3,
reloads step 4 resharded, and grows back to 4 when the replacement is up). The same job without
the fault is the reference. Reported:

  build RSS          a rank's peak RSS while it built its model (under zero.Init: its partition),
                     then while it built its engine (fp32 master partition, Adam's moments,
                     gradient partition, buffers): world_formed's build_rss, over the model's fp32
                     bytes, worst rank of every world formed (the first at 4, then the survivors'
                     and the replacement's)
  worker peak RSS    each training worker's peak RSS over the run, sampled every 0.2 s, and the
                     peak of its anonymous part (RSS less mapped files' pages: a checkpoint file a
                     load maps is page cache, held once a node whichever ranks map it)
  loss difference    the worst relative difference between the faulty run's committed loss and
                     the fault-free run's, at every step (target < 1e-5)
  recovery_s         detection of the kill to the first step at the new size

Before partitioned construction every rank built the whole model (1.3x its bytes while the
engine was built) and Ray's memory monitor killed every rank at the first step.
Every step is CPU work (no sleep). Usage:
  python benchmarks/zero3_scale.py [--d-model 1792] [--steps 10] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.checkpoint import RssSampler, worker_pids  # noqa: E402
from benchmarks.stored import write_result  # noqa: E402

WORKERS, LAYERS, SEQ = 4, 8, 8


def job(run_dir: Path, work: Path, d_model: int, steps: int, kill: bool) -> dict:
    return {"name": f"zero3-{d_model}-{'kill' if kill else 'plain'}",
            "model": {"factory": "airay.models.tiny_gpt:build",
                      "kwargs": {"d_model": d_model, "n_layers": LAYERS, "n_heads": 14, "seq_len": SEQ}},
            "loss_fn": "airay.models.tiny_gpt:loss", "data": {"kwargs": {"seq_len": SEQ}},
            "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3}},
            "global_batch_size": 4, "micro_batch_size": 1, "max_steps": steps, "steps_per_round": 1,
            "scaling": {"min_workers": 3, "max_workers": WORKERS},
            "checkpoint": {"path": str(work / "durable"), "every_n_steps": 4, "fast_every_n_steps": 2,
                           "keep_last": 1, "memory_keep_last": 1, "memory_path": str(work / "memory")},
            "chaos": [{"fault": "kill_worker", "at_step": 5, "rank": 1}] if kill else [],
            "timeouts": {"capacity_wait_s": 300, "hang_timeout_s": 300, "collective_timeout_s": 600,
                         "phase_timeout_s": 600},
            "run_dir": str(run_dir)}


def run(d_model: int, steps: int, kill: bool, work: Path) -> dict:
    import ray

    from airay import JobConfig, fit
    from airay.config import LocalClusterSpec
    from airay.events import committed_losses, read_jsonl
    from airay.local_cluster import LocalCluster

    run_dir = work / "run"
    lc = LocalCluster(LocalClusterSpec(local_nodes=WORKERS, cpus_per_node=1, object_store_memory=256 * 1024**2))
    ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)

    try:
        with RssSampler(lambda: [os.getpid()], lambda: worker_pids(run_dir)) as rss:
            result = fit(JobConfig.from_dict(job(run_dir, work, d_model, steps, kill)), echo=False)
    finally:
        ray.shutdown()
        lc.shutdown()
    assert result.status == "finished", result.error
    events = read_jsonl(run_dir / "events.jsonl")
    worlds = [{"world_size": e["world_size"], "build_rss": [w.get("build_rss") for w in e["workers"]]}
              for e in events if e["type"] == "world_formed"]
    shrink = [e for e in events if e["type"] == "resize_finished" and e["reason"] == "failure"]
    return {"losses": committed_losses(run_dir), "worlds": worlds, "world_sizes": result.world_sizes,
            "worker_peak_rss": {str(pid): max(r for _, r in s) for pid, s in rss.workers.items()},
            "worker_peak_anon": {str(pid): peak for pid, peak in rss.workers_anon.items()},
            "recovery_s": shrink[0]["recovery_s"] if shrink else None,
            "loaded": [{k: e[k] for k in ("step", "world_size", "saved_world_size", "resharded", "load_s")}
                       for e in events if e["type"] == "checkpoint_loaded"]}


def worst(side: dict, part: str) -> int:
    """The largest build_rss[part] of any rank in any world of a run."""
    return max(b[part] for w in side["worlds"] for b in w["build_rss"] if b and b.get(part) is not None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1792)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    import torch

    from airay.models import tiny_gpt

    with torch.device("meta"):
        params = sum(p.numel() for p in tiny_gpt.build(d_model=args.d_model, n_layers=LAYERS, n_heads=14,
                                                       seq_len=SEQ).parameters())
    model_bytes = 4 * params
    out = {"d_model": args.d_model, "parameters": params, "model_bytes": model_bytes, "workers": WORKERS}
    for side, kill in (("fault_free", False), ("kill", True)):
        with tempfile.TemporaryDirectory() as d:
            out[side] = run(args.d_model, args.steps, kill, Path(d))
        r = out[side]
        print(f"{side}: worlds {r['world_sizes']}; build RSS / model bytes, worst rank: model "
              f"{worst(r, 'model') / model_bytes:.2f}, engine {worst(r, 'engine') / model_bytes:.2f}; worker peak RSS, worst: "
              f"{max(r['worker_peak_rss'].values()) / 2**30:.2f} GiB (of it anonymous, worst: "
              f"{max(r['worker_peak_anon'].values()) / 2**30:.2f} GiB); recovery_s {r['recovery_s']}", flush=True)
    plain, faulty = out["fault_free"]["losses"], out["kill"]["losses"]
    diffs = {s: abs(faulty[s] - plain[s]) / abs(plain[s]) for s in plain}
    out["worst_loss_rel_diff"] = max(diffs.values())
    for part in ("model", "engine"):
        out[f"worst_{part}_build_rss_vs_model"] = max(worst(out[s], part) for s in ("fault_free", "kill")) / model_bytes
    out["worst_worker_peak_rss"] = max(max(out[s]["worker_peak_rss"].values()) for s in ("fault_free", "kill"))
    out["worst_worker_peak_anon"] = max(max(out[s]["worker_peak_anon"].values()) for s in ("fault_free", "kill"))
    print(f"{params / 1e6:.0f}M parameters ({model_bytes / 2**30:.2f} GiB fp32), ZeRO-3 on {WORKERS} ranks: "
          f"steps {sorted(plain) == sorted(faulty) and len(plain)} equal in count; worst relative loss difference "
          f"{out['worst_loss_rel_diff']:.2e} (target < 1e-5); peak RSS while building / model bytes, worst rank: "
          f"the model {out['worst_model_build_rss_vs_model']:.2f} (target <= 0.5), the engine "
          f"{out['worst_engine_build_rss_vs_model']:.2f}; "
          f"worker peak RSS {out['worst_worker_peak_rss'] / 2**30:.2f} GiB, anonymous "
          f"{out['worst_worker_peak_anon'] / 2**30:.2f} GiB")
    if args.json:
        write_result(args.json, "zero3_scale.py", **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

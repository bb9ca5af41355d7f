"""How fast airay's save path commits to node memory when it has the cores to itself, against
DeepSpeed's synchronous save of the same state to the same place.

benchmarks/checkpoint.py measures the commit to memory beside training: on this 2-core machine
4 training ranks and their writer threads share the cores, and the commit runs at well under the
1 GB/s target. This separates the write path from that contention: in one gloo world of 4
processes (no Ray) at ZeRO stage 2 and 3, each model size trains a step (the optimizer state
exists), then, turn by turn, saves to /dev/shm through airay's staging checkpoint engine
(DeepSpeed's save_checkpoint, then the background writes with their file and chunk CRC-32s,
waited for: `Writer.wait`) and through DeepSpeed's own engine (torch.save in the call, torch's
own per-record CRC as it is by default). Nothing trains meanwhile. Reported per size and stage:
the checkpoint's bytes, each side's median over the turns of the slowest rank's seconds from the
call to its files written, the aggregate GB/s (all ranks' bytes over that), and airay's time
over DeepSpeed's.

Usage: python benchmarks/commit_idle.py [--sizes 256,512,1024] [--stages 2,3] [--turns 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4


def _world(rank: int, port: int, d_model: int, stage: int, turns: int, out: str, results) -> None:
    import deepspeed.comm as dist
    import torch

    sys.path.insert(0, str(ROOT))
    from airay.checkpoint import staging
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.engine import backward_micro_batch
    from benchmarks.checkpoint import SEQ, deepspeed_config, model_kwargs
    from benchmarks.plain import plain_engine

    torch.set_num_threads(1)
    plan = plan_batch(WORLD, 1, WORLD)
    engine = plain_engine(tiny_gpt.build(seed=0, **model_kwargs(d_model)), deepspeed_config(stage), plan, rank=rank,
                          world=WORLD, port=port)
    backward_micro_batch(engine, tiny_gpt.loss(engine, {"tokens": torch.randint(0, 256, (1, SEQ + 1))}), 1, plan)
    native = engine.checkpoint_engine
    writer = staging.Writer()
    airay_engine = staging.install(engine, writer)
    rows = []
    for turn in range(turns):
        for side, ckpt_engine in (("airay", airay_engine), ("deepspeed", native)):
            engine.checkpoint_engine = ckpt_engine
            where = f"{out}/{side}-{turn}"
            dist.barrier()
            t0 = time.perf_counter()
            engine.save_checkpoint(where, tag="t", save_latest=False)
            writer.wait()  # nothing queued on DeepSpeed's side: its files are written in the call
            seconds = time.perf_counter() - t0
            nbytes = sum(p.stat().st_size for p in Path(where, "t").glob(f"*rank_{rank}_*"))
            if rank == 0:  # ZeRO-1/2's model states file ("mp_rank_00_model_states.pt") is rank 0's
                nbytes += sum(p.stat().st_size for p in Path(where, "t").glob("mp_rank_*_model_states.pt"))
            rows.append({"side": side, "turn": turn, "s": seconds, "bytes": nbytes})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
    results[rank] = rows


def measure(d_model: int, stage: int, turns: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from airay.worker import free_port
    from tests import worlds

    results = mp.Manager().dict()
    out = tempfile.mkdtemp(prefix="airay-commit-idle-", dir="/dev/shm")
    try:
        worlds.spawn(_world, args=(free_port(), d_model, stage, turns, out, results), nprocs=WORLD)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    ranks = [results[rank] for rank in range(WORLD)]  # the same saves in the same order on every rank
    row = {"d_model": d_model, "stage": stage}
    for side in ("airay", "deepspeed"):
        saves = [i for i, r in enumerate(ranks[0]) if r["side"] == side]
        slowest = [max(rank[i]["s"] for rank in ranks) for i in saves]
        nbytes = sum(rank[saves[0]]["bytes"] for rank in ranks)
        med = statistics.median(slowest)
        row[side] = {"seconds": slowest, "median_s": med, "bytes": nbytes, "gb_per_s": nbytes / med / 1e9}
    row["airay_vs_deepspeed"] = row["airay"]["median_s"] / row["deepspeed"]["median_s"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512,1024")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.stored import write_result

    rows = []
    for stage in map(int, args.stages.split(",")):
        for d_model in map(int, args.sizes.split(",")):
            row = measure(d_model, stage, args.turns)
            rows.append(row)
            a, d = row["airay"], row["deepspeed"]
            print(f"ZeRO-{stage}, d_model {d_model}: {a['bytes'] / 2**20:.0f} MiB; airay {a['median_s']:.3f} s "
                  f"({a['gb_per_s']:.2f} GB/s), DeepSpeed's synchronous save {d['median_s']:.3f} s ({d['gb_per_s']:.2f} "
                  f"GB/s); airay / DeepSpeed {row['airay_vs_deepspeed']:.2f}  [{WORLD} gloo ranks, cores idle, "
                  f"medians of {args.turns}, slowest rank]", flush=True)
    if args.json:
        write_result(args.json, "commit_idle.py", world=WORLD, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a ZeRO-3 resize and save cost a rank in collectives: DeepSpeed as it is against airay's build and save.

A resize builds every survivor's model and engine again for the new world, then loads the
checkpoint over them. DeepSpeed 0.19 as it is (the baseline) moves the whole model between the
ranks on that path twice, one parameter at a time: zero.Init broadcasts rank 0's copy of every
parameter before partitioning it, and ZeRO-3's optimizer gathers every parameter whole to
register its gradient hook. Its save partitions the parameters kept gathered between steps and
gathers them again, a collective each. airay leaves those out where their result is not used
(airay.worker.deepspeed_compat: zero_init_without_broadcast, for a build a checkpoint overwrites;
grad_hooks_without_gathering; save_keeping_gathered). Both sides use the same engine config
(airay.worker.engine.engine_config, tag validation off) and the same step.

Each turn runs, in one gloo world of WORLD processes (no Ray; the world a shrink of 4 leaves), the
baseline then airay: build the model for a checkpoint (no initialisation), build its engine,
train a step, time the save call to /dev/shm (airay's staging checkpoint engine on both sides, as
a worker has it: the files are written in the background after the call), drop the engine. Reported: the slowest rank's seconds
per part, medians over the turns (the first turn left out: the processes' first engine), the
collectives each part made (deepspeed.comm broadcasts and all-gathers, counted on rank 0), and
airay's time over the baseline's. Steps are CPU work.

Usage: python benchmarks/zero3_resize.py [--d-model 1024] [--world 3] [--turns 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("model_s", "engine_s", "save_s")


def _world(rank, world, port, d_model, turns, results):
    sys.path.insert(0, str(ROOT))
    import deepspeed.comm as dist
    import torch

    from airay.checkpoint import staging
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker import deepspeed_compat
    from airay.worker.build import build_model
    from airay.worker.engine import backward_micro_batch, build_engine, drop_engine, engine_config
    from tests import worlds

    worlds.join(rank, world, port)
    calls = collections.Counter()
    for name in ("broadcast", "all_gather_into_tensor"):
        def counted(*args, _f=getattr(dist, name), _n=name, **kwargs):
            calls[_n] += 1
            return _f(*args, **kwargs)
        setattr(dist, name, counted)
    patches = {name: getattr(deepspeed_compat, name) for name in ("zero_init_without_broadcast",
                                                                  "grad_hooks_without_gathering")}
    plan = plan_batch(world, 1, world)  # a micro-batch a rank: every step is an optimizer step
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3}}
    cfg = engine_config(base, plan, True, False)
    kwargs = {"d_model": d_model, "n_layers": 8, "n_heads": 8, "seq_len": 8}
    batch = {"tokens": torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(rank))}
    store, writer = f"/dev/shm/airay-zero3-resize-{port}", staging.Writer()
    # The checkpoint each build is for: a model initialised and trained a step (a build for a
    # checkpoint holds no values until it is loaded).
    deepspeed_compat.reset_zero3_globals()
    engine = build_engine(build_model(tiny_gpt.build, kwargs, 0, cfg), base, plan, "cpu")
    backward_micro_batch(engine, tiny_gpt.loss(engine, batch), 1, plan)
    engine.save_checkpoint(store, tag="base", save_latest=False)
    drop_engine(engine)
    del engine
    out = []
    for turn in range(turns):
        for variant in ("deepspeed", "airay"):
            for name, fn in patches.items():  # the baseline: DeepSpeed's own code on these paths
                setattr(deepspeed_compat, name, fn if variant == "airay" else contextlib.nullcontext)
            row = {"turn": turn, "variant": variant}
            deepspeed_compat.reset_zero3_globals()
            dist.barrier()
            calls.clear()
            t0 = time.perf_counter()
            model = build_model(tiny_gpt.build, kwargs, 0, cfg, init_weights=False)
            row["model_s"], row["model_calls"] = time.perf_counter() - t0, dict(calls)
            calls.clear()
            t0 = time.perf_counter()
            engine = build_engine(model, base, plan, "cpu")
            row["engine_s"], row["engine_calls"] = time.perf_counter() - t0, dict(calls)
            staging.install(engine, writer)  # as a worker saves: the files are written beside the step
            engine.load_checkpoint(store, tag="base")
            loss = tiny_gpt.loss(engine, batch)
            row["loss"] = loss.item()
            backward_micro_batch(engine, loss, 1, plan)
            dist.barrier()
            calls.clear()
            saving = deepspeed_compat.save_keeping_gathered(engine) if variant == "airay" else contextlib.nullcontext()
            t0 = time.perf_counter()
            with saving:
                engine.save_checkpoint(store, tag=f"{variant}{turn}", save_latest=False)
            row["save_s"], row["save_calls"] = time.perf_counter() - t0, dict(calls)
            writer.wait()
            dist.barrier()
            if rank == 0:  # /dev/shm is memory
                shutil.rmtree(f"{store}/{variant}{turn}")
            drop_engine(engine)
            del engine, model
            import gc

            gc.collect()
            out.append(row)
    results[rank] = out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.stored import write_result
    from airay.worker import free_port
    from tests import worlds

    port = free_port()
    results = mp.Manager().dict()
    try:
        worlds.spawn(_world, args=(args.world, port, args.d_model, args.turns, results), nprocs=args.world)
    finally:
        shutil.rmtree(f"/dev/shm/airay-zero3-resize-{port}", ignore_errors=True)
    ranks = [results[r] for r in range(args.world)]
    summary = {}
    for variant in ("deepspeed", "airay"):
        rows = [[r for r in rank if r["variant"] == variant and r["turn"] > 0] for rank in ranks]
        summary[variant] = {part: statistics.median(max(rank[i][part] for rank in rows) for i in range(len(rows[0])))
                            for part in PARTS}
        summary[variant]["resize_build_s"] = summary[variant]["model_s"] + summary[variant]["engine_s"]
        summary[variant]["collectives_rank0"] = {part: rows[0][-1][part.replace("_s", "_calls")] for part in PARTS}
    losses = {(r["variant"], r["turn"], i): r["loss"] for i, rank in enumerate(ranks) for r in rank}
    assert len({v for (variant, turn, i), v in losses.items() if i == 0}) == 1, losses  # each loaded the same state
    ratio = {k: summary["airay"][k] / summary["deepspeed"][k] for k in (*PARTS, "resize_build_s")}
    for variant in ("deepspeed", "airay"):
        s = summary[variant]
        print(f"{variant:9s}: build for a checkpoint {s['resize_build_s']:.3f} s (model {s['model_s']:.3f}, engine "
              f"{s['engine_s']:.3f}); save {s['save_s']:.3f} s; collectives on rank 0: {s['collectives_rank0']}")
    print(f"airay / DeepSpeed: build {ratio['resize_build_s']:.2f} (model {ratio['model_s']:.2f}, engine "
          f"{ratio['engine_s']:.2f}), save {ratio['save_s']:.2f}  [{args.world} gloo ranks, d_model {args.d_model}, "
          f"medians of {args.turns - 1} turns, slowest rank]")
    if args.json:
        write_result(args.json, "zero3_resize.py", world=args.world, d_model=args.d_model, turns=args.turns,
                     summary=summary, ratio=ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())

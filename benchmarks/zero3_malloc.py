"""glibc's heap against a rank's build memory and its step time (ZeRO-3, CPU).

glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB) and keeps
blocks under it in its heap once freed, so the peak RSS of a rank building a ZeRO-3 model
partitioned varied from build to build (the sweep's build column: 0.48-0.67 of the model's
bytes). Fixing the threshold makes it follow what the rank holds, at a cost to the step: every
gathered parameter over the threshold is mapped (and zeroed by the kernel) again on every
forward and backward. airay's answer leaves the thresholds alone and hands the heap's free
pages back while it builds (airay.worker.build.trimming_heap: malloc_trim each time 4 MiB of
parameters have been partitioned away).

Each turn runs a gloo world of WORLD processes (this machine's CPUs, no Ray) twice: glibc's
default, then `--variant`; each builds the tiny GPT under zero.Init (peak RSS of the
build over the model's fp32 bytes, per rank), builds its engine and times `--steps` steps (the
slowest rank's, the first left out of the median). "default" is glibc's defaults with airay's
trimming turned off (TRIM_EVERY_BYTES = 0); the variants:

  trim:     airay's build as it is (its heap trimmed while building; glibc's thresholds as they are)
  fixed:    M_MMAP_THRESHOLD 128 KiB from the start (mallopt)
  build:    128 KiB while building, then 32 MiB with M_TRIM_THRESHOLD 64 MiB (glibc's dynamic
            values at their largest) for the steps

Usage: python benchmarks/zero3_malloc.py [--d-model 1024] [--stage 3] [--turns 2] [--steps 5] [--variant trim]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def mallopt(param: int, value: int) -> None:
    assert ctypes.CDLL("libc.so.6").mallopt(param, value), (param, value)


def _world(rank, port, results, d_model, stage, variant, steps):
    import deepspeed

    sys.path.insert(0, str(ROOT))
    if variant in ("fixed", "build"):
        mallopt(M_MMAP_THRESHOLD, 128 << 10)
    from airay.worker import build

    if variant != "trim":
        build.TRIM_EVERY_BYTES = 0
    from airay.data.source import SyntheticSource
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.build import build_model
    from airay.worker.deepspeed_compat import disable_cpu_shm_comm, preload_for_zero_init, reset_zero3_globals
    from airay.worker.engine import backward_micro_batch, build_engine, engine_config
    from airay.worker.memory import peak_since, start_peak

    torch.set_num_threads(1)
    disable_cpu_shm_comm()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0"})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    plan = plan_batch(4, 1, WORLD)
    cfg = engine_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}},
                        plan, True, False)
    preload_for_zero_init()
    reset_zero3_globals()
    model_kwargs = {"d_model": d_model, "n_layers": 8, "n_heads": 8, "seq_len": 8}
    before = start_peak()
    model = build_model(tiny_gpt.build, model_kwargs, 0, cfg, init_weights=True)
    ratio = peak_since(before) / sum(4 * getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine = build_engine(model, cfg, plan, "cpu")
    if variant == "build":
        mallopt(M_MMAP_THRESHOLD, 32 << 20)
        mallopt(M_TRIM_THRESHOLD, 64 << 20)
    data = SyntheticSource(tiny_gpt.synthetic_sample, 0, {"seq_len": model_kwargs["seq_len"]})
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        for batch, n in zip(data.micro_batches(step, rank, plan), plan.micro_sizes(rank)):
            backward_micro_batch(engine, tiny_gpt.loss(engine, batch), n, plan)
        times.append(time.perf_counter() - t0)
    results[rank] = (times, ratio)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--stage", type=int, default=3)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--variant", choices=("trim", "fixed", "build"), default="trim")
    args = ap.parse_args()
    for turn in range(args.turns):
        for variant in ("default", args.variant):
            results = mp.Manager().dict()
            mp.spawn(_world, args=(free_port(), results, args.d_model, args.stage, variant, args.steps), nprocs=WORLD)
            per_step = [max(r[0][i] for r in results.values()) for i in range(args.steps)]
            print(f"turn {turn}, {variant}: median step {statistics.median(per_step[1:]):.3f} s "
                  f"(steps {[round(t, 2) for t in per_step]}); build peak RSS / model bytes by rank "
                  f"{[round(r[1], 2) for _, r in sorted(results.items())]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

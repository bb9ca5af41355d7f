"""The GPU check of the model state's path: building a 1B model partitioned vs whole, and what an
asynchronous checkpoint every step costs the step.

On one CUDA GPU, one process, a world of 1 (NCCL on cuda:0): the ~1B-parameter decoder of
benchmarks/gpu.py (tiny GPT at d_model 2048, 18 layers, vocab 32000, 1024 tokens), bf16, ZeRO-3.

  build      peak host RSS above the process's RSS before, while (a) airay builds the model
             (airay.worker.build: under zero.Init the parameters are made on the GPU) and (b) the
             same factory builds it whole on the host, as `model.to(device)` code does
  checkpoint median step time (CUDA-synchronized) with airay's staging engine saving every step
             (live tensors copied to pinned host buffers on a side stream; the step waits for the
             copies, the files are written by a thread) against no checkpoint, same engine; the
             step's checkpoint_wait_s (the wait for the copies) reported apart

Usage: python benchmarks/gpu_checkpoint.py [--steps 10] [--json OUT] [--smoke]
  --smoke: a tiny model on the CPU (gloo): checks this script where there is no GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import MODEL, SMOKE_MODEL  # noqa: E402

DEEPSPEED = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
MICRO_BATCH = 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    import torch

    from airay.checkpoint.staging import Writer, install
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker import free_port
    from airay.worker.build import build_model
    from airay.worker.deepspeed_compat import preload_for_zero_init, reset_zero3_globals
    from airay.worker.engine import backward_micro_batch, build_engine, engine_config
    from airay.worker.memory import peak_since, start_peak
    from benchmarks.plain import join_world

    smoke = args.smoke or not torch.cuda.is_available()
    model_kw = SMOKE_MODEL if smoke else MODEL
    device = "cpu" if smoke else "cuda:0"
    ds = {k: v for k, v in DEEPSPEED.items() if not (smoke and k == "bf16")}
    micro = 2 if smoke else MICRO_BATCH
    join_world(0, 1, free_port(), device)
    plan = plan_batch(micro, micro, 1)
    cfg = engine_config(ds, plan, device == "cpu", False)
    preload_for_zero_init()
    reset_zero3_globals()

    before = start_peak()
    model = build_model(tiny_gpt.build, model_kw, 0, cfg)
    partitioned_rss = peak_since(before)
    params = sum(int(p.ds_numel) for p in model.parameters())
    before = start_peak()
    whole = tiny_gpt.build(seed=0, **model_kw)
    whole_rss = peak_since(before)
    del whole
    print(f"build: {params / 1e9:.2f}B parameters; peak host RSS partitioned {partitioned_rss / 2**30:.2f} GiB, "
          f"whole {whole_rss / 2**30:.2f} GiB", flush=True)

    engine = build_engine(model, cfg, plan, device)
    writer = Writer()
    install(engine, writer)
    tokens = torch.randint(0, model_kw["vocab_size"], (micro, model_kw["seq_len"] + 1), device=device)

    def step() -> float:
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        backward_micro_batch(engine, tiny_gpt.loss(engine, {"tokens": tokens}), micro, plan)
        if device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: allocator, kernels, the optimizer state
        step()
    plain = [step() for _ in range(args.steps)]
    saving, waits, saves = [], [], []
    with tempfile.TemporaryDirectory() as out:
        for i in range(args.steps):
            t0 = time.perf_counter()
            engine.save_checkpoint(out, tag="every-step", save_latest=False)
            saves.append(time.perf_counter() - t0)
            saving.append(step())
            waits.append(writer.take_wait())
        writer.wait()
    med = statistics.median
    result = {"device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu (smoke)", "parameters": params,
              "build_rss_partitioned": partitioned_rss, "build_rss_whole": whole_rss,
              "step_s_plain": med(plain), "step_s_checkpoint_every_step": med(saving),
              "save_call_s": med(saves), "checkpoint_wait_s": med(waits),
              "live_bytes": engine.checkpoint_engine.live_bytes}
    print(f"checkpoint every step: step {result['step_s_checkpoint_every_step']:.4f} s vs {result['step_s_plain']:.4f} s "
          f"without (x{result['step_s_checkpoint_every_step'] / result['step_s_plain']:.3f}); the save call "
          f"{result['save_call_s']:.4f} s; the step's wait for the copies {result['checkpoint_wait_s']:.4f} s; "
          f"{result['live_bytes'] / 2**30:.2f} GiB written from live state per save", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The GPU check: airay's CUDA/NCCL path, and its steady-state throughput and MFU against plain DeepSpeed.

On one CUDA GPU: (1) plain DeepSpeed, one process, NCCL world of 1 on cuda:0, trains a ~1B-parameter
decoder (airay.models.tiny_gpt at d_model 2048, 18 layers, vocab 32000, 1024 tokens: 1.04e9
parameters; bf16, ZeRO-1, torch's AdamW) for `--steps` steps, each timed with a CUDA synchronize;
(2) airay trains the same job through Ray (a placement-group actor on the GPU, world of 1), and
its own metrics give the same per-step time; the world it formed must be on cuda:0 with NCCL.
Both build their engine with airay.worker.engine.build_engine and the same batch plan.

Steady state is the median over the steps after `--warmup`. MFU counts 6 x (parameters of the
matrix multiplies) + 12 x layers x d_model x sequence FLOPs per token (PaLM's accounting, attention
counted in full) against the GPU's dense bf16 peak (`--peak-tflops`, 989.4 for H100/H200 SXM).
airay's run is stopped once the measured steps are in (no final checkpoint: a 1B model's
checkpoint is the checkpoint benchmark's subject, not this one's).

Usage: python benchmarks/gpu.py [--steps 25] [--warmup 5] [--json OUT] [--smoke]
  --smoke: a tiny model, a few steps, on whatever device there is (checks this script on a CPU machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"vocab_size": 32000, "seq_len": 1024, "d_model": 2048, "n_layers": 18, "n_heads": 16}
SMOKE_MODEL = {"vocab_size": 256, "seq_len": 32, "d_model": 64, "n_layers": 2, "n_heads": 4}
DEEPSPEED = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
GLOBAL_BATCH, MICRO_BATCH = 32, 16
PEAK_TFLOPS = 989.4  # H100/H200 SXM, dense bf16 (datasheet)


def job(model: dict, steps: int, run_dir: str, smoke: bool) -> dict:
    ds = {k: v for k, v in DEEPSPEED.items() if not (smoke and k == "bf16")}
    return {"name": "gpu-check", "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": model},
            "loss_fn": "airay.models.tiny_gpt:loss",
            "data": {"kwargs": {"vocab_size": model["vocab_size"], "seq_len": model["seq_len"]}},
            "deepspeed": ds, "global_batch_size": 4 if smoke else GLOBAL_BATCH,
            "micro_batch_size": 2 if smoke else MICRO_BATCH, "max_steps": steps, "steps_per_round": 5,
            "scaling": {"min_workers": 1, "max_workers": 1},
            "checkpoint": {"every_n_steps": 10**6}, "run_dir": run_dir}


def flops_per_token(model: dict) -> float:
    d, layers, vocab, seq = model["d_model"], model["n_layers"], model["vocab_size"], model["seq_len"]
    matmul_params = layers * 12 * d * d + d * vocab  # blocks (qkv, proj, mlp) and the output head
    return 6 * matmul_params + 12 * layers * d * seq


def parameters(model: dict) -> int:
    import torch

    from airay.models import tiny_gpt

    with torch.device("meta"):  # shapes only, no memory
        return sum(p.numel() for p in tiny_gpt.build(**model).parameters())


def plain(args) -> None:
    """One process, what a user writes with DeepSpeed alone (no Ray)."""
    import torch
    import torch.distributed as dist

    from airay.config import JobConfig
    from airay.data.source import SyntheticSource
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.dist import free_port
    from airay.worker.engine import backward_micro_batch
    from benchmarks.plain import plain_engine

    model_kw = SMOKE_MODEL if args.smoke else MODEL
    cfg = JobConfig.from_dict(job(model_kw, args.steps, "/tmp/unused", args.smoke))
    plan = plan_batch(cfg.global_batch_size, cfg.micro_batch_size, 1)
    cuda = torch.cuda.is_available()
    device = "cuda:0" if cuda else "cpu"
    engine = plain_engine(tiny_gpt.build(seed=0, **model_kw), cfg.deepspeed, plan, rank=0, world=1, port=free_port(),
                          device=device, threads=None)
    data = SyntheticSource(tiny_gpt.synthetic_sample, 0, cfg.data.kwargs)
    times, losses = [], []
    for step in range(args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        total = torch.zeros((), device=device)
        for batch, samples in zip(data.micro_batches(step, 0, plan), plan.micro_sizes(0)):
            loss = tiny_gpt.loss(engine, {k: v.to(device) for k, v in batch.items()})
            backward_micro_batch(engine, loss, samples, plan)
            total += loss.detach().float() * samples
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(total) / cfg.global_batch_size)
    Path(args.out).write_text(json.dumps({"step_times": times, "losses": losses, "backend": dist.get_backend(),
                                          "device": str(engine.device)}))


def with_airay(args) -> None:
    """The same job through airay.fit on a local Ray with this machine's GPU; stopped (with its Ray)
    once `--steps` steps are in metrics.jsonl."""
    import ray
    import torch

    import airay
    from airay.events import read_jsonl

    model_kw = SMOKE_MODEL if args.smoke else MODEL
    run_dir = Path(tempfile.mkdtemp(prefix="airay-gpu-"))

    def watch():
        while True:
            time.sleep(0.5)
            metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
            if len(metrics) >= args.steps:
                formed = [e for e in read_jsonl(run_dir / "events.jsonl") if e["type"] == "world_formed"]
                Path(args.out).write_text(json.dumps({"metrics": metrics[:args.steps], "world_formed": formed}))
                # The run would go on to its final checkpoint; stop it and the Ray it started.
                ray._private.worker._global_node.kill_all_processes(check_alive=False, allow_graceful=False)
                os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    ray.init(num_cpus=4, num_gpus=1 if torch.cuda.is_available() else 0, include_dashboard=False,
             object_store_memory=2 * 1024**3, logging_level="WARNING")
    result = airay.fit(airay.JobConfig.from_dict(job(model_kw, args.steps + 1000, str(run_dir), args.smoke)),
                       echo=False)
    raise SystemExit(f"the run ended before {args.steps} steps: {result.status} {result.error}")


def child(mode: str, args, out: Path) -> dict:
    cmd = [sys.executable, __file__, f"--{mode}", "--steps", str(args.steps), "--out", str(out)]
    cmd += ["--smoke"] if args.smoke else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    print(f"[gpu] {mode}: {time.perf_counter() - t0:.0f} s (exit {proc.returncode})", flush=True)
    if not out.exists():
        raise RuntimeError(f"{mode} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--airay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain:
        plain(args)
        return 0
    if args.airay:
        with_airay(args)
        return 0
    import torch

    model_kw = SMOKE_MODEL if args.smoke else MODEL
    gbs = 4 if args.smoke else GLOBAL_BATCH
    tokens_per_step = gbs * model_kw["seq_len"]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    with tempfile.TemporaryDirectory() as tmp:
        base = child("plain", args, Path(tmp) / "plain.json")  # first: airay's stop leaves nothing on the GPU
        ours = child("airay", args, Path(tmp) / "airay.json")
    w = args.warmup
    plain_s = statistics.median(base["step_times"][w:])
    airay_steps = [m["step_time_s"] for m in ours["metrics"]]
    airay_s = statistics.median(airay_steps[w:])
    # Wall time per step across rounds (driver round trips included): round end to round end.
    ends = sorted({m["ts"] for m in ours["metrics"][w:]})
    steps_between = sum(1 for m in ours["metrics"][w:] if ends[0] < m["ts"] <= ends[-1])
    airay_wall_s = (ends[-1] - ends[0]) / steps_between if steps_between else None
    fpt = flops_per_token(model_kw)
    worker = ours["world_formed"][-1]["workers"][0]

    def mfu(step_s):
        return tokens_per_step * fpt / step_s / (args.peak_tflops * 1e12) if step_s else None

    result = {
        "gpu": gpu, "torch": torch.__version__, "model": model_kw,
        "parameters": parameters(model_kw),
        "global_batch_size": gbs, "tokens_per_step": tokens_per_step, "steps": args.steps, "warmup": w,
        "flops_per_token": fpt, "peak_tflops": args.peak_tflops,
        "plain": {"step_s": plain_s, "tokens_per_s": tokens_per_step / plain_s, "mfu": mfu(plain_s),
                  "backend": base["backend"], "device": base["device"], "losses": base["losses"]},
        "airay": {"step_s": airay_s, "tokens_per_s": tokens_per_step / airay_s, "mfu": mfu(airay_s),
                  "wall_step_s": airay_wall_s,
                  "wall_tokens_per_s": tokens_per_step / airay_wall_s if airay_wall_s else None,
                  "backend": worker["backend"], "device": worker["device"], "local_rank": worker.get("local_rank"),
                  "engine_device": worker.get("engine_device"), "losses": [m["loss"] for m in ours["metrics"]]},
    }
    # Same seed, samples and model: the two runs' losses agree up to bf16 kernel nondeterminism.
    pairs = list(zip(base["losses"], result["airay"]["losses"]))
    result["max_loss_rel_diff"] = max(abs(a - b) / abs(a) for a, b in pairs) if pairs else None
    result["ratio_step"] = plain_s / airay_s
    result["ratio_wall"] = plain_s / airay_wall_s if airay_wall_s else None
    print(json.dumps({k: v for k, v in result.items()}, indent=1, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

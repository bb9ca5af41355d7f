"""The GPU check of device errors: a real CUDA device-side assert on a rank is infrastructure, the
process that raised it is replaced, and the run finishes.

On one CUDA GPU: a local Ray (this machine), airay trains the small tiny GPT of benchmarks/gpu.py's
smoke model in a world of one rank on cuda:0 (NCCL), a checkpoint every 2 steps. The spec's chaos
`device_error` at step 5 makes the rank trip a real device-side assert (an index past the end of a
CUDA tensor, airay.chaos.device_side_assert), launched and not waited for: CUDA reports it wherever
it surfaces next (the loss, the backward, the optimizer step or the step's synchronize), as a real
fault. Checked from the run's files and Ray's actor table:

  classified  the rank's failure is infrastructure: `worker_failed` with outcome gpu_error (the
              worker named CUDA's error) or died (the process ended first, e.g. NCCL's watchdog
              aborting it on the same error); which one is reported
  replaced    the process that raised it was killed at its recovery (before the next world
              formed) and the world that trained on is another process (a new pid) on the GPU
  finished    the run ends `finished` at the last step, resumed from the checkpoint before the fault

Usage: python benchmarks/gpu_errors.py [--json OUT] [--smoke] [--timeout 480]
  --smoke: two CPU ranks (gloo), the device error simulated (torch.AcceleratorError with CUDA's
  message, raised where the loss runs): checks this script and the path on a machine without a GPU.
  Without --smoke on a machine without CUDA it exits 2 and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import SMOKE_MODEL  # noqa: E402

STEPS, FAULT_STEP, EVERY = 12, 5, 2


def job(run_dir: str, workers: int, rank: int) -> dict:
    return {"name": "gpu-errors", "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": SMOKE_MODEL},
            "loss_fn": "airay.models.tiny_gpt:loss",
            "data": {"kwargs": {"vocab_size": SMOKE_MODEL["vocab_size"], "seq_len": SMOKE_MODEL["seq_len"]}},
            "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}},
            "global_batch_size": 8, "micro_batch_size": 4, "max_steps": STEPS, "steps_per_round": 2,
            # min_workers = the world: the run waits for the replacement started in the lost rank's bundle.
            "scaling": {"min_workers": workers, "max_workers": workers},
            "checkpoint": {"every_n_steps": EVERY},
            "timeouts": {"capacity_wait_s": 240},
            "chaos": [{"fault": "device_error", "at_step": FAULT_STEP, "rank": rank}],
            "run_dir": run_dir}


def surfaced_in(error: str) -> str | None:
    """The innermost frame of the traceback the worker sent (where CUDA reported the error)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', error)
    return f"{Path(frames[-1][0]).name}:{frames[-1][1]} {frames[-1][2]}" if frames else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--timeout", type=float, default=480, help="give up (exit 3) after this many seconds")
    args = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_errors: this check needs a CUDA GPU (torch.cuda.is_available() is False here); "
              "run it with --smoke to check the script and the path on CPU", file=sys.stderr)
        return 2

    def give_up():
        print(f"gpu_errors: no result within --timeout {args.timeout:.0f}s", file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(args.timeout, give_up)
    timer.daemon = True
    timer.start()

    import ray

    import airay
    from airay.events import read_jsonl

    gpu = not args.smoke
    workers, rank = (1, 0) if gpu else (2, 1)
    run_dir = Path(tempfile.mkdtemp(prefix="airay-gpu-errors-")) / "run"
    ray.init(num_cpus=4 if gpu else workers + 1, num_gpus=1 if gpu else 0, include_dashboard=False,
             logging_level="WARNING")
    t0 = time.time()
    result = airay.fit(airay.JobConfig.from_dict(job(str(run_dir), workers, rank)), echo=False)
    wall_s = time.time() - t0
    events = read_jsonl(run_dir / "events.jsonl")
    actors = {a["Pid"]: a for a in ray.state.actors().values() if a["ActorClassName"] == "TrainWorker"}
    ray.shutdown()

    failed = [e for e in events if e["type"] in ("worker_failed", "node_lost")]
    formed = [e for e in events if e["type"] == "world_formed"]
    first = failed[0] if failed else {}
    broken = formed[0]["workers"][rank]["pid"] if formed else None
    after = [f for f in formed if first and f["ts"] > first["ts"]]
    later_pids = [w["pid"] for f in after for w in f["workers"]]
    dead = actors.get(broken, {})
    checks = {
        "classified": bool(first) and first.get("rank") == rank and first.get("outcome") in ("gpu_error", "died"),
        "replaced": bool(after) and broken not in later_pids and dead.get("State") == "DEAD"
        and dead.get("EndTime", 0) / 1000 < after[0]["ts"] and len(later_pids) >= workers,
        "finished": result.status == "finished" and result.final_step == STEPS,
    }
    out = {
        "gpu": torch.cuda.get_device_name(0) if cuda and gpu else None, "smoke": args.smoke,
        "torch": torch.__version__, "ray": ray.__version__, "steps": STEPS, "fault_step": FAULT_STEP,
        "outcome": first.get("outcome"), "phase": first.get("phase"), "step": first.get("step"),
        "error": (first.get("error") or "").split("\n")[0], "surfaced_in": surfaced_in(first.get("error") or ""),
        "failed_pid": broken, "failed_pid_killed_before_next_world": checks["replaced"],
        "new_pids": sorted(set(later_pids) - {w["pid"] for w in formed[0]["workers"]}) if formed else [],
        "devices_after": sorted({str(w.get("device")) for f in after for w in f["workers"]}),
        "recovery_s": next((e["recovery_s"] for e in events if e["type"] == "resize_finished"), None),
        "status": result.status, "final_step": result.final_step, "restarts": result.restarts,
        "run_error": result.error, "wall_s": round(wall_s, 1), "run_dir": str(run_dir), "checks": checks,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if out["outcome"] == "died":
        print("gpu_errors: the process ended before its worker could name the error (outcome died): still "
              "infrastructure and replaced, but not classified by airay.worker.failures", file=sys.stderr)
    bad = [name for name, ok in checks.items() if not ok]
    print("gpu_errors: " + ("ok" if not bad else f"FAILED: {', '.join(bad)}"), file=sys.stderr, flush=True)
    timer.cancel()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

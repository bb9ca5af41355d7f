"""What a run directory says about a run, read once for `airay status` (text) and `airay plot` (PNG).

Works on a finished run and on one still going (the files are appended line by line).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from airay import goodput
from airay.events import read_jsonl
from airay.observe.console import duration

FAULT_EVENTS = ("worker_failed", "node_lost", "hang_detected", "data_block_lost", "driver_restarted",
                "checkpoint_failed")


@dataclass
class RunView:
    run_dir: Path
    name: str
    max_steps: int | None
    status: str  # running | finished | failed
    t0: float  # run_started ts; times below are seconds from it
    metrics: list[dict[str, Any]]  # every record, replays included, in order
    kept: dict[int, dict[str, Any]]  # step -> the record it was kept by
    faults: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    resizes: list[dict[str, Any]] = field(default_factory=list)
    goodput: goodput.Goodput | None = None
    restarts: int = 0
    error: str | None = None
    queue: dict[str, Any] | None = None  # under the cluster's scheduler: its last word on the job's size


def load(run_dir: str | os.PathLike) -> RunView:
    run_dir = Path(run_dir)
    if not (run_dir / "events.jsonl").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no events.jsonl); give the directory "
                                "`airay run` printed, e.g. runs/demo-20261202-192830")
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    started = next((e["ts"] for e in events if e["type"] == "run_started"), events[0]["ts"] if events else 0.0)
    # A resumed run directory: the status is the latest run's (an end before it was an earlier run's).
    latest = max([e["ts"] for e in events if e["type"] == "run_started"], default=started)
    ends = [e for e in events if e["type"] in ("run_finished", "run_failed") and e["ts"] >= latest]
    status = "running" if not ends else ("finished" if ends[-1]["type"] == "run_finished" else "failed")
    error = ends[-1].get("error") if ends and status == "failed" else None
    result_file = run_dir / "result.json"
    if error is None and status == "failed" and result_file.is_file():
        error = json.loads(result_file.read_text()).get("error")
    return RunView(
        run_dir=run_dir, name=config.get("name", run_dir.name), max_steps=config.get("max_steps"), status=status,
        t0=started, metrics=metrics, kept=goodput.kept_records(metrics),
        faults=[e for e in events if e["type"] in FAULT_EVENTS],
        checkpoints=[e for e in events if e["type"] == "checkpoint_saved"],
        resizes=[e for e in events if e["type"] == "resize_finished"],
        goodput=goodput.compute(events, metrics, end_ts=time.time() if status == "running" else None),
        restarts=sum(1 for e in events if e["type"] == "resize_started" and e.get("reason") == "failure"),
        error=error, queue=next((e for e in reversed(events) if e["type"] == "queue_target"), None))


def durable_step(view: RunView) -> int | None:
    steps = [e["step"] for e in view.checkpoints if e.get("tier", "durable") == "durable"]
    return max(steps) if steps else None


def eta_s(view: RunView, window: int = 20) -> float | None:
    """Time left at the pace of the last `window` committed steps: the median time between their
    ends, so a recovery among them (one long gap) does not count as the pace."""
    import statistics

    ends = sorted(m["ts"] for m in view.kept.values())[-window:]
    if view.max_steps is None or len(ends) < 2:
        return None
    done = max(view.kept) + 1
    return max(0, view.max_steps - done) * statistics.median(b - a for a, b in zip(ends, ends[1:]))


def status_dict(view: RunView) -> dict[str, Any]:
    """`airay status --json`: the run's state as the text shows it, as values."""
    last = view.metrics[-1] if view.metrics else {}
    g = view.goodput
    return {"run_dir": str(view.run_dir), "name": view.name, "status": view.status,
            "step": max(view.kept) + 1 if view.kept else 0, "max_steps": view.max_steps,
            "loss": last.get("loss"), "world_size": last.get("world_size"), "tokens_per_s": last.get("tokens_per_s"),
            "samples_per_s": last.get("samples_per_s"),
            "eta_s": eta_s(view) if view.status == "running" else None, "durable_step": durable_step(view),
            "last_fault": {**view.faults[-1], "text": fault_text(view.faults[-1])} if view.faults else None,
            "restarts": view.restarts, "goodput": g.goodput if g else None,
            "wall_s": g.wall_s if g else None, "time_lost_s": g.lost_s if g else None,
            "resizes": [{k: r.get(k) for k in ("step", "old_world_size", "new_world_size", "reason", "recovery_s")}
                        for r in view.resizes], "error": view.error,
            "queue": {k: view.queue.get(k) for k in ("job_id", "target", "state", "reason")} if view.queue else None}


def resize_text(r: dict[str, Any]) -> str:
    return (f"resize {r['old_world_size']} -> {r['new_world_size']} ({r.get('reason')}) at step "
            f"{r.get('resumed_step')}: recovery {r['recovery_s']:.2f}s")


def lost_text(lost_s: dict[str, float]) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in lost_s.items() if round(v, 1))


def checkpoint_text(saved: list[dict[str, Any]]) -> str:
    """Per tier: the newest step saved there and how many saves; the durable one is what survives
    the cluster."""
    parts = []
    for tier in ("durable", "memory"):
        steps = [e["step"] for e in saved if e.get("tier", "durable") == tier]
        parts.append(f"{tier} {len(steps)} (newest step {steps[-1]})" if steps else f"{tier} none")
    return ", ".join(parts)


def fault_text(f: dict[str, Any]) -> str:
    if f["type"] == "driver_restarted":
        return f"driver restarted ({f.get('attempt')}) after {f.get('previous_exit')}"
    if f["type"] == "checkpoint_failed":
        return f"checkpoint_failed {f.get('tier')} step {f.get('step')}: {str(f.get('error', ''))[:80]}"
    phase = f" in {f['phase']}" if f.get("phase") not in (None, "round") else ""
    return f"{f['type']} rank {f.get('rank')} at step {f.get('step')}{phase}"


def status_text(view: RunView) -> str:
    """The run as a few plain lines: progress, throughput, world, goodput and where time went."""
    g = view.goodput
    last = view.metrics[-1] if view.metrics else None
    step = max(view.kept) + 1 if view.kept else 0
    durable = durable_step(view)
    lines = [f"run {view.name} ({view.run_dir}): {view.status}, step {step}/{view.max_steps or '?'}, "
             f"wall {g.wall_s:.1f}s" + (f", eta {duration(eta_s(view))}" if view.status == "running" else "")
             + f", newest durable step {durable if durable is not None else 'none'}"]
    if view.queue:
        q = view.queue
        lines.append(f"scheduler: job {q['job_id']} {q['state']}, target {q['target']}: {q['reason']}")
    if view.faults:
        lines.append(f"last fault at {view.faults[-1]['ts'] - view.t0:.1f}s: {fault_text(view.faults[-1])}")
    if last is not None:
        tokens = f", tokens/s {last['tokens_per_s']:.0f}" if last.get("tokens_per_s") else ""
        split = ""
        if last.get("compute_s") is not None:
            split = (f" (compute {last['compute_s']:.3f}s, communication {last['comm_s']:.3f}s, "
                     f"data wait {last['data_wait_s']:.3f}s)")
        lines.append(f"last step {last['step']}: loss {last['loss']:.4f}, world {last['world_size']}, "
                     f"samples/s {last['samples_per_s']:.1f}{tokens}, step time {last['step_time_s']:.3f}s{split}")
    lines.append(f"goodput {g.goodput:.2f}: kept steps {g.kept_step_s:.1f}s of {g.wall_s:.1f}s; "
                 f"lost: {lost_text(g.lost_s)}")
    lines.append(f"restarts {view.restarts}, replayed step executions {g.replayed_steps}, "
                 f"checkpoints: {checkpoint_text(view.checkpoints)}")
    timeline = [(f["ts"], fault_text(f)) for f in view.faults]
    timeline += [(r["ts"], resize_text(r)) for r in view.resizes]
    for ts, text in sorted(timeline):
        lines.append(f"  {ts - view.t0:7.1f}s  {text}")
    if view.error:
        lines.append(f"error: {view.error.splitlines()[0]}")
    return "\n".join(lines)

"""Goodput of a run, and where the rest of its wall time went — from its events and metrics.

goodput = time spent on steps that were kept / wall time. A step is kept by its last metrics
record; an earlier record of the same step is work that was thrown away by a rollback to an
older checkpoint and done again ("replayed_steps"). The rest of the wall time is split by cause:

- startup: the run's launch (the `airay run` process start, or the fit() call) until the first
  world is formed (driver imports, a local cluster's start, placement, actor start, engine build,
  loading a checkpoint to resume from).
- recovery: each resize window, from where the world stopped making progress (for a failure:
  the end of the last committed round before it was detected, so the cut round's work counts
  here; for a grow: the moment the grow began) until the new world is formed. A checkpoint
  taken inside the window is counted under checkpoint_blocking, not twice.
- replayed_steps: earlier executions of steps that were executed again after a rollback.
- checkpoint_blocking: the time training was held by checkpoint saves: `blocking_s` and
  `previous_commit_wait_s` of each save, and the steps' `checkpoint_wait_s` (an optimizer step
  waiting for the previous save's live writes), taken out of their step time. A save's
  `checkpoint_saved` event reports the three together as `held_s`.
- A run directory resumed by a later run of the same job holds several runs (one run_started
  each); wall time is the sum of their spans: the time between them, when no run of the job was
  going, is not lost time. Each run's start-up counts as startup.
- driver_restart: a supervised driver that died (airay.supervisor), from its last record until
  the restarted driver's world is formed. A restarted driver continues its run: the time it took
  to come back is the user's wait, not a gap between runs.
- other: the remainder — the driver's bookkeeping between rounds, waiting for the final
  checkpoint to commit, and rounding. It makes the causes add up to the wall time exactly.

One pure function used by result.json, `airay status` and the plot, so they always agree.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from airay.events import read_jsonl

CAUSES = ("startup", "recovery", "replayed_steps", "checkpoint_blocking", "driver_restart", "other")


@dataclass
class Goodput:
    wall_s: float
    kept_step_s: float
    goodput: float
    lost_s: dict[str, float] = field(default_factory=dict)
    kept_steps: int = 0
    replayed_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kept_records(metrics: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The record each step was kept by: its last one (a replayed step's later line wins)."""
    return {m["step"]: m for m in sorted(metrics, key=lambda m: m.get("ts", 0.0))}


def work_s(record: dict[str, Any]) -> float:
    """A step's work: its time less any wait for the previous save's writes (checkpoint blocking)."""
    return record["step_time_s"] - (record.get("checkpoint_wait_s") or 0.0)


def kept_step_s(records: list[dict[str, Any]]) -> float:
    """Seconds of the steps that were kept (each step's last record; `step`, `step_time_s`, `ts`).
    The numerator of goodput for any trainer's step records: airay's metrics, or a baseline's
    (benchmarks/raytrain.py)."""
    return sum(work_s(m) for m in kept_records(records).values())


def run_start(event: dict[str, Any]) -> float:
    """When the run of a run_started event began: its launch, where the event carries it."""
    return min(event["ts"], event.get("launched_ts", event["ts"]))


def compute(events: list[dict[str, Any]], metrics: list[dict[str, Any]], end_ts: float | None = None) -> Goodput:
    """Goodput and lost time per cause. `end_ts`: the end of the run (default: its
    run_finished/run_failed event, else the last record seen — a run still going)."""
    spans = run_spans(events, metrics, end_ts)
    if not spans:
        return Goodput(0.0, 0.0, 0.0, {c: 0.0 for c in CAUSES})
    wall = sum(end - start for start, end in spans)

    kept = kept_records(metrics)
    kept_s = kept_step_s(metrics)
    replayed = len(metrics) - len(kept)
    replayed_s = sum(work_s(m) for m in metrics) - kept_s

    formed = [e["ts"] for e in events if e["type"] == "world_formed"]
    resizes = [e for e in events if e["type"] == "resize_finished"]
    starts = [e for e in events if e["type"] == "resize_started"]
    # A resize window starts where recovery_s starts (detection, or the start of a grow) and ends
    # when the new world is formed; recovery_s itself also holds the first step at the new size,
    # which is kept work, so the window ends at world_formed instead.
    windows = []
    for r in resizes:
        t0 = r["ts"] - r["recovery_s"]
        t1 = next((t for t in formed if t >= t0), r["ts"])
        if r.get("reason") == "failure":
            # Work of the round the failure cut short was lost too: start at the last progress.
            progress = [m["ts"] for m in metrics if m["ts"] <= t0] + [t for t in formed if t <= t0]
            if progress:
                t0 = max(progress)
        # The step the world was at when this resize began (its last resize_started).
        at_step = next((e.get("step") for e in reversed(starts) if e["ts"] <= r["ts"]), None)
        windows.append((t0, t1, r, at_step))
    startup = 0.0
    for start, end in spans:
        progress = [t for t in formed + [w[0] for w in windows] if start <= t <= end]
        startup += max(0.0, (min(progress) if progress else end) - start)

    saves = [e for e in events if e["type"] == "checkpoint_saved"]
    blocking = sum(save_held_s(e) for e in saves) + sum(m.get("checkpoint_wait_s") or 0.0 for m in metrics)
    recovery = 0.0
    for t0, t1, r, at_step in windows:
        inside = r.get("checkpoint_s", 0.0)  # a grow checkpoints first, inside its window
        if r.get("reason") == "failure":
            # The checkpoint at the step the failed round started from was saved after the last
            # progress mark and before the round: inside the window.
            inside = sum(save_held_s(e) for e in saves if e.get("step") == at_step)
        recovery += max(0.0, t1 - t0 - inside)

    restart = 0.0
    records = [e["ts"] for e in events] + [m["ts"] for m in metrics]
    for e in events:
        if e["type"] == "driver_restarted":
            # From the dead driver's last record (its death, as near as the files tell) until
            # the restarted driver's world is formed.
            t0 = max([t for t in records if t < e["ts"]], default=e["ts"])
            t1 = next((t for t in formed if t >= e["ts"]), e["ts"])
            restart += max(0.0, t1 - t0)

    lost = {"startup": startup, "recovery": recovery, "replayed_steps": replayed_s,
            "checkpoint_blocking": blocking, "driver_restart": restart}
    lost["other"] = max(0.0, wall - kept_s - sum(lost.values()))
    return Goodput(wall_s=wall, kept_step_s=kept_s, goodput=kept_s / wall if wall > 0 else 0.0,
                   lost_s={c: lost[c] for c in CAUSES}, kept_steps=len(kept), replayed_steps=replayed)


def save_held_s(event: dict[str, Any]) -> float:
    """What a save held the step loop for, besides the next step's checkpoint_wait_s (counted
    from the metrics): the collective save call and any wait for the previous save's commit."""
    return event.get("blocking_s", 0.0) + event.get("previous_commit_wait_s", 0.0)


def run_spans(events: list[dict[str, Any]], metrics: list[dict[str, Any]],
              end_ts: float | None = None) -> list[tuple[float, float]]:
    """(start, end) of each run recorded in a run directory, in order. A run ends at its
    run_finished/run_failed event; one killed without either ends at its last record before the
    next run started. `end_ts` ends the last run (one still going)."""
    # A restarted driver's run_started continues its run (see driver_restart).
    starts = [run_start(e) for e in events if e["type"] == "run_started" and not e.get("driver_restart")]
    records = [e["ts"] for e in events] + [m["ts"] for m in metrics]
    ends = [e["ts"] for e in events if e["type"] in ("run_finished", "run_failed")]
    spans = []
    for i, start in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < len(starts) else float("inf")
        if nxt == float("inf") and end_ts is not None:
            end = end_ts
        else:
            mine = [t for t in ends if start <= t < nxt]
            end = mine[-1] if mine else max([start] + [t for t in records if start <= t < nxt])
        spans.append((start, max(start, end)))
    return spans


def of_run(run_dir: str | os.PathLike, live: bool = False) -> Goodput:
    """compute() on a run directory; `live`: the run is still going, so it ends now."""
    run_dir = Path(run_dir)
    return compute(read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "metrics.jsonl"),
                   end_ts=time.time() if live else None)

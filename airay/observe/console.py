"""What a person sees of a run: the start, a progress line per round, one short line per fault,
recovery and grow, a checkpoint line only when one fails, and the end.

events.jsonl keeps every event whole; the console shows the few that tell the story, rendered in
human units with short node names (`verbose` prints every event, bounded, as `[airay] TYPE k=v`).
Every line is at most LINE_MAX characters whatever the world size. Where stdout is a terminal
the progress line is a tqdm bar redrawn in place and the other lines print above it; in a log
file or under `ray job submit` each progress update is a plain line.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from airay.events import console_line

LINE_MAX = 200
NODE_CHARS = 8  # a node id as `ray list nodes` users recognise it: its first characters, like a git hash
PREFIX = "[airay]"


@dataclass(frozen=True)
class Progress:
    """A round's end, as the progress line shows it."""
    step: int  # steps done
    max_steps: int
    loss: float
    tokens_per_s: float | None
    samples_per_s: float
    world_size: int
    eta_s: float | None
    durable_step: int | None  # the newest step a restart would resume from


def short_node(node_id: Any) -> str:
    return str(node_id)[:NODE_CHARS] if node_id else "?"


def first_line(text: Any, limit: int = 100) -> str:
    line = str(text or "").strip().split("\n")[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def bounded(line: str, limit: int = LINE_MAX) -> str:
    """One console line: newlines folded, at most `limit` characters."""
    line = " ".join(line.split("\n"))
    return line if len(line) <= limit else line[:limit - 3] + "..."


def duration(seconds: float | None) -> str:
    """Seconds as a person reads them: 0.82s, 32s, 1m11s, 2h05m."""
    import math

    if seconds is None or not math.isfinite(seconds):
        return "?"
    if seconds < 10:
        return "0s" if seconds < 0.005 else f"{seconds:.2f}s" if seconds < 1 else f"{seconds:.1f}s"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def rate(value: float) -> str:
    """3141 -> 3.1k, 1.2e6 -> 1.2M."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"


def progress_text(p: Progress) -> str:
    parts = [f"step {p.step}/{p.max_steps}", f"loss {p.loss:.4f}"]
    parts.append(f"{rate(p.tokens_per_s)} tokens/s" if p.tokens_per_s else f"{p.samples_per_s:.1f} samples/s")
    parts += [f"world {p.world_size}", f"eta {duration(p.eta_s)}"]
    if p.durable_step is not None:
        parts.append(f"saved {p.durable_step}")
    return " | ".join(parts)


def _at(e: dict[str, Any]) -> str:
    return f"step {e['step']}: " if e.get("step") is not None else ""


def _rank_on(e: dict[str, Any]) -> str:
    return f"rank {e.get('rank')} on node {short_node(e.get('node_id'))}"


def _lost(e: dict[str, Any]) -> str:
    what = {"worker_failed": "failed", "node_lost": "lost: its node is gone", "hang_detected": "hung",
            "worker_preempted": "preempted", "data_block_lost": "lost a data block"}[e["type"]]
    how = e.get("outcome") or e.get("phase")
    detail = f" ({how})" if how and how not in ("died", "round") else ""
    # a lost node's actors fail with Ray's RPC errors, which say nothing more
    error = f": {first_line(e.get('error'))}" if e.get("error") and e["type"] != "node_lost" else ""
    return f"{_at(e)}{_rank_on(e)} {what}{detail}{error}"


def _world_formed(e: dict[str, Any], first: bool) -> str | None:
    if not first:
        return None  # a resize's world: resize_finished says it
    workers = e.get("workers") or []
    nodes = len({w.get("node_id") for w in workers})
    plan = e.get("plan") or {}
    return (f"world of {e.get('world_size')} on {nodes} node{'s' * (nodes != 1)}: micro-batch "
            f"{plan.get('micro_batch_size')} x {plan.get('grad_accum_steps')} accumulation steps, formed in "
            f"{duration(e.get('join_s'))}")


def _budget(e: dict[str, Any]) -> str | None:
    if e.get("action") != "skipped":
        return None  # dropped old steps or peer copies: the tier kept working
    return f"{_at(e)}checkpoint skipped, the memory tier is full: {first_line(e.get('reason'))}"


# Event type -> its line (None: events.jsonl only). Types not listed print bounded, as in verbose.
RENDER: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "run_started": lambda e: f"run directory {os.path.abspath(e.get('run_dir') or '.')}, {e.get('max_steps')} steps of "
                             f"{e.get('global_batch_size')} samples",
    "resuming": lambda e: f"resuming from step {e.get('step')} ({e.get('tier')} checkpoint)",
    "driver_restarted": lambda e: f"driver restarted (attempt {e.get('attempt')}) after {e.get('previous_exit')}",
    "worker_failed": _lost, "node_lost": _lost, "hang_detected": _lost, "worker_preempted": _lost,
    "data_block_lost": _lost,
    "worker_start_failed": lambda e: f"{_at(e)}a worker did not start: {first_line(e.get('error'))}",
    "fault_injected": lambda e: f"{_at(e)}chaos: {e.get('fault')}"
                                + (f" (rank {e['rank']})" if e.get("rank") is not None else ""),
    "fault_skipped": lambda e: f"{_at(e)}chaos: {e.get('fault')} skipped: {first_line(e.get('reason'))}",
    "node_added": lambda e: f"{_at(e)}node {short_node(e.get('node_id'))} added",
    "node_excluded": lambda e: f"{_at(e)}node {short_node(e.get('node_id'))} excluded after "
                               f"{e.get('failures')} failures",
    "waiting_for_capacity": lambda e: f"{_at(e)}waiting up to {duration(e.get('timeout_s'))} for room: "
                                      f"{e.get('have')} workers, {e.get('need')} needed",
    "restart_backoff": lambda e: f"{_at(e)}{e.get('failures_in_window')} failures lately: waiting "
                                 f"{duration(e.get('wait_s'))} before the next try",
    "straggler_detected": lambda e: f"{_at(e)}{_rank_on(e)} is slow: {duration(e.get('local_s'))} a step "
                                    f"against {duration(e.get('median_local_s'))}",
    "data_stall": lambda e: f"{_at(e)}the ranks waited for data {e.get('max_share', 0):.0%} of a step "
                            f"({duration(e.get('max_data_wait_s'))})",
    "checkpoint_trust": lambda e: "note: checkpoints load through torch.load(weights_only=False) (DeepSpeed's "
                                  "format), which can run code: load only checkpoints you trust",
    "resize_started": lambda e: None,
    "resize_finished": lambda e: _resize_text(e),
    "checkpoint_failed": lambda e: f"{_at(e)}{e.get('tier')} checkpoint failed: {first_line(e.get('error'))}",
    "checkpoint_rejected": lambda e: f"{_at(e)}checkpoint file {e.get('file')} rejected ({e.get('reason')}), "
                                     "another copy used" if e.get("fell_back") else
                                     f"{_at(e)}checkpoint rejected: {first_line(e.get('reason'))}",
    "checkpoint_budget": _budget,
    "memory_tier_reduced": lambda e: "memory tier pruned to its newest step after a rank ran out of memory",
    "preemption_requested": lambda e: f"{_at(e)}preemption requested ({e.get('signal')}): saving a checkpoint",
    "preempted": lambda e: f"{_at(e)}preempted; checkpoint of step {e.get('checkpoint_step')} kept",
    "exported": lambda e: f"exported to {e.get('path')}",
    "export_failed": lambda e: f"export failed: {first_line(e.get('error'))}",
    "run_failed": lambda e: f"{_at(e)}failed: {first_line(e.get('error'), 160)}",
    "driver_failed": lambda e: f"{_at(e)}driver failed: {first_line(e.get('error'), 160)}",
    "run_finished": lambda e: None,  # the summary says it (airay run), as does fit's Result
    "queue_submitted": lambda e: f"queued as {e.get('job_id')} (team {e.get('team')}, priority {e.get('priority')})",
    "queue_target": lambda e: f"{_at(e)}scheduler: {e.get('state')}, target {e.get('target')}: "
                              f"{first_line(e.get('reason'), 120)}",
    "queue_unreachable": lambda e: f"{_at(e)}the scheduler did not answer: keeping target {e.get('target')}",
    "suspended": lambda e: f"{_at(e)}suspended by the scheduler, checkpoint of step {e.get('checkpoint_step')} kept; "
                           "waiting to be readmitted",
}
QUIET = ("placement", "workers_placed", "placement_released", "world_formed", "worker_ready", "checkpoint_saved",
         "checkpoint_copied", "checkpoint_loaded", "checkpoint_ignored", "memory_budget", "incident_not_counted",
         "queued_round_dropped", "ray_message",
         # a checkpoint that went on (a write retried, an upload a newer durable step made moot)
         "checkpoint_retry", "checkpoint_upload_skipped")
for _type in QUIET:
    RENDER.setdefault(_type, lambda e: None)


def _resize_text(e: dict[str, Any]) -> str:
    from airay.runview import resize_text  # it imports this module (duration)

    return resize_text(e)


def every_field(event: dict[str, Any]) -> str:
    """An event as `-v` prints it (without the prefix): its type, step and fields, each bounded."""
    fields = {k: v for k, v in event.items() if k not in ("ts", "type", "step")}
    return console_line(event["type"], event.get("step"), fields)[len(PREFIX) + 1:]


def render(event: dict[str, Any], first_world: bool = False) -> str | None:
    """The default console's line for an event (without the prefix), or None."""
    if event["type"] == "world_formed":
        return _world_formed(event, first_world)
    fn = RENDER.get(event["type"])
    return every_field(event) if fn is None else fn(event)


class Console:
    def __init__(self, stream: TextIO | None = None, verbose: bool = False, interactive: bool | None = None):
        """`stream`: default sys.stdout as it is at each line (a caller may redirect it)."""
        self._stream = stream
        self.verbose = verbose
        self._interactive = interactive
        self._bar = None
        self._worlds = 0

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stdout

    @property
    def interactive(self) -> bool:
        if self._interactive is None:
            self._interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        return self._interactive

    def event(self, event: dict[str, Any]) -> None:
        if self.verbose:
            return self.line(every_field(event), limit=None)
        if event["type"] == "world_formed":
            self._worlds += 1
        text = render(event, first_world=self._worlds == 1)
        if text is not None:
            self.line(text)

    def line(self, text: str, limit: int | None = LINE_MAX) -> None:
        """`limit` None: as given (verbose: console_line bounds each field, a traceback keeps its lines)."""
        line = bounded(f"{PREFIX} {text}", limit) if limit else f"{PREFIX} {text}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def progress(self, p: Progress) -> None:
        if not self.interactive:
            return self.line(progress_text(p))
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=p.max_steps, file=self.stream, dynamic_ncols=True, leave=True,
                             bar_format="{desc} {bar} {n_fmt}/{total_fmt} {postfix}")
            self._bar.set_description_str(PREFIX, refresh=False)
        self._bar.n = p.step  # a replayed step goes back: the bar shows where training is
        self._bar.set_postfix_str(progress_text(p).split(" | ", 1)[1], refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

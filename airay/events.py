"""The run directory: resolved config, events.jsonl, metrics.jsonl, result.json.

Lines are appended and flushed as they happen, so a crashed driver still leaves a readable
record, and `tail -f` (or a notebook) can follow a live run.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

# step_time_s = data_wait_s + compute_s + comm_s (the slowest rank's split, see airay.commtime);
# tokens_per_s is null for batches without token ids.
METRIC_FIELDS = ("step", "loss", "world_size", "global_batch_size", "samples_per_s", "step_time_s",
                 "data_wait_s", "compute_s", "comm_s", "tokens_per_s", "ts")


class RunRecorder:
    """Writes the run directory's records; with `echo`, shows the run on the console
    (airay.observe.console: the story by default, every event with `verbose`)."""

    def __init__(self, run_dir: str | os.PathLike, echo: bool = True, verbose: bool = False):
        from airay.observe.console import Console

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.console = Console(verbose=verbose) if echo else None
        self._lock = threading.Lock()  # Ray's message thread records too (airay.observe.ray_output)
        self._events = open(self.run_dir / "events.jsonl", "a", buffering=1)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)

    def write_config(self, yaml_text: str) -> None:
        (self.run_dir / "config.yaml").write_text(yaml_text)

    def event(self, type_: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "type": type_}
        if step is not None:
            record["step"] = step
        record.update(fields)
        with self._lock:
            self._events.write(json.dumps(record) + "\n")
            if self.console is not None:
                self.console.event(record)
        return record

    def metric(self, **fields: Any) -> None:
        missing = [f for f in METRIC_FIELDS if f not in fields]
        if missing:
            raise ValueError(f"metric record lacks {missing}")
        self._metrics.write(json.dumps(fields) + "\n")

    def progress(self, progress) -> None:
        """A round's end (an airay.observe.console.Progress)."""
        if self.console is not None:
            self.console.progress(progress)

    def write_result(self, result: dict[str, Any]) -> None:
        tmp = self.run_dir / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, self.run_dir / "result.json")

    def close(self) -> None:
        if self.console is not None:
            self.console.close()
        self._events.close()
        self._metrics.close()


# The console shows each event on a line a person reads, whatever the world size (events.jsonl
# keeps the whole record): a list shows its first CONSOLE_ITEMS items and how many more, a dict
# its first CONSOLE_KEYS entries, a collection nested deeper than CONSOLE_DEPTH its size, a
# line of text its first CONSOLE_TEXT characters; workers (dicts with a node_id) are counted.
CONSOLE_ITEMS, CONSOLE_KEYS, CONSOLE_DEPTH, CONSOLE_TEXT = 3, 8, 2, 300


def console_line(type_: str, step: int | None, fields: dict[str, Any]) -> str:
    """An event as the console shows it: `[airay] TYPE step=S key=value ...`, of bounded length."""
    detail = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
    return f"[airay] {type_}" + (f" step={step}" if step is not None else "") + (f" {detail}" if detail else "")


def _short(v: Any, depth: int = 0) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, str):
        text = "\n".join(line if len(line) <= CONSOLE_TEXT else f"{line[:CONSOLE_TEXT]}... (+{len(line) - CONSOLE_TEXT} "
                         "chars)" for line in v.split("\n"))
        return text if depth == 0 else repr(text)
    if isinstance(v, dict):
        if depth >= CONSOLE_DEPTH:
            return f"{{{len(v)} keys}}"
        shown = [f"{k!r}: {_short(x, depth + 1)}" for k, x in list(v.items())[:CONSOLE_KEYS]]
        return "{" + ", ".join(shown + _more(len(v), CONSOLE_KEYS)) + "}"
    if isinstance(v, (list, tuple, set, frozenset)):
        items = list(v)
        if items and all(isinstance(i, dict) and "node_id" in i for i in items):
            return f"{len(items)} on {len({i['node_id'] for i in items})} node(s)"
        if depth >= CONSOLE_DEPTH:
            return f"[{len(items)} items]"
        shown = [_short(x, depth + 1) for x in items[:CONSOLE_ITEMS]]
        return "[" + ", ".join(shown + _more(len(items), CONSOLE_ITEMS)) + "]"
    return _short(str(v), depth) if depth == 0 else repr(v)


def _more(n: int, shown: int) -> list[str]:
    return [f"(+{n - shown} more)"] if n > shown else []


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a JSONL file, also of one a live process is writing: every writer ends a
    record with a newline, so a last line without one (being written, or cut by a kill) is left out."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def committed_losses(run_dir: str | os.PathLike) -> dict[int, float]:
    """Loss per step as finally committed: a replayed step's later record wins."""
    return {m["step"]: m["loss"] for m in read_jsonl(Path(run_dir) / "metrics.jsonl")}


def process_start_ts() -> float | None:
    """When this process started (psutil; None where it cannot tell): start-up counts from here."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:
        return None

"""The run directory: resolved config, events.jsonl, metrics.jsonl, result.json.

Lines are appended and flushed as they happen, so a crashed driver still leaves a readable
record, and `tail -f` (or a notebook) can follow a live run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# step_time_s = data_wait_s + compute_s + comm_s (the slowest rank's split, see airay.commtime);
# tokens_per_s is null for batches without token ids.
METRIC_FIELDS = ("step", "loss", "world_size", "global_batch_size", "samples_per_s", "step_time_s",
                 "data_wait_s", "compute_s", "comm_s", "tokens_per_s", "ts")


class RunRecorder:
    def __init__(self, run_dir: str | os.PathLike, echo: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.echo = echo
        self._events = open(self.run_dir / "events.jsonl", "a", buffering=1)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a", buffering=1)

    def write_config(self, yaml_text: str) -> None:
        (self.run_dir / "config.yaml").write_text(yaml_text)

    def event(self, type_: str, step: int | None = None, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "type": type_}
        if step is not None:
            record["step"] = step
        record.update(fields)
        self._events.write(json.dumps(record) + "\n")
        if self.echo:
            detail = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
            print(f"[airay] {type_}" + (f" step={step}" if step is not None else "") + (f" {detail}" if detail else ""),
                  flush=True)
        return record

    def metric(self, **fields: Any) -> None:
        missing = [f for f in METRIC_FIELDS if f not in fields]
        if missing:
            raise ValueError(f"metric record lacks {missing}")
        self._metrics.write(json.dumps(fields) + "\n")

    def progress(self, line: str) -> None:
        if self.echo:
            print(line, file=sys.stdout, flush=True)

    def write_result(self, result: dict[str, Any]) -> None:
        tmp = self.run_dir / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, self.run_dir / "result.json")

    def close(self) -> None:
        self._events.close()
        self._metrics.close()


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


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

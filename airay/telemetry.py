"""Live metrics of a run: Ray's metrics (Prometheus endpoint, dashboard), TensorBoard, and the
progress line on the driver.

The controller calls `Telemetry.step` once per committed step. Ray metrics are tagged by run
name, so several runs on one cluster stay apart; Ray exports them as `ray_airay_<name>` on each
node's metrics port. TensorBoard events go to
RUN_DIR/tensorboard; a replayed step is written again with the same step number, and
TensorBoard's reader drops the orphaned later points of the earlier execution on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# metrics.jsonl field -> (Ray gauge name, description). The same names, under "airay/", in TensorBoard.
GAUGES = {
    "loss": ("airay_loss", "training loss of the last committed step"),
    "samples_per_s": ("airay_samples_per_s", "global samples per second of the last step"),
    "tokens_per_s": ("airay_tokens_per_s", "global tokens per second of the last step"),
    "step_time_s": ("airay_step_time_s", "wall time of the last step (slowest rank)"),
    "compute_s": ("airay_compute_s", "part of the last step spent computing"),
    "comm_s": ("airay_comm_s", "part of the last step blocked in collectives"),
    "data_wait_s": ("airay_data_wait_s", "part of the last step waiting for data"),
    "world_size": ("airay_world_size", "workers in the world"),
    "step": ("airay_step", "last committed step"),
}
RUN_GAUGES = {
    "restarts": ("airay_restarts", "failures recovered from so far"),
    "goodput": ("airay_goodput", "kept step time / wall time so far"),
}


class Pace:
    """Seconds per step for the ETA, smoothed over resizes: a round that began a new world
    (its recovery or grow inside) does not count, and a world of another size starts from the
    last pace scaled by the size ratio (the global batch is fixed: fewer ranks, longer steps)
    until its own rounds are measured. An exponential mean of steady rounds' wall per step,
    the driver's own time between rounds included."""

    def __init__(self, weight: float = 0.3):
        self.weight = weight
        self.s_per_step: float | None = None
        self.world_size: int | None = None

    def round(self, steps: int, seconds: float, world_size: int, steady: bool) -> None:
        if steps <= 0 or seconds <= 0:
            return
        if self.s_per_step is not None and world_size != self.world_size:
            self.s_per_step *= self.world_size / world_size
        self.world_size = world_size
        if not steady and self.s_per_step is not None:
            return
        pace = seconds / steps
        self.s_per_step = pace if self.s_per_step is None else \
            self.weight * pace + (1 - self.weight) * self.s_per_step

    def eta_s(self, remaining_steps: int) -> float | None:
        return None if self.s_per_step is None else max(0, remaining_steps) * self.s_per_step


class Telemetry:
    def __init__(self, run_name: str, run_dir: str | Path, ray_metrics: bool = True, tensorboard: bool = True):
        self.tags = {"run": run_name}
        self._gauges: dict[str, Any] = {}
        if ray_metrics:
            from ray.util.metrics import Gauge

            for key, (name, desc) in {**GAUGES, **RUN_GAUGES}.items():
                self._gauges[key] = Gauge(name, desc, tag_keys=("run",))
        self._tb = None
        if tensorboard:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard.writer import FileWriter

            self._tb = FileWriter(str(Path(run_dir) / "tensorboard"), flush_secs=5)
            self._summary = Summary

    def step(self, record: dict[str, Any], restarts: int, goodput: float) -> None:
        """One committed step (a metrics.jsonl record) plus the run-level counters at that point."""
        values = {k: record.get(k) for k in GAUGES}
        values.update(restarts=restarts, goodput=goodput)
        values = {k: float(v) for k, v in values.items() if v is not None}
        for key, value in values.items():
            if key in self._gauges:
                self._gauges[key].set(value, tags=self.tags)
        if self._tb is not None:
            # One event holds the step's scalars (what add_scalar writes, a simple_value per tag):
            # a seventh of the driver's CPU of one event per scalar.
            summary = self._summary(value=[self._summary.Value(tag=f"airay/{k}", simple_value=v)
                                           for k, v in values.items() if k != "step"])
            self._tb.add_summary(summary, record["step"], record.get("ts"))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None

"""The run as an MLflow run, the way MLflow users expect it.

On when the spec has `tracking.mlflow` or MLFLOW_TRACKING_URI is set (a server, `sqlite:///x.db`
or a file store such as `./mlruns`: no server needed). One airay run directory is one MLflow
run: its id is kept in RUN_DIR/mlflow.json, so a resumed run and a supervised driver's restart
continue the same MLflow run. What it holds:

- params: the resolved spec, flattened (`deepspeed.zero_optimization.stage`, ...);
- metrics per committed step, logged once a round in one batch: loss, tokens_per_s,
  samples_per_s, step_time_s, world_size, restarts, goodput so far. A replayed step is not
  logged again (its loss is the first execution's, exactly: airay replays the same samples in
  the same order); the restarted driver reads the newest logged step back from MLflow;
- at the end: goodput, wall_s and the time lost per cause as metrics, status, final step and
  error as tags, and result.json, config.yaml and the run's plot as artifacts.

Tracking never fails or slows the training: every call to MLflow runs on one thread of its own,
in order (a server that is slow or down, with MLflow's own retries, does not hold the driver's
loop; the end waits for it at most FINISH_WAIT_S); the first error is recorded
(`tracking_failed`) and tracking stops for the rest of the run.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from airay.config import ConfigError

STATE_FILE = "mlflow.json"
FINISH_WAIT_S = 60.0
STEP_METRICS = ("loss", "tokens_per_s", "samples_per_s", "step_time_s", "world_size")
PARAM_VALUE_MAX = 6000  # MLflow's limit on a param's value (characters)
BATCH_MAX = 100  # params per log_batch call (MLflow's limit); metrics allow 1000


def flatten(spec: Any, prefix: str = "") -> dict[str, str]:
    """A nested spec as MLflow params: dotted keys, string values, lists by index, None as ''."""
    out: dict[str, str] = {}
    if isinstance(spec, dict):
        for key, value in spec.items():
            out.update(flatten(value, f"{prefix}{key}."))
    elif isinstance(spec, list) and spec and all(isinstance(v, dict) for v in spec):
        for i, value in enumerate(spec):
            out.update(flatten(value, f"{prefix}{i}."))
    else:
        text = "" if spec is None else json.dumps(spec) if isinstance(spec, list) else str(spec)
        if len(text) > PARAM_VALUE_MAX:
            suffix = f"... ({len(text)} chars)"
            text = text[:PARAM_VALUE_MAX - len(suffix)] + suffix
        out[prefix.rstrip(".")] = text
    return out


def new_steps(records: list[dict[str, Any]], logged_through: int | None) -> list[dict[str, Any]]:
    """The records of steps not logged yet, once each (a replayed step was)."""
    out, seen = [], logged_through if logged_through is not None else -1
    for record in records:
        if record["step"] > seen:
            out.append(record)
            seen = record["step"]
    return out


def wanted(config) -> dict[str, str | None] | None:
    """Where to track, or None: the spec's tracking.mlflow, else MLFLOW_TRACKING_URI. Raises
    ConfigError (before Ray starts) where the variable asks for it and MLflow is not installed."""
    spec = config.tracking.mlflow
    uri = (spec.tracking_uri if spec else None) or os.environ.get("MLFLOW_TRACKING_URI")
    if spec is None and not uri:
        return None
    import importlib.util

    # A spec's tracking.mlflow is checked when the spec loads (config.MlflowSpec); this is the variable's.
    if spec is None and importlib.util.find_spec("mlflow") is None:
        raise ConfigError("MLFLOW_TRACKING_URI is set but MLflow is not installed: pip install 'airay[mlflow]' "
                          "(or unset MLFLOW_TRACKING_URI)")
    return {"tracking_uri": uri,
            "experiment": (spec.experiment if spec else None) or os.environ.get("MLFLOW_EXPERIMENT_NAME")
            or config.name,
            "run_name": spec.run_name if spec else None}


class MlflowTracker:
    def __init__(self, where: dict[str, str | None], run_dir: str | os.PathLike, recorder):
        self.where, self.run_dir, self.rec = where, Path(run_dir), recorder
        self.client = None
        self.run_id: str | None = None
        self.logged_through: int | None = None
        self.failed = False
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="airay-mlflow", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            what, fn, args = call
            if self.failed:
                continue
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - tracking never stops training
                self.failed = True
                self.rec.event("tracking_failed", backend="mlflow", action=what,
                               error=f"{type(exc).__name__}: {exc}"[:500], tracking_uri=self.where.get("tracking_uri"))

    def _guard(self, what: str, fn, *args) -> None:
        """Run `fn(*args)` on the tracking thread, after the calls before it."""
        self._calls.put((what, fn, args))

    def start(self, spec: dict[str, Any]) -> None:
        self._guard("start", self._start, spec)

    def _start(self, spec: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = self.where["tracking_uri"]
        if uri and urlparse(uri).scheme in ("", "file"):
            # A file store (./mlruns): MLflow 3 keeps it in maintenance and refuses it unless told
            # (MLFLOW_ALLOW_FILE_STORE); naming it is the user's telling.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        state_file = self.run_dir / STATE_FILE
        if state_file.is_file():
            self.run_id = json.loads(state_file.read_text())["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            history = self.client.get_metric_history(self.run_id, "loss")
            self.logged_through = max((m.step for m in history), default=None)
            return
        experiment = self.client.get_experiment_by_name(self.where["experiment"])
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            self.where["experiment"])
        run = self.client.create_run(experiment_id, run_name=self.where.get("run_name") or self.run_dir.name,
                                     tags={"airay.run_dir": str(self.run_dir.resolve())})
        self.run_id = run.info.run_id
        state_file.write_text(json.dumps({"run_id": self.run_id, "experiment_id": experiment_id,
                                          "tracking_uri": uri}))
        params = [Param(k, v) for k, v in flatten(spec).items()]
        for i in range(0, len(params), BATCH_MAX):
            self.client.log_batch(self.run_id, params=params[i:i + BATCH_MAX])

    def steps(self, records: list[dict[str, Any]], restarts: int, goodput: float) -> None:
        """A round's committed steps (metrics.jsonl records), in one call."""
        self._guard("log_steps", self._steps, records, restarts, goodput)

    def _steps(self, records: list[dict[str, Any]], restarts: int, goodput: float) -> None:
        from mlflow.entities import Metric

        fresh = new_steps(records, self.logged_through)
        if not fresh or self.run_id is None:
            return
        metrics = []
        for r in fresh:
            ts = int(r.get("ts", time.time()) * 1000)
            metrics += [Metric(k, float(r[k]), ts, r["step"]) for k in STEP_METRICS if r.get(k) is not None]
            metrics += [Metric("restarts", float(restarts), ts, r["step"]), Metric("goodput", goodput, ts, r["step"])]
        self.client.log_batch(self.run_id, metrics=metrics)
        self.logged_through = fresh[-1]["step"]

    def finish(self, result: dict[str, Any], status: str) -> None:
        """The run's end, then the thread's: waits for the calls queued (at most FINISH_WAIT_S)."""
        self._guard("finish", self._finish, result, status)
        self._calls.put(None)
        self._thread.join(FINISH_WAIT_S)

    def _finish(self, result: dict[str, Any], status: str) -> None:
        from mlflow.entities import Metric, RunTag

        if self.run_id is None:
            return
        ts, step = int(time.time() * 1000), int(result.get("final_step") or 0)
        metrics = [Metric(k, float(result[k]), ts, step) for k in ("goodput", "wall_s") if result.get(k) is not None]
        metrics += [Metric(f"time_lost_s.{k}", float(v), ts, step) for k, v in (result.get("time_lost_s") or {}).items()]
        tags = [RunTag("airay.status", status), RunTag("airay.final_step", str(step)),
                RunTag("airay.restarts", str(result.get("restarts"))),
                RunTag("airay.resizes", str(len(result.get("resizes") or [])))]
        if result.get("error"):
            tags.append(RunTag("airay.error", str(result["error"])[:5000]))
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)
        for name in ("result.json", "config.yaml"):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        try:
            from airay.plot import plot_run

            drawn = plot_run(self.run_dir)
            self.client.log_artifact(self.run_id, str(drawn["path"]))
        except Exception:  # noqa: BLE001 - a run with nothing to draw yet still ends its MLflow run
            pass
        if status != "driver_failed":  # its supervisor restarts the driver: the MLflow run goes on
            self.client.set_terminated(self.run_id, {"finished": "FINISHED", "preempted": "KILLED"}.get(status, "FAILED"))

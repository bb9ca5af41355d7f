"""The driver side of streamed data: check the dataset before any actor starts, then stream
each global step's rows through Ray Data and hand the controller one reference per step.

The feeder owns the data position. It runs a Ray Data pipeline over the windows of
airay.data.EpochLayout from any step on: each map task reads one window's rows (pyarrow, only
the row groups that hold them), shuffles them, runs the user's preprocessing and adds the
`sample_id` column. The driver never pulls the data: it iterates block references and cuts the
ordered row stream into global steps of exactly global_batch_size rows, each a list of
(block ref, first row, end row) pieces; workers fetch only their rank's rows. After a failure,
a resize or a driver restart, the pipeline restarts at the checkpoint's step, and step N gets
the same rows as before because they are a function of N alone.

Ray Data runs with num_cpus=0 tasks and a CPU limit of 0: training bundles hold every CPU of
the cluster, and a pipeline waiting for one would wait forever.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections import deque
from typing import Any

import numpy as np

from airay.config import JobConfig, resolve_callable
from airay.parquet import DataError, scan
from airay.reader import Stream, WindowAssembler, WindowReader, finish_batch, make_batch
from airay.sampling import EpochLayout, check_batch_schema, data_stalled

SCHEMA_PROBE_ROWS = 4
PIPELINE_RETRIES = 2  # pipeline failures per run tolerated before the run fails
# Pieces of one global step: (ObjectRef of a Ray Data block, first row, end row).
Piece = tuple[Any, int, int]


def model_input_schema(config: JobConfig) -> dict[str, tuple[str, tuple]] | None:
    """What the model declares it consumes: `input_schema(**model.kwargs)` in its factory's
    module, e.g. {'tokens': ('int', (seq_len + 1,))}. None when the module declares nothing."""
    factory = resolve_callable(config.model.factory)
    declare = getattr(sys.modules.get(factory.__module__), "input_schema", None)
    return declare(**config.model.kwargs) if callable(declare) else None


def prepare(config: JobConfig) -> tuple[JobConfig, Stream | None]:
    """Check a parquet dataset and resolve max_steps from it, before Ray is touched.

    Errors name the path, column or field: a missing path, an unreadable or non-parquet file, a
    missing column, an empty dataset, preprocessing that fails, and a preprocessed batch that
    does not fit the model's declared input schema (checked on the first rows).
    """
    spec = config.data
    if spec.source != "parquet":
        return config, None
    dataset = scan(spec.paths, spec.columns)
    layout = EpochLayout(dataset.rows, config.global_batch_size, spec.seed, spec.chunk_rows, spec.window_steps,
                         spec.shuffle)
    if layout.steps_per_epoch == 0:
        raise DataError(f"data.paths hold {dataset.rows} rows, fewer than global_batch_size "
                        f"{config.global_batch_size}: not one step per epoch; add data or lower global_batch_size")
    config = resolve_max_steps(config, layout.steps_per_epoch)
    stream = Stream(dataset, layout, spec.preprocess, spec.preprocess_kwargs, dataset.fingerprint,
                    spec.reader_cache_mb * 1024**2)
    probe = np.arange(min(SCHEMA_PROBE_ROWS, dataset.rows))
    check_probe(config, lambda: make_batch(dataset, probe, spec.preprocess, spec.preprocess_kwargs),
                f"the first rows of '{dataset.files[0].path}'")
    return config, stream


def prepare_dataset(config: JobConfig, ds) -> tuple[JobConfig, Stream]:
    """The same checks for a ray.data.Dataset passed to airay.fit (Ray is up: counting it runs
    its pipeline on the cluster, the rows stay there). Its row order must be deterministic."""
    spec = config.data
    if spec.columns:
        ds = ds.select_columns(spec.columns)
    rows = ds.count()
    if rows == 0:
        raise DataError("the dataset passed to airay.fit(dataset=...) holds no rows")
    # No random access: one chunk (rows keep the dataset's order), rows shuffled within windows.
    layout = EpochLayout(rows, config.global_batch_size, spec.seed, rows, spec.window_steps, spec.shuffle)
    if layout.steps_per_epoch == 0:
        raise DataError(f"the dataset holds {rows} rows, fewer than global_batch_size {config.global_batch_size}")
    config = resolve_max_steps(config, layout.steps_per_epoch)
    import hashlib

    fingerprint = hashlib.sha256(f"{rows}\0{ds.schema()}".encode()).hexdigest()[:16]
    stream = Stream(None, layout, spec.preprocess, spec.preprocess_kwargs, fingerprint)
    probe = ds.take_batch(min(SCHEMA_PROBE_ROWS, rows), batch_format="numpy")
    check_probe(config, lambda: finish_batch(dict(probe), np.arange(len(next(iter(probe.values())))),
                                             spec.preprocess, spec.preprocess_kwargs), "the dataset's first rows")
    return config, stream


def check_probe(config: JobConfig, build, where: str) -> None:
    spec = config.data
    try:
        batch = build()
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"data.preprocess '{spec.preprocess}' failed on {where}: {type(exc).__name__}: {exc}") from exc
    expected = model_input_schema(config)
    if expected is not None:
        problems = check_batch_schema(batch, expected)
        if problems:
            raise DataError(f"the data does not fit model '{config.model.factory}' (kwargs {config.model.kwargs}): "
                            + "; ".join(problems) + ". Fix data.columns / data.preprocess or the model kwargs")


def resolve_max_steps(config: JobConfig, steps_per_epoch: int) -> JobConfig:
    """max_steps from data.epochs (or checked against it); re-validated so chaos steps are too."""
    epochs = config.data.epochs
    max_steps = config.max_steps
    if epochs is not None:
        if max_steps is None:
            max_steps = epochs * steps_per_epoch
        elif max_steps > epochs * steps_per_epoch:
            raise DataError(f"max_steps {max_steps} exceeds data.epochs {epochs} x {steps_per_epoch} steps per "
                            "epoch; lower max_steps or raise data.epochs (or leave max_steps unset)")
    if max_steps == config.max_steps:
        return config
    return JobConfig.from_dict({**config.model_dump(mode="json"), "max_steps": max_steps})


class Feeder:
    """Streams the global steps of a run; `steps(start, end)` returns their pieces."""

    def __init__(self, stream: Stream, max_steps: int, capacity: int, readers: int = 2, dataset=None):
        self.stream, self.max_steps, self.capacity, self.readers = stream, max_steps, capacity, readers
        self.dataset = dataset  # a user's ray.data.Dataset (stream.dataset is None then)
        self._assembler = None
        self._cv = threading.Condition()
        self._ready: dict[int, list[Piece]] = {}
        self._low = 0         # steps below this were dropped (or never produced)
        self._produced = -1   # the highest step produced by the current pipeline
        self._done = False    # the current pipeline produced its last step
        self._error: BaseException | None = None
        self._generation = 0
        self._failures = 0
        self._thread: threading.Thread | None = None

    # ---- the controller's calls -------------------------------------------------------------

    def steps(self, start: int, end: int, extra: int = 0, timeout_s: float | None = None) -> dict[int, list[Piece]]:
        """Pieces of steps [start, end) (waits for them) plus up to `extra` later steps that are
        ready now. Steps before `start` are released: they are committed or will be replayed.
        A pipeline that fails, or does not produce the steps within `timeout_s`, is restarted
        from `start` up to PIPELINE_RETRIES times in the run; then the error (or TimeoutError)
        is raised: the driver never waits forever for a stalled pipeline."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            if self._thread is None or start < self._low:
                self._restart(start)
            for s in [s for s in self._ready if s < start]:
                del self._ready[s]
            self._low = start
            self._cv.notify_all()
            while not all(s in self._ready for s in range(start, end)):
                if self._error is not None:
                    if isinstance(self._error, DataError) or self._failures >= PIPELINE_RETRIES:
                        raise self._error
                    self._failures += 1  # e.g. a reader lost with its node: rebuild from here
                    self._restart(start)
                    continue
                if self._done:
                    raise RuntimeError(f"the data pipeline ended before step {end - 1}")
                if deadline is not None and time.monotonic() >= deadline:
                    self._error = TimeoutError(f"the data pipeline did not produce steps {start}-{end - 1} within "
                                               f"{timeout_s:g}s (data.pipeline_timeout_s)")
                    deadline = time.monotonic() + timeout_s  # for the restarted pipeline
                    continue
                self._cv.wait(1.0 if deadline is None else min(1.0, max(0.01, deadline - time.monotonic())))
            out = {s: self._ready[s] for s in range(start, end)}
            for s in range(end, end + extra):
                if s not in self._ready:
                    break
                out[s] = self._ready[s]
            return out

    def seek(self, step: int) -> None:
        """The next round starts at `step` (a world is forming): restart the pipeline there now
        if it is elsewhere, so its start-up overlaps the join and checkpoint load."""
        with self._cv:
            if self._thread is None or step < self._low or step > self._produced + 1:
                self._restart(step)

    def restart(self, step: int) -> None:
        """A fresh pipeline from `step` on, whatever this one holds: after a block of it could
        not be fetched (a data failure), its other blocks are not trusted either."""
        with self._cv:
            self._restart(step)

    def position(self, step: int) -> dict[str, Any]:
        return self.stream.position(step)

    def check_position(self, saved: dict[str, Any] | None, step: int) -> None:
        """A checkpoint's data position must be of this dataset, seed and batch."""
        now = self.position(step)
        if saved is None:
            raise DataError(f"the checkpoint of step {step} has no data position (it was trained on another "
                            "data source); use a new checkpoint.path")
        keys = ("fingerprint", "seed", "rows", "global_batch_size")
        diff = {k: (saved.get(k), now[k]) for k in keys if saved.get(k) != now[k]}
        if diff:
            raise DataError(f"the checkpoint of step {step} was trained on other data ({diff}, as (saved, now)); "
                            "resume with the same data.paths, data.columns, data.seed and global_batch_size, "
                            "or use a new checkpoint.path")

    def close(self) -> None:
        with self._cv:
            self._generation += 1
            self._ready.clear()
            self._cv.notify_all()
        if self._assembler is not None:
            import ray

            ray.kill(self._assembler)
            self._assembler = None

    # ---- the producer ---------------------------------------------------------------------

    def _restart(self, start: int) -> None:
        self._generation += 1
        self._ready.clear()
        self._low, self._produced, self._done, self._error = start, start - 1, False, None
        self._thread = threading.Thread(target=self._produce, args=(self._generation, start), daemon=True,
                                        name="airay-feeder")
        self._thread.start()

    def _produce(self, generation: int, start: int) -> None:
        pieces_in = None
        try:
            layout, b = self.stream.layout, self.stream.layout.global_batch_size
            step = layout.window_first_step(*layout.window_of(start))
            pieces_in = self._dataset_pieces(start) if self.dataset is not None else self._parquet_pieces(start)
            pending: deque[list] = deque()
            have = 0
            for ref, lo, hi in pieces_in:
                if hi > lo:
                    pending.append([ref, lo, hi])
                    have += hi - lo
                while have >= b:
                    pieces = take_rows(pending, b)
                    have -= b
                    if step >= start and not self._put(generation, step, [tuple(p) for p in pieces]):
                        return
                    step += 1
                    if step >= self.max_steps:
                        return
        except BaseException as exc:  # surfaced to the controller by steps()
            with self._cv:
                if generation == self._generation:
                    self._error = exc
        finally:
            with self._cv:
                if generation == self._generation:
                    self._done = True
                self._cv.notify_all()
            if pieces_in is not None:
                pieces_in.close()  # shuts the Ray Data executor down

    def _parquet_pieces(self, start: int):
        """(block ref, lo, hi) of the windows from the one holding `start`, in order."""
        it = self._pipeline(start).iter_internal_ref_bundles()
        try:
            for bundle in it:
                for entry, sl in zip(bundle.blocks, bundle.slices):
                    yield (entry.ref, *((sl.start_offset, sl.end_offset) if sl is not None
                                        else (0, entry.metadata.num_rows)))
        finally:
            getattr(it, "close", lambda: None)()

    def _dataset_pieces(self, start: int):
        """The same for a user's ray.data.Dataset: read in order once per epoch (rows before
        the start window are skipped unread), each window assembled by the assembler actor."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._assembler is None:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            self._assembler = ray.remote(WindowAssembler).options(num_cpus=0, scheduling_strategy=here).remote()
        layout, b = self.stream.layout, self.stream.layout.global_batch_size
        epoch, window = layout.window_of(start)
        while layout.window_first_step(epoch, window) < self.max_steps:
            ds = self.dataset
            ds.context.execution_options.preserve_order = True
            skip = window * layout.window_steps * b  # rows of this epoch before the first window
            pending: deque[list] = deque()
            have = pos = 0
            it = ds.iter_internal_ref_bundles()
            try:
                for bundle in it:
                    for entry, sl in zip(bundle.blocks, bundle.slices):
                        lo, hi = (sl.start_offset, sl.end_offset) if sl is not None else (0, entry.metadata.num_rows)
                        cut = min(hi - lo, max(0, skip - pos))
                        pos += hi - lo
                        if hi - lo > cut:
                            pending.append([entry.ref, lo + cut, hi])
                            have += hi - lo - cut
                    while window < layout.windows_per_epoch and have >= layout.window_num_steps(window) * b:
                        n = layout.window_num_steps(window) * b
                        parts = take_rows(pending, n)
                        have -= n
                        ref = self._assembler.window.remote(self.stream, epoch, window, window * layout.window_steps * b,
                                                            [(lo, hi) for _, lo, hi in parts], *[r for r, _, _ in parts])
                        yield ref, 0, n
                        window += 1
                    if window == layout.windows_per_epoch:
                        break
            finally:
                getattr(it, "close", lambda: None)()
            epoch, window = epoch + 1, 0

    def _put(self, generation: int, step: int, pieces: list[Piece]) -> bool:
        with self._cv:
            while generation == self._generation and len(self._ready) >= self.capacity and step >= self._low:
                self._cv.wait(1.0)
            if generation != self._generation:
                return False
            if step >= self._low:
                self._ready[step] = pieces
                self._produced = step
                self._cv.notify_all()
            return True

    def _pipeline(self, start: int):
        import ray
        import ray.data
        from ray.data import ExecutionResources
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        layout = self.stream.layout
        epoch, window = layout.window_of(start)
        items = []
        while layout.window_first_step(epoch, window) < self.max_steps:
            items.append({"epoch": epoch, "window": window})
            window += 1
            if window == layout.windows_per_epoch:
                epoch, window = epoch + 1, 0
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ctx = ds.context
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        opts = ctx.execution_options
        opts.preserve_order = True  # steps are cut from the row stream in order
        opts.resource_limits = opts.resource_limits.copy(cpu=0, gpu=0) \
            if hasattr(opts.resource_limits, "copy") else ExecutionResources(cpu=0, gpu=0)
        # Long-lived reader actors, not tasks: every CPU is held by training bundles, so a
        # num_cpus=0 task would get a fresh worker process (and pay its imports) each time. They
        # live on the driver's node, which outlives the workers' nodes; restarting a dead one
        # is left to the feeder (which restarts the pipeline), not to Ray.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        with warnings.catch_warnings():  # ray 2.60 deprecates these "ray_remote_args" without a successor yet
            warnings.simplefilter("ignore")
            ds = ds.map_batches(WindowReader, fn_constructor_kwargs={"stream": self.stream}, batch_size=1,
                                batch_format="numpy", zero_copy_batch=True,
                                compute=ray.data.ActorPoolStrategy(size=self.readers),
                                num_cpus=0, scheduling_strategy=here, max_restarts=0)
        return ds


def take_rows(pending: deque, n: int) -> list[list]:
    """Cut the first `n` rows off a queue of [ref, lo, hi] pieces; returns their pieces."""
    out = []
    while n:
        ref, lo, hi = pending[0]
        k = min(n, hi - lo)
        out.append([ref, lo, lo + k])
        n -= k
        if lo + k == hi:
            pending.popleft()
        else:
            pending[0][1] = lo + k
    return out


class DataLog:
    """What the run records about its data: a `data_stall` event for a round whose steps waited
    for data more than 10% of their time, and (data.record_sample_ids) samples.jsonl, one line
    per committed step with its sorted sample ids; a replayed step's later line wins, as in
    metrics.jsonl."""

    def __init__(self, recorder, record_ids: bool):
        self.rec = recorder
        self._samples = open(recorder.run_dir / "samples.jsonl", "a", buffering=1) if record_ids else None

    def record(self, start: int, values: list[list[dict]]) -> None:
        import json

        stalled = []
        for i in range(len(values[0])):
            per_rank = [v[i] for v in values]
            wait = max(r["data_wait_s"] for r in per_rank)
            step_time = max(r["step_time_s"] for r in per_rank)
            if data_stalled(wait, step_time):
                stalled.append((start + i, wait, step_time))
            if self._samples is not None:
                ids = sorted(j for r in per_rank for j in r["sample_ids"])
                self._samples.write(json.dumps({"step": start + i, "sample_ids": ids}) + "\n")
        if stalled:
            self.rec.event("data_stall", step=stalled[0][0], steps=[s for s, _, _ in stalled],
                           max_data_wait_s=max(w for _, w, _ in stalled),
                           max_share=max(w / t for _, w, t in stalled))

    def close(self) -> None:
        if self._samples is not None:
            self._samples.close()

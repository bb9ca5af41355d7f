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
the cluster, and a pipeline waiting for one would wait forever. The reader actors run on the
nodes that train, not on the head: the head runs the driver and does no heavy work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

from airay.data.layout import EpochLayout
from airay.data.parquet import DataError, ParquetDataset
from airay.data.readers import WindowAssembler, WindowReader

PIPELINE_RETRIES = 2  # consecutive pipeline failures (without a step produced) tolerated
CLOSE_WAIT_S = 30.0   # how long `Feeder.close` waits for its producers to end
log = logging.getLogger(__name__)
# Pieces of one global step: (ObjectRef of a Ray Data block, first row, end row).
Piece = tuple[Any, int, int]


@dataclass(frozen=True)
class Stream:
    """What the pipeline streams (checked by airay.data.prepare; pickled into the readers)."""

    dataset: ParquetDataset | None  # None: a ray.data.Dataset the feeder iterates itself
    layout: EpochLayout
    preprocess: str | None
    preprocess_kwargs: dict[str, Any]
    fingerprint: str
    cache_bytes: int = 0  # decoded row groups each reader keeps

    def position(self, step: int) -> dict[str, Any]:
        epoch, in_epoch = self.layout.position(step)
        return {"step": step, "epoch": epoch, "step_in_epoch": in_epoch, "seed": self.layout.seed,
                "rows": self.layout.rows, "global_batch_size": self.layout.global_batch_size,
                "fingerprint": self.fingerprint}


def data_stalled(data_wait_s: float, step_time_s: float, share: float = 0.10) -> bool:
    """A step waited for data longer than `share` of its time: the input pipeline is too slow."""
    return step_time_s > 0 and data_wait_s > share * step_time_s


class Executions:
    """The Ray Data executions a feeder reads, each shut down by airay: when its reading ends, read
    to the end or not, and at `close` any still running, so that the producer waiting on it wakes
    up and ends. Ray Data shuts an execution not read to its end down only when the garbage
    collector gets to it, and a producer left waiting on one ran on after the run: when the
    execution ended (its readers go with ray.shutdown) its shutdown called ray.wait, and Ray's
    auto-init connected the process to the cluster again after the user had shut Ray down
    (tests/test_data_scale.py, the feeder's close)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running: set = set()
        self._closed = False

    @contextlib.contextmanager
    def bundles(self, ds):
        """An iterator over `ds`'s RefBundles, its execution shut down when the block ends."""
        with self._lock:  # started under the lock: `close` never misses one starting
            if self._closed:
                raise RuntimeError("the data pipeline was closed")
            executor = ds._create_executor()  # as Dataset._execute_to_iterator, without waiting
            bundles = ds._build_bundle_iterator(executor)  # for the first block first
            self._running.add(executor)
        try:
            yield bundles
        finally:
            with self._lock:
                self._running.discard(executor)
            executor.shutdown(force=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            running, self._running = list(self._running), set()
        for executor in running:
            executor.shutdown(force=True)


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
        self._producers: list[threading.Thread] = []  # every producer started, for `close`
        self._executions = Executions()

    # ---- the controller's calls -------------------------------------------------------------

    def steps(self, start: int, end: int, extra: int = 0, timeout_s: float | None = None) -> dict[int, list[Piece]]:
        """Pieces of steps [start, end) (waits for them) plus up to `extra` later steps that are
        ready now. Steps before `start` are released: they are committed or will be replayed.
        A pipeline that fails, or does not produce the steps within `timeout_s`, is restarted
        from `start`, up to PIPELINE_RETRIES times in a row (a reader lost with its node is one);
        then the error (or TimeoutError) is raised: the driver never waits forever for a stalled
        pipeline."""
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
            self._failures = 0  # the pipeline delivers: only failures in a row count
            return out

    def ready(self, start: int, end: int) -> bool:
        """Whether steps [start, end) are produced: `steps` would not wait for them."""
        with self._cv:
            return self._thread is not None and start >= self._low and all(s in self._ready for s in range(start, end))

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
        """Stop producing and release what the pipeline holds. When it returns no producer runs
        and no Ray Data execution is left running: nothing of the run calls into Ray later."""
        with self._cv:
            self._generation += 1
            self._ready.clear()
            self._cv.notify_all()
        self._executions.close()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for producer in self._producers:
            producer.join(max(0.0, deadline - time.monotonic()))
            if producer.is_alive():
                log.warning("the data producer %s did not end within %ss of the feeder's close",
                            producer.name, CLOSE_WAIT_S)
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
        self._producers = [t for t in self._producers if t.is_alive()] + [self._thread]
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
        with self._executions.bundles(self._pipeline(start)) as bundles:
            for bundle in bundles:
                for entry, sl in zip(bundle.blocks, bundle.slices):
                    yield (entry.ref, *((sl.start_offset, sl.end_offset) if sl is not None
                                        else (0, entry.metadata.num_rows)))

    def _dataset_pieces(self, start: int):
        """The same for a user's ray.data.Dataset: read in order once per epoch (rows before
        the start window are skipped unread), each window assembled by the assembler actor."""
        import ray

        from airay.placement import off_driver_node

        if self._assembler is None:
            self._assembler = ray.remote(WindowAssembler).options(num_cpus=0, **off_driver_node()).remote()
        layout, b = self.stream.layout, self.stream.layout.global_batch_size
        epoch, window = layout.window_of(start)
        while layout.window_first_step(epoch, window) < self.max_steps:
            ds = self.dataset
            ds.context.execution_options.preserve_order = True
            skip = window * layout.window_steps * b  # rows of this epoch before the first window
            pending: deque[list] = deque()
            have = pos = 0
            with self._executions.bundles(ds) as bundles:
                for bundle in bundles:
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

        from airay.placement import off_driver_node

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
        # decode and preprocess, so they run spread over the nodes that train, never on the
        # driver's (the head does no heavy work; on a one-node cluster there is no other). A
        # reader lost with its node fails the pipeline, which the feeder restarts from the step
        # it needs (PIPELINE_RETRIES in a row), not Ray.
        with warnings.catch_warnings():  # ray 2.60 deprecates these "ray_remote_args" without a successor yet
            warnings.simplefilter("ignore")
            ds = ds.map_batches(WindowReader, fn_constructor_kwargs={"stream": self.stream}, batch_size=1,
                                batch_format="numpy", zero_copy_batch=True,
                                compute=ray.data.ActorPoolStrategy(size=self.readers),
                                num_cpus=0, max_restarts=0, **off_driver_node())
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

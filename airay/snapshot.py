"""A DeepSpeed checkpoint engine that blocks the step loop only until the state is copied to host memory.

DeepSpeed's `save_checkpoint` hands every file's state dict to its checkpoint engine
(deepspeed.runtime.checkpoint_engine, 0.19). The default engine serializes it with torch.save
right there, inside the step loop. `SnapshotEngine.save` instead makes host-memory copies of the
state dict's tensors and queues the torch.save on a background `Writer` thread.

Most of the copying overlaps the next step too (the CheckFreq idea): parameters and optimizer
state change only in the optimizer step, so their copies run on a copy thread while the next
step's forward and backward go on, and `install` makes the engine's `step` (and
`load_checkpoint`, which also writes them in place) wait for those copies first. The rest of a
state dict (module buffers, which forward may update, and anything else) is copied inside `save`.
The step loop is therefore blocked for the save call plus any wait before the next optimizer step
(`Writer.take_copy_wait`, reported per step as `checkpoint_wait_s`).

The files are DeepSpeed's own, with its names and contents, so loading them (also at another
world size through ds_to_universal) is unchanged. They are complete only once `Writer.wait()`
returns: the rank calls it before it hands the files on (TrainWorker.collect) and before the
next save, so a half-written file is never shipped and two saves never interleave.
"""

from __future__ import annotations

import copy as _copy
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_all

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def snapshot(item, reuse: list | None = None, made: list | None = None, defer: set | None = None,
             later: list | None = None):
    """`item` with every tensor replaced by a private host-memory copy; containers are rebuilt
    (dict subclasses keep their type and defaults), other leaves are shared: state dicts hold
    numbers, strings and fresh containers there, nothing the step loop mutates.

    `reuse`: host tensors of an earlier snapshot of the same state, in the same order, to copy
    into instead of allocating (one whose shape or dtype differs is replaced); `made` collects
    this snapshot's tensors in that order, for the next one.
    `defer`: storages (`untyped_storage().data_ptr()`) whose copy may wait: a tensor on one of
    them gets its host buffer now, and the (buffer, source) pair goes to `later` for the caller
    to copy before that storage next changes."""
    import torch

    pool = iter(reuse or ())
    made = [] if made is None else made
    defer = defer or set()

    def copy(item):
        if torch.is_tensor(item):
            t = item.detach()
            old = next(pool, None)
            fits = old is not None and old.shape == t.shape and old.dtype == t.dtype
            if later is not None and t.untyped_storage().data_ptr() in defer:
                # empty_like keeps a dense tensor's strides and compacts a view, as clone() does.
                out = old if fits else torch.empty_like(t, device="cpu")
                later.append((out, t))
            elif fits:
                out = old.copy_(t)
            else:
                out = t.clone() if t.device.type == "cpu" else t.to("cpu")
            made.append(out)
            return out
        if isinstance(item, dict):
            out = _copy.copy(item)
            for k, v in item.items():
                out[k] = copy(v)
            return out
        if isinstance(item, list):
            return [copy(v) for v in item]
        if isinstance(item, tuple):
            return type(item)(*map(copy, item)) if hasattr(item, "_fields") else tuple(map(copy, item))
        return item

    return copy(item)


def copy_pairs(pairs: list) -> None:
    for dst, src in pairs:
        dst.copy_(src)


class Writer:
    """Two background threads that live as long as the worker process (engines come and go with
    world changes, pending files must not go with them): one copies deferred tensors into host
    buffers, one writes queued state dicts in order."""

    def __init__(self):
        # Host copies of the last save's tensors, per file, copied into by the next save: at
        # hundreds of MB, allocating and first touching fresh memory costs more than the copy.
        # The price is one copy of the checkpointed state kept in host memory between saves.
        self.buffers: dict[str, list] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="airay-ckpt-writer")
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="airay-ckpt-copy")
        self._pending: list[Future] = []
        self._copies: list[Future] = []
        self._copy_wait_s = 0.0
        self._lock = threading.Lock()

    def copy_later(self, pairs: list) -> Future:
        """Copy (host buffer, source) `pairs` on the copy thread; `wait_copied` waits for it."""
        with self._lock:
            f = self._copier.submit(copy_pairs, pairs)
            self._copies.append(f)
        return f

    def wait_copied(self) -> float:
        """Block until every deferred copy is done (before anything changes their sources);
        returns the seconds waited, also summed for `take_copy_wait`."""
        with self._lock:
            copies, self._copies = self._copies, []
        if not copies:
            return 0.0
        t0 = time.perf_counter()
        _wait_all(copies)  # a failed copy fails its file's write, not the step loop
        waited = time.perf_counter() - t0
        with self._lock:
            self._copy_wait_s += waited
        return waited

    def copying(self) -> bool:
        """Whether a deferred copy is still queued or running."""
        with self._lock:
            return any(not f.done() for f in self._copies)

    def take_copy_wait(self) -> float:
        """Seconds spent in `wait_copied` since the last call."""
        with self._lock:
            waited, self._copy_wait_s = self._copy_wait_s, 0.0
        return waited

    def submit(self, fn, *args) -> None:
        with self._lock:
            self._pending.append(self._pool.submit(fn, *args))

    def wait(self, raise_errors: bool = True) -> int:
        """Block until every queued file is written; returns how many. Re-raises a write's error
        (the files of that save are incomplete: the caller must not hand them on) unless
        `raise_errors` is False (a save whose files are being thrown away)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            if f.exception() is not None and raise_errors:
                raise f.exception()
        return len(pending)


def optimizer_storages(engine) -> set[int]:
    """Storages only the optimizer step writes: the module's parameters and, at every level of
    the optimizer wrapping (ZeRO or fp16 wrapper around a torch optimizer), its parameters (ZeRO's
    fp32 partitions) and per-parameter state (Adam's moments)."""
    import torch

    ptrs = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    opt, seen = getattr(engine, "optimizer", None), set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        for group in getattr(opt, "param_groups", None) or ():
            ptrs.update(p.untyped_storage().data_ptr() for p in group["params"] if torch.is_tensor(p))
        state = getattr(opt, "state", None)
        for param, per_param in (state.items() if isinstance(state, dict) else ()):
            # Keyed by parameter: ZeRO-3 takes its fp32 partitions out of param_groups between steps.
            if torch.is_tensor(param):
                ptrs.add(param.untyped_storage().data_ptr())
            if isinstance(per_param, dict):
                ptrs.update(v.untyped_storage().data_ptr() for v in per_param.values() if torch.is_tensor(v))
        opt = getattr(opt, "optimizer", None)
    ptrs.discard(0)  # empty storages (ZeRO-3's released parameters): nothing to copy anyway
    return ptrs


class SnapshotEngine(TorchCheckpointEngine):
    """TorchCheckpointEngine whose save() snapshots and returns; the writing is `writer`'s.
    `deferrable`: returns the storages whose copy may wait for `Writer.wait_copied` (None: copy
    everything inside save)."""

    def __init__(self, writer: Writer, config_params=None, deferrable=None):
        super().__init__(config_params)
        self.name = "AirayHostSnapshotEngine"
        self.writer = writer
        self.deferrable = deferrable
        self._defer: set[int] = set()
        self.deferred_bytes = self.copied_bytes = 0  # of the last save_checkpoint, for reports and tests

    def create(self, info: CheckpointCommitInfo):
        # A new save_checkpoint: the host buffers are about to be overwritten, so an earlier
        # save's writes (one never collected: its world broke) must have finished with them
        # (a write first waits for its file's deferred copies).
        self.writer.wait(raise_errors=False)
        self._defer = self.deferrable() if self.deferrable is not None else set()
        self.deferred_bytes = self.copied_bytes = 0

    def save(self, state_dict, path: str):
        import torch

        made: list = []
        later: list = []
        # Keyed by file name (the same on every save of this rank): model states, optimizer partition.
        key = os.path.basename(path)
        state = snapshot(state_dict, self.writer.buffers.get(key), made, self._defer, later)
        self.writer.buffers[key] = made
        deferred = sum(dst.nbytes for dst, _ in later)
        self.deferred_bytes += deferred
        self.copied_bytes += sum(t.nbytes for t in made) - deferred
        copied = self.writer.copy_later(later)

        def write():
            copied.result()  # re-raises a failed copy: the file is not written
            torch.save(state, path, _use_new_zipfile_serialization=self.zipfile_serialization)

        self.writer.submit(write)

    def preserves_storage_sharing(self):
        # DeepSpeed then skips its own clone_tensors_for_torch_save: snapshot() already made
        # compact private copies, cloning twice would double the blocking copy.
        return False

    def commit(self, info: CheckpointCommitInfo):
        # DeepSpeed calls this at the end of save_checkpoint, before the files are written;
        # completeness is Writer.wait()'s (see the module docstring).
        return True


def install(engine, writer: Writer, overlap: bool = True) -> None:
    """Make `engine` (a DeepSpeedEngine) save through `writer`. With `overlap`, parameter and
    optimizer-state copies run beside the next step, and the engine's `step` and
    `load_checkpoint` (the calls that write those tensors in place) first wait for them."""
    engine.checkpoint_engine = SnapshotEngine(writer, getattr(engine, "_config", None),
                                              (lambda: optimizer_storages(engine)) if overlap else None)
    if overlap:
        for name in ("step", "load_checkpoint"):
            _fence(engine, name, writer)


def _fence(engine, name: str, writer: Writer) -> None:
    method = getattr(engine, name)

    def fenced(*args, **kwargs):
        writer.wait_copied()
        return method(*args, **kwargs)

    # An instance attribute shadows the method (nn.Module stores plain callables in __dict__).
    setattr(engine, name, fenced)

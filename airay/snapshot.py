"""A DeepSpeed checkpoint engine that blocks the step loop only while state is copied to host memory.

DeepSpeed's `save_checkpoint` hands every file's state dict to its checkpoint engine
(deepspeed.runtime.checkpoint_engine, 0.19). The default engine serializes it with torch.save
right there, inside the step loop. `SnapshotEngine.save` instead copies the state dict's tensors
(to host memory: a clone on CPU, a device-to-host copy on GPU) and queues the torch.save on a
background `Writer` thread; training goes on as soon as the copies exist, because the optimizer
updates the original tensors in place and the copies are all the writer reads.

The files are DeepSpeed's own, with its names and contents, so loading them (also at another
world size through ds_to_universal) is unchanged. They are complete only once `Writer.wait()`
returns: the rank calls it before it hands the files on (TrainWorker.collect) and before the
next save, so a half-written file is never shipped and two saves never interleave.
"""

from __future__ import annotations

import copy as _copy
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def snapshot(item, reuse: list | None = None, made: list | None = None):
    """`item` with every tensor replaced by a private host-memory copy; containers are rebuilt
    (dict subclasses keep their type and defaults), other leaves are shared: state dicts hold
    numbers, strings and fresh containers there, nothing the step loop mutates.

    `reuse`: host tensors of an earlier snapshot of the same state, in the same order, to copy
    into instead of allocating (one whose shape or dtype differs is replaced); `made` collects
    this snapshot's tensors in that order, for the next one."""
    import torch

    pool = iter(reuse or ())
    made = [] if made is None else made

    def copy(item):
        if torch.is_tensor(item):
            t = item.detach()
            old = next(pool, None)
            if old is not None and old.shape == t.shape and old.dtype == t.dtype:
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


class Writer:
    """One background thread that writes queued state dicts in order; lives as long as the worker
    process (engines come and go with world changes, pending files must not go with them)."""

    def __init__(self):
        # Host copies of the last save's tensors, per file, copied into by the next save: at
        # hundreds of MB, allocating and first touching fresh memory costs more than the copy.
        # The price is one copy of the checkpointed state kept in host memory between saves.
        self.buffers: dict[str, list] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="airay-ckpt-writer")
        self._pending: list[Future] = []
        self._lock = threading.Lock()

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


class SnapshotEngine(TorchCheckpointEngine):
    """TorchCheckpointEngine whose save() snapshots and returns; the writing is `writer`'s."""

    def __init__(self, writer: Writer, config_params=None):
        super().__init__(config_params)
        self.name = "AirayHostSnapshotEngine"
        self.writer = writer

    def create(self, info: CheckpointCommitInfo):
        # A new save_checkpoint: the host buffers are about to be overwritten, so an earlier
        # save's writes (one never collected: its world broke) must have finished with them.
        self.writer.wait(raise_errors=False)

    def save(self, state_dict, path: str):
        import torch

        made: list = []
        # Keyed by file name (the same on every save of this rank): model states, optimizer partition.
        key = os.path.basename(path)
        state = snapshot(state_dict, self.writer.buffers.get(key), made)
        self.writer.buffers[key] = made
        self.writer.submit(lambda: torch.save(state, path, _use_new_zipfile_serialization=self.zipfile_serialization))

    def preserves_storage_sharing(self):
        # DeepSpeed then skips its own clone_tensors_for_torch_save: snapshot() already made
        # compact private copies, cloning twice would double the blocking copy.
        return False

    def commit(self, info: CheckpointCommitInfo):
        # DeepSpeed calls this at the end of save_checkpoint, before the files are written;
        # completeness is Writer.wait()'s (see the module docstring).
        return True


def install(engine, writer: Writer) -> None:
    """Make `engine` (a DeepSpeedEngine) save through `writer`; loading is unchanged."""
    engine.checkpoint_engine = SnapshotEngine(writer, getattr(engine, "_config", None))

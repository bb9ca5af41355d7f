"""A DeepSpeed checkpoint engine that writes each rank's files from the live state, beside training.

DeepSpeed's `save_checkpoint` hands every file's state dict to its checkpoint engine
(deepspeed.runtime.checkpoint_engine, 0.19); the default engine serializes it with torch.save right
there, inside the step loop. `StagingEngine.save` returns at once: parameters and optimizer state
change only in the optimizer step, so they are written as they are (no host copy: on a CPU node
the file in node memory is the copy) by a background `Writer`, while the next step's forward and
backward run; the engine's `step` (and `load_checkpoint`) first wait for those writes
(`Writer.wait_live`, reported per step as `checkpoint_wait_s`), whichever other thread waits
for them too. On a GPU the live tensors are copied to pinned host buffers on a side stream
(`HostStager`) and the step waits for those copies, not for the files. Everything else in a state dict
(module buffers, which forward may update; counters) is cloned inside `save`. A tensor that views
part of a larger storage (ZeRO's flat buffers) is rewrapped onto just that part, so its file holds
its own elements and nothing is copied.

Each file's size and CRC-32, and a CRC-32 per chunk (written beside it: its CRC sidecar, itself
listed with its size and CRC-32), are computed as it is written, for the manifest; the files are
complete once `Writer.wait()` returns. `StagingEngine.load` reads through a `LoadPlan` when one is
set (airay.checkpoint.loading): the right copy of each file, resharded for another world size.
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

from airay.checkpoint.checksum import crc32, crc_sidecar, pack_crcs


# A file's chunks: at least this many (a resharded load reads whole chunks, so up to one chunk too
# many at each end of each piece it needs: under ZeRO-3, a piece of every parameter), each at least
# MIN_CHUNK (a page) and at most `checkpoint.chunk_mib`. Consecutive chunks are one range, and all of
# a file's ranges go to a copy in one call (ranges.runs, ranges.batches), so small chunks cost CRC
# calls, not round trips. Their CRCs are in the file's CRC sidecar (checksum.crc_sidecar), not in the
# manifest: 4 bytes a chunk.
CHUNKS_PER_FILE = 4096
MIN_CHUNK = 4 << 10


def chunk_size_for(nbytes: int, most: int) -> int:
    """The chunk size of a file of about `nbytes`: the largest power of two that cuts it into at
    least CHUNKS_PER_FILE chunks, between MIN_CHUNK and `most`."""
    per = nbytes // CHUNKS_PER_FILE
    return min(most, max(MIN_CHUNK, 1 << (per.bit_length() - 1) if per else 1))


class CrcFile:
    """A binary file being written, whose size and CRC-32 are kept as it goes, and the CRC-32 of
    each `chunk_bytes` of it (so a reader of part of the file verifies the chunks it reads)."""

    def __init__(self, path: str, chunk_bytes: int = 8 << 20):
        self.f = open(path, "wb")
        self.crc, self.size = 0, 0
        self.chunk_bytes, self.chunks, self._chunk_crc = chunk_bytes, [], 0

    def write(self, data) -> int:
        self.crc = crc32(data, self.crc)
        view, pos = memoryview(data).cast("B"), 0
        while pos < len(view):  # the chunk CRCs: cut at every chunk boundary of the file
            take = min(len(view) - pos, self.chunk_bytes - (self.size + pos) % self.chunk_bytes)
            self._chunk_crc = crc32(view[pos:pos + take], self._chunk_crc)
            pos += take
            if (self.size + pos) % self.chunk_bytes == 0:
                self.chunks.append(self._chunk_crc)
                self._chunk_crc = 0
        n = self.f.write(data)
        self.size += n
        return n

    def chunk_crcs(self) -> list[int]:
        """CRC-32 of each chunk, the last one partial (none for an empty file)."""
        return self.chunks + ([self._chunk_crc] if self.size % self.chunk_bytes else [])

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def own_storage(t):
    """`t` on a storage of exactly its own elements: a contiguous view of a larger storage is
    rewrapped (no copy) so torch.save writes its elements only; other views are cloned."""
    import torch

    storage = t.untyped_storage()
    if t.numel() * t.element_size() == storage.nbytes():
        return t
    if not t.is_contiguous():
        return t.clone()
    start = t.storage_offset() * t.element_size()
    part = storage[start:start + t.numel() * t.element_size()]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(part, 0, t.shape, t.stride())


def stage(item, live: set[int], counts: dict | None = None, host=None):
    """`item` ready to write after the save returns: tensors on `live` storages (those only the
    optimizer step writes) as they are (or, given a `host` stager, copied asynchronously to its
    pinned buffers: device tensors), the rest cloned now; containers rebuilt (dict subclasses
    keep their type and defaults); other leaves shared. `counts` gets the bytes of each kind."""
    import torch

    counts = {"live": 0, "cloned": 0} if counts is None else counts

    def walk(item):
        if torch.is_tensor(item):
            t = item.detach()
            if t.untyped_storage().data_ptr() in live:
                counts["live"] += t.nbytes
                if host is not None and t.device.type != "cpu":
                    return host.copy(t)
                return own_storage(t)
            counts["cloned"] += t.nbytes
            return t.clone() if t.device.type == "cpu" else t.to("cpu")
        if isinstance(item, dict):
            out = _copy.copy(item)
            for k, v in item.items():
                out[k] = walk(v)
            return out
        if isinstance(item, list):
            return [walk(v) for v in item]
        if isinstance(item, tuple):
            return type(item)(*map(walk, item)) if hasattr(item, "_fields") else tuple(map(walk, item))
        return item

    return walk(item)


class Writer:
    """One background thread that lives as long as the worker process (engines come and go with
    world changes; pending files must not go with them) and writes queued state dicts in order."""

    def __init__(self, chunk_bytes: int = 1 << 20):
        self.chunk_bytes = chunk_bytes  # the largest chunk of the chunk CRCs (checkpoint.chunk_mib)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="airay-ckpt-writer")
        self._pending: list[Future] = []
        self._live: list[Future] = []  # writes that read tensors the optimizer step will change
        self._copies: list = []  # device-to-host copies of live tensors (CUDA events) not yet waited for
        self._wait_s = 0.0
        self._written: dict[str, tuple[int, int]] = {}  # path -> (size, crc32) since take_written
        self._chunks: dict[str, int] = {}  # path -> its chunk size (the CRCs: its sidecar), since take_written
        self._lock = threading.Lock()

    def submit(self, path: str, state, live: bool, copied=None, nbytes: int = 0) -> None:
        """Write `state` to `path` in the background. `live`: it reads tensors the optimizer step
        changes (the step waits for the write); `copied`: an event after which `state`'s host
        copies are complete (the write waits for it, the step too: not for the file); `nbytes`:
        about the file's size (its tensors' bytes), which sets its chunks' (chunk_size_for)."""
        chunk_bytes = chunk_size_for(nbytes, self.chunk_bytes)

        def write():
            import torch
            from torch.utils.serialization import config

            if copied is not None:
                copied.synchronize()
            # torch's own per-record CRC-32 is redundant with the file's (CrcFile), which the
            # manifest holds and every load checks: skip it (a quarter of a save's CPU time).
            config.save.compute_crc32 = False
            f = CrcFile(path, chunk_bytes)
            try:
                torch.save(state, f)
            finally:
                f.close()
            crcs = pack_crcs(f.chunk_crcs())  # beside the file: the manifest lists it as a file too
            with open(crc_sidecar(path), "wb") as side:
                side.write(crcs)
            with self._lock:
                self._written[path] = (f.size, f.crc)
                self._written[crc_sidecar(path)] = (len(crcs), crc32(crcs))
                self._chunks[path] = chunk_bytes

        with self._lock:
            future = self._pool.submit(write)
            self._pending.append(future)
            if live:
                self._live.append(future)
            if copied is not None:
                self._copies.append(copied)

    def after(self, ready) -> None:
        """The files submitted from now on are written once `ready()` has returned (the one
        writer thread runs in order): a save's writes wait for the room the memory budget makes
        for them, not the save call. Its outcome is not theirs: they are written either way."""
        self._pool.submit(ready)

    def wait_live(self) -> float:
        """Block until every write that reads live tensors is done (before the optimizer step
        changes them); returns the seconds waited, also summed for `take_wait`. Another thread
        waiting for the same writes (the persist, Writer.wait) does not excuse this one: the
        writes stay listed until they are done, whoever waited for them."""
        with self._lock:
            live, copies = list(self._live), list(self._copies)
        if not live and not copies:
            return 0.0
        t0 = time.perf_counter()
        for event in copies:  # on a GPU: the copies to pinned host memory, not the files
            event.synchronize()
        _wait_all(live)  # a failed write fails its file, found by wait(); never the step loop
        waited = time.perf_counter() - t0
        with self._lock:
            self._live = [f for f in self._live if not f.done()]
            self._copies = [e for e in self._copies if not e.query()]
            self._wait_s += waited
        return waited

    def writing(self) -> bool:
        with self._lock:
            return any(not f.done() for f in self._pending)

    def take_wait(self) -> float:
        """Seconds spent in `wait_live` since the last call."""
        with self._lock:
            waited, self._wait_s = self._wait_s, 0.0
        return waited

    def wait(self, raise_errors: bool = True) -> int:
        """Block until every queued file is written; returns how many. Re-raises a write's error
        (the files of that save are incomplete: they must not be committed) unless
        `raise_errors` is False (a save whose files are being thrown away)."""
        with self._lock:
            pending = list(self._pending)
        _wait_all(pending)
        with self._lock:
            self._pending = [f for f in self._pending if f not in pending]
            self._live = [f for f in self._live if not f.done()]
        errors = [f.exception() for f in pending if f.exception() is not None]
        if errors and raise_errors:
            raise errors[0]
        return len(pending)

    def take_written(self) -> dict[str, tuple[int, int]]:
        """(size, crc32) of each file written since the last call, by path."""
        with self._lock:
            written, self._written = self._written, {}
        return written

    def take_chunks(self) -> dict[str, int]:
        """The chunk size of each file written since the last call (not its sidecar), by path."""
        with self._lock:
            chunks, self._chunks = self._chunks, {}
        return chunks


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
    ptrs.discard(0)  # empty storages (ZeRO-3's released parameters): nothing to write anyway
    return ptrs


class HostStager:
    """Pinned host buffers for a GPU rank's live checkpoint tensors, and the side stream that
    copies into them (torch.distributed.checkpoint's staging idea, for DeepSpeed's state dicts).

    The save enqueues every copy on the side stream, after the work already queued on the
    compute stream (the state at the save's step), and returns; the next optimizer step waits
    for the copies' event, not for the files, and the writer thread serializes from host
    memory. The buffers are reused from save to save (the same partitions each time; a rank has
    one save in flight), so pinned memory stays at this rank's live state, allocated once."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._free: dict[int, list] = {}  # nbytes -> pinned uint8 buffers not in use
        self._used: list = []

    def begin(self) -> None:
        """A new save: the previous save's files are written (StagingEngine.create waited)."""
        for buf in self._used:
            self._free.setdefault(buf.numel(), []).append(buf)
        self._used = []

    def copy(self, t):
        import torch

        nbytes = t.numel() * t.element_size()
        pool = self._free.get(nbytes)
        buf = pool.pop() if pool else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._used.append(buf)
        src = t if t.is_contiguous() else t.contiguous()  # on the compute stream, before the wait below
        host = buf.view(t.dtype).view(t.shape)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
        if src is not t:
            src.record_stream(self.stream)  # a temporary: not reused before the copy has read it
        return host

    def fence(self):
        """An event recorded after every copy enqueued so far."""
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        return event


class StagingEngine(TorchCheckpointEngine):
    """TorchCheckpointEngine whose save() stages and returns; the writing is `writer`'s.
    `live_storages`: returns the storages written as they are (None: clone everything)."""

    def __init__(self, writer: Writer, config_params=None, live_storages=None):
        super().__init__(config_params)
        self.name = "AirayStagingEngine"
        self.writer = writer
        self.live_storages = live_storages
        self.host: HostStager | None = None  # made at the first save of a CUDA state
        self._live: set[int] = set()
        self.plan = None  # a LoadPlan (airay.checkpoint.loading) while a load is in progress
        self.live_bytes = self.cloned_bytes = 0  # of the last save_checkpoint, for reports and tests

    def create(self, info: CheckpointCommitInfo):
        # A new save_checkpoint: an earlier save's writes (one never committed: its world broke)
        # must be out of the way, and the optimizer's storages are read afresh (ZeRO-3 swaps them).
        self.writer.wait(raise_errors=False)
        self._live = self.live_storages() if self.live_storages is not None else set()
        self.live_bytes = self.cloned_bytes = 0
        if self.host is not None:
            self.host.begin()

    def save(self, state_dict, path: str):
        counts = {"live": 0, "cloned": 0}
        host = self._host_stager()
        staged = stage(state_dict, self._live, counts, host)
        self.live_bytes += counts["live"]
        self.cloned_bytes += counts["cloned"]
        nbytes = counts["live"] + counts["cloned"]
        if host is not None:  # live tensors were copied to host: the file needs the copy, not the step
            self.writer.submit(path, staged, live=False, copied=host.fence(), nbytes=nbytes)
        else:
            self.writer.submit(path, staged, live=counts["live"] > 0, nbytes=nbytes)

    def _host_stager(self) -> HostStager | None:
        """On a CUDA rank that writes beside training, the stager of its live tensors."""
        import torch

        if self.host is None and self._live and torch.cuda.is_available() and torch.cuda.is_initialized():
            self.host = HostStager(torch.cuda.current_device())
        return self.host

    def load(self, path: str, map_location=None):
        if self.plan is not None:
            return self.plan.load(os.path.basename(path))
        return super().load(path, map_location)

    def preserves_storage_sharing(self):
        # DeepSpeed then skips its own clone_tensors_for_torch_save: stage() already gives every
        # tensor a storage of its own elements, and cloning would copy the state a second time.
        return False

    def commit(self, info: CheckpointCommitInfo):
        # DeepSpeed calls this at the end of save_checkpoint, before the files are written;
        # completeness is Writer.wait()'s (see the module docstring).
        return True


def install(engine, writer: Writer, overlap: bool = True) -> StagingEngine:
    """Make `engine` (a DeepSpeedEngine) save through `writer`. With `overlap`, parameters and
    optimizer state are written from the live tensors beside the next step, and the engine's
    `step` and `load_checkpoint` (the calls that change them in place) first wait for those writes."""
    engine.checkpoint_engine = StagingEngine(writer, getattr(engine, "_config", None),
                                             (lambda: optimizer_storages(engine)) if overlap else None)
    if overlap:
        for name in ("step", "load_checkpoint"):
            _fence(engine, name, writer)
    return engine.checkpoint_engine


def _fence(engine, name: str, writer: Writer) -> None:
    method = getattr(engine, name)

    def fenced(*args, **kwargs):
        writer.wait_live()
        return method(*args, **kwargs)

    # An instance attribute shadows the method (nn.Module stores plain callables in __dict__).
    setattr(engine, name, fenced)

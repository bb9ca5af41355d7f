"""Reading only the parts of old partitions a resharded load needs, each chunk verified.

A rank of a new world needs a range of each overlapping old rank's optimizer partition (its fp32
master slice and moments), not the whole file: at 70B parameters on 64 ranks, whole files would
be about 26 GB read per rank. The writer records a CRC-32 per chunk of every file in the file's
CRC sidecar (staging.CrcFile, checksum.crc_sidecar, `checkpoint.chunk_mib`), so a reader fetches
the sidecar, then fetches and verifies just the chunks it touches, into a sparse local copy (the
rest are holes):

1. the file's skeleton: its first and last chunks, which hold torch.save's pickle (the structure
   and every storage's place) and the zip directory (more of each end if they do not);
2. the structure loaded on the meta device (`torch.load(map_location="meta")`: each storage knows
   its offset in the file, `_checkpoint_offset`), and the reshard run on it dry, recording the
   slices it reads (reshard.recording);
3. the chunks holding those slices; then the real reshard reads the sparse copy through mmap,
   touching only them (torch computes storage offsets from the pickle instead of reading each
   record's header: `calculate_storage_offsets`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from airay.checkpoint.checksum import crc32


# The most one read of a run of chunks asks for: a peer's reply or a ranged read of durable
# storage, held in memory once.
MAX_READ = 64 << 20


# How much of each end of a file a skeleton starts from: torch.save's pickle of an optimizer
# partition and its zip directory are a few KB; small chunks must not cost a read round each.
SKELETON_START = 16 << 10


def chunks_of(ranges: list[tuple[int, int]], size: int, chunk_bytes: int) -> list[int]:
    """Indices of the chunks of a `size`-byte file that the byte ranges [lo, hi) touch."""
    need: set[int] = set()
    for lo, hi in ranges:
        lo, hi = max(0, lo), min(size, hi)
        if hi > lo:
            need.update(range(lo // chunk_bytes, (hi - 1) // chunk_bytes + 1))
    return sorted(need)


def runs(indices: list[int], longest: int) -> list[tuple[int, int]]:
    """Sorted `indices` as runs (first, last) of consecutive ones, none longer than `longest`."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and i == out[-1][1] + 1 and i - out[-1][0] < longest:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def batches(spans: list[tuple[int, int]], most: int) -> list[list[tuple[int, int]]]:
    """Runs (first, last) of chunks, in order, grouped so no group holds more than `most` chunks
    (a run longer than that is a group of its own: `runs` bounds it)."""
    out: list[list[tuple[int, int]]] = []
    held = most
    for first, last in spans:
        n = last - first + 1
        if held + n > most:
            out.append([])
            held = 0
        out[-1].append((first, last))
        held += n
    return out


# Durable storage answers each ranged read at object-store latency (a GET: tens of ms), so spans
# nearer each other than this are one read, the bytes between them read and dropped...
COALESCE_GAP = 1 << 20
# ...while those dropped bytes stay within this share of the bytes kept (a read/needed ratio the
# sweep holds to 1.2): at 70B the pieces a new rank needs of an old partition are MBs apart, and
# a read must not fetch the whole partition to save a GET.
COALESCE_WASTE = 0.125


def coalesce(spans: list[tuple[int, int]], gap: int = COALESCE_GAP,
             waste: float = COALESCE_WASTE) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(offset, size) spans as fewer reads: in order of offset, a span joins the read before it
    when it starts less than `gap` bytes past that read's end and the read's dropped bytes stay
    within `waste` of its kept ones. Returns the reads [(offset, size)] and, for each span in the
    order given, (index of its read, its offset within that read)."""
    reads: list[list[int]] = []  # [offset, end, kept bytes]
    where: dict[int, tuple[int, int]] = {}
    for i in sorted(range(len(spans)), key=lambda i: spans[i][0]):
        offset, size = spans[i]
        if reads:
            lo, end, kept = reads[-1]
            new_end = max(end, offset + size)
            if offset - end < gap and (new_end - lo) - (kept + size) <= waste * (kept + size):
                reads[-1] = [lo, new_end, kept + size]
                where[i] = (len(reads) - 1, offset - lo)
                continue
        reads.append([offset, offset + size, size])
        where[i] = (len(reads) - 1, 0)
    return [(lo, end - lo) for lo, end, _ in reads], [where[i] for i in range(len(spans))]


def read_packed(path: str | os.PathLike, spans: list[tuple[int, int]]):
    """Each (offset, size) of a local file, back to back in one uint8 array (zeros past the file's
    end), the file opened once. An array, not bytes: Ray hands a peer's reply over zero-copy
    (bytes, or a list of them, are pickled: a copy more on each side, twice the time measured)."""
    import numpy as np

    out = np.zeros(sum(size for _, size in spans), np.uint8)
    view, pos = memoryview(out), 0
    with open(path, "rb") as f:
        for offset, size in spans:
            os.preadv(f.fileno(), [view[pos:pos + size]], offset)
            pos += size
    return out


def unpack(packed, spans: list[tuple[int, int]]) -> list[memoryview]:
    """read_packed's array as one view per span."""
    view, out, pos = memoryview(packed), [], 0
    for _, size in spans:
        out.append(view[pos:pos + size])
        pos += size
    return out


def slice_range(t) -> tuple[int, int]:
    """Bytes [lo, hi) of its file that a slice of a tensor loaded on the meta device covers."""
    start = t.untyped_storage()._checkpoint_offset + t.storage_offset() * t.element_size()
    return start, start + t.numel() * t.element_size()


def load_meta(path: str | os.PathLike):
    """A torch.save file's structure, tensors on the meta device (no storage bytes read)."""
    import torch

    return torch.load(path, map_location="meta", weights_only=False)


def load_mmap(path: str | os.PathLike):
    """A torch.save file, its storages mapped, not read: only the bytes used are touched. The
    storages' offsets come from the pickle (not from each record's header, which may lie in a
    chunk a sparse copy does not hold)."""
    import torch
    from torch.utils.serialization import config

    with _storage_offsets_calculated(config):
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


@contextlib.contextmanager
def _storage_offsets_calculated(config):
    before = config.load.calculate_storage_offsets
    config.load.calculate_storage_offsets = True
    try:
        yield
    finally:
        config.load.calculate_storage_offsets = before


@dataclass
class ChunkedCopy:
    """A local copy of part of a checkpoint file: `path` (the file itself when this node holds it
    whole, else a sparse file of the same size), and the chunks verified in it so far.
    `fetch(i)`: chunk i's bytes from the next copy to try (a peer's store, durable storage);
    raises when none is left."""

    name: str
    size: int
    chunk_bytes: int
    crcs: list[int]
    path: str
    whole_local: bool
    verified: set[int] = field(default_factory=set)
    wanted: set[int] = field(default_factory=set)  # every chunk asked for so far
    bytes_read: int = 0
    served: dict[str, int] = field(default_factory=dict)  # chunks verified, by the kind of copy (local, peer, durable)

    def ensure(self, chunks: list[int], fetchers: list) -> list[dict]:
        """Make `chunks` present and verified, from the node's whole copy when it has one, else
        from each of `fetchers` ((label, fetch([(offset, size), ...]) -> [bytes, ...])) in turn:
        each run of consecutive chunks is one range, and the ranges go to a copy in batches of
        up to MAX_READ bytes, one call a batch (a ZeRO-3 reshard needs a piece of every parameter
        from each old partition: thousands of ranges, which one round trip each would make slow).
        Returns the bad copies met. A bad chunk in the node's copy moves every chunk to a sparse
        copy. Raises ChunkUnavailable when a chunk has no good copy."""
        bad: list[dict] = []
        self.wanted.update(chunks)
        sources = [("local", self._read_local)] if self.whole_local else list(fetchers)
        for label, fetch in sources:
            for batch in batches(runs(sorted(self.wanted - self.verified), max(1, MAX_READ // self.chunk_bytes)),
                                 MAX_READ // self.chunk_bytes):
                spans = [(first * self.chunk_bytes, min(self.size, (last + 1) * self.chunk_bytes)) for first, last in batch]
                try:
                    got = fetch([(lo, hi - lo) for lo, hi in spans])
                except Exception as exc:  # the peer or storage is gone: the next copy
                    bad.append({"file": self.name, "copy": label,
                                "reason": f"chunk {batch[0][0]}: {type(exc).__name__}: {exc}"})
                    continue
                pieces = []
                for (first, last), (lo, _), data in zip(batch, spans, got):
                    self.bytes_read += len(data)
                    view, good = memoryview(data), []
                    for i in range(first, last + 1):
                        met = self._verify(i, view[i * self.chunk_bytes - lo:(i + 1) * self.chunk_bytes - lo], label)
                        bad += met
                        if not met:
                            good.append(i)
                    if label != "local":  # into the sparse copy: the whole run at once, else its good chunks
                        pieces += [(lo, view)] if len(good) == last - first + 1 else \
                            [(i * self.chunk_bytes, view[i * self.chunk_bytes - lo:(i + 1) * self.chunk_bytes - lo])
                             for i in good]
                self._write(pieces)
        missing = sorted(self.wanted - self.verified)
        if missing and self.whole_local:  # the node's copy is bad here: every chunk from elsewhere
            self.whole_local, self.path, self.verified, self.served = False, self.path + ".sparse", set(), {}
            return bad + self.ensure([], fetchers)
        if missing:
            raise ChunkUnavailable(self.name, missing[0], bad)
        return bad

    def _verify(self, i: int, data: bytes, label: str) -> list[dict]:
        """Count chunk i verified if its bytes from copy `label` are the manifest's; else the bad copy."""
        want = min(self.chunk_bytes, self.size - i * self.chunk_bytes)
        if len(data) == want and crc32(data) == self.crcs[i]:
            self.verified.add(i)
            kind = label.split(":")[0]
            self.served[kind] = self.served.get(kind, 0) + 1
            return []
        return [{"file": self.name, "copy": label,
                 "reason": f"chunk {i}: {len(data)} bytes, crc32 {crc32(data):#010x}; manifest says "
                           f"{want} bytes, crc32 {self.crcs[i]:#010x}"}]

    def _read_local(self, spans: list[tuple[int, int]]) -> list[memoryview]:
        return unpack(read_packed(self.path, spans), spans)

    def _write(self, pieces: list[tuple[int, bytes]]) -> None:
        """Write (offset, bytes) pieces into the sparse copy, opened once."""
        if not pieces:
            return
        if not os.path.exists(self.path):
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "wb") as f:
                f.truncate(self.size)  # holes: no bytes stored, zeros if read
        with open(self.path, "r+b") as f:
            for offset, data in pieces:
                f.seek(offset)
                f.write(data)


def load_skeleton(copy: "ChunkedCopy", fetchers: list):
    """The structure of `copy`'s file (load_meta), from its first and last chunks, and more of
    each end while that is not enough; returns (structure, bad copies met)."""
    n = -(-copy.size // copy.chunk_bytes)
    bad, k = [], max(1, SKELETON_START // copy.chunk_bytes)
    while True:
        bad += copy.ensure(sorted({*range(min(k, n)), *range(max(0, n - k), n)}), fetchers)
        try:
            return load_meta(copy.path), bad
        except Exception as exc:  # the pickle or the zip directory reaches past the chunks held
            if 2 * k >= n:
                raise ChunkUnavailable(copy.name, -1, bad + [{"file": copy.name, "copy": "verified chunks",
                                                              "reason": f"not a torch.save file: {exc}"}]) from exc
            k *= 2


def tensors_in(item, path: str = ""):
    """(path, tensor) of every tensor in a loaded state dict: containers, and the attributes of
    other objects (DeepSpeed's loss scaler). Paths are alike in every rank's file."""
    import torch

    if torch.is_tensor(item):
        yield path, item
    elif isinstance(item, dict):
        for k, v in item.items():
            yield from tensors_in(v, f"{path}/{k}")
    elif isinstance(item, (list, tuple)):
        for i, v in enumerate(item):
            yield from tensors_in(v, f"{path}/{i}")
    elif hasattr(item, "__dict__") and not isinstance(item, type):
        yield from tensors_in(vars(item), f"{path}.")


def storage_range(t) -> tuple[int, int]:
    """Bytes [lo, hi) of its file that a meta-loaded tensor's whole storage covers."""
    storage = t.untyped_storage()
    return storage._checkpoint_offset, storage._checkpoint_offset + storage.nbytes()


class ChunkUnavailable(Exception):
    def __init__(self, name: str, chunk: int, bad: list[dict]):
        super().__init__(f"no good copy of {f'chunk {chunk}' if chunk >= 0 else 'the structure'} of {name}: "
                         + "; ".join(f"{b['copy']}: {b['reason']}" for b in bad))
        self.name, self.chunk, self.bad = name, chunk, bad

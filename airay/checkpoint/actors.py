"""NodeStore: the Ray actor that keeps one node's memory tier, one per node that trains.

It outlives the training processes of its node (a killed worker's files stay servable), receives
its ring predecessor's shards as peer copies, records each committed step's manifest, serves its
files in chunks to ranks on other nodes, and prunes. It holds no checkpoint in its own memory
beyond a few chunks at a time: the files are in the node's memory tier (/dev/shm).

It runs its calls on several threads (STORE_THREADS): an 8-GPU node's ranks copy to it, peers
read from it for a recovery and its uploads run at once, none queued behind another. Chunks of
one peer copy still land in order (a running CRC-32 is kept per file).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from airay.checkpoint.budget import NodeMemory
from airay.checkpoint.checksum import crc32
from airay.checkpoint.tiers import MemoryTier

STORE_THREADS = 8
# A call moving bytes may take this long plus a second per IO_FLOOR_BYTES_S it moves: the
# slowest rate a healthy node's memory or network is assumed to reach (a fixed bound would be
# too tight for a 10 GB file, or far too loose for a 64 MiB chunk).
IO_BASE_S = 30.0
IO_FLOOR_BYTES_S = 20 << 20


def io_timeout_s(nbytes: int, base_s: float = IO_BASE_S) -> float:
    """How long a call that moves `nbytes` may take before it has failed."""
    return base_s + nbytes / IO_FLOOR_BYTES_S


def host_id() -> str:
    """This machine, whichever raylet asks: raylets of one host share its memory."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


class NodeStore:
    def __init__(self, base: str, job: dict):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.tier = MemoryTier(base, self.node_id, job)
        self.foreign = self.tier.open()
        self._incoming: dict[tuple[int, str], tuple[int, int]] = {}  # (step, file) -> (next offset, running crc32)
        self._arrived = threading.Condition()  # a chunk of some peer copy was written

    def memory(self) -> dict:
        """This node's memory figures (NodeMemory's fields) for the tier's budget."""
        import psutil

        vm = psutil.virtual_memory()
        shm = os.statvfs(self.tier.root)
        return NodeMemory(self.node_id, host_id(), vm.total, vm.available, shm.f_blocks * shm.f_frsize,
                          shm.f_bavail * shm.f_frsize, self.tier.bytes()).__dict__

    def info(self) -> dict:
        """This node's id, its memory directory, and another job's stamp it found (and cleared)."""
        return {"node_id": self.node_id, "root": str(self.tier.root), "foreign": self.foreign}

    def receive(self, step: int, name: str, offset: int, data: bytes) -> int:
        """Write a chunk of a peer copy; returns the bytes written. Chunks of one file are sent
        two at a time and may run on two threads: each waits for the one before it."""
        key = (step, name)
        with self._arrived:
            if offset == 0:
                self._incoming[key] = (0, 0)
            if not self._arrived.wait_for(lambda: self._incoming.get(key, (None,))[0] == offset,
                                          timeout=io_timeout_s(len(data))):
                raise TimeoutError(f"chunk at {offset} of {name} of step {step}: the chunk before it never came")
        path = self.tier.step_dir(step) / f".{name}.part"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(data)
        with self._arrived:
            self._incoming[key] = (offset + len(data), crc32(data, self._incoming[key][1]))
            self._arrived.notify_all()
        return len(data)

    def received(self, step: int, name: str, size: int, crc32: int) -> bool:
        """A peer copy is complete: keep it if it arrived whole (size and CRC-32 of the sender's)."""
        part = self.tier.step_dir(step) / f".{name}.part"
        with self._arrived:
            got = self._incoming.pop((step, name), (None, None))[1]
        if not part.exists() or part.stat().st_size != size or got != crc32:
            part.unlink(missing_ok=True)
            return False
        os.replace(part, self.tier.step_dir(step) / name)
        return True

    def commit(self, step: int, manifest_json: str) -> dict:
        """Record a committed step's manifest here; returns this node's memory figures after it."""
        self.tier.commit(step, manifest_json)
        return self.memory()

    def catalog(self) -> dict[int, dict]:
        """{step: {"manifest": whether it is committed here, "files": {name: size}}} of every step
        here (the manifests themselves are read one at a time: `manifest`)."""
        return {step: {"manifest": (self.tier.step_dir(step) / "manifest.json").exists(),
                       "files": self.tier.files(step)} for step in self.tier.steps()}

    def manifest(self, step: int) -> str | None:
        """The text of a step's manifest here, or None."""
        path = self.tier.step_dir(step) / "manifest.json"
        return path.read_text() if path.exists() else None

    def usage(self) -> dict[int, int]:
        """{step: bytes} this node holds of each step (its own files, peer copies, partial ones)."""
        return {step: sum(p.stat().st_size for p in self.tier.step_dir(step).iterdir() if p.is_file())
                for step in self.tier.steps()}

    def read(self, step: int, name: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of a file from `offset` (b"" past its end)."""
        with open(self.tier.step_dir(step) / name, "rb") as f:
            f.seek(offset)
            return f.read(size)

    def read_packed(self, step: int, name: str, spans: list[tuple[int, int]]):
        """Each (offset, size) of a file, back to back (ranges.read_packed): a resharding rank's
        pieces in one call."""
        from airay.checkpoint.ranges import read_packed

        return read_packed(self.tier.step_dir(step) / name, spans)

    def upload(self, step: int, names: list[str], location: str) -> dict:
        """Upload files of `step` this node holds to durable storage (for a rank lost mid-upload);
        returns {file: [size, crc32]} of the bytes sent, as a rank's upload does, or {"missing":
        [names]} when this node holds no complete copy of some (a peer copy cut short by the loss
        of the node that sent it): then nothing is sent."""
        import time

        from airay.checkpoint.layout import step_name
        from airay.checkpoint.storage import Storage

        missing = [name for name in names if not (self.tier.step_dir(step) / name).is_file()]
        if missing:
            return {"missing": missing}
        storage, start = Storage(location), time.time()
        sent = {name: list(storage.upload_file(self.tier.step_dir(step) / name, f"{step_name(step)}/{name}"))
                for name in names}
        return {"files": sent, "window": [start, time.time()]}

    def drop_files(self, files: dict[int, list[str]]) -> int:
        """Remove these files of these steps ({step: [names]}: peer copies the budget gives up);
        returns the bytes freed."""
        freed = 0
        for step, names in files.items():
            for name in names:
                path = self.tier.step_dir(int(step)) / name
                try:
                    freed += path.stat().st_size
                    path.unlink()
                except FileNotFoundError:
                    pass
        return freed

    def prune(self, keep: list[int]) -> list[int]:
        return self.tier.prune(set(keep))

    def remove(self) -> None:
        self.tier.remove()

    def damage(self, step: int, name: str) -> str:
        """Chaos: flip bytes in the middle of this node's copy of a file (a bad memory copy)."""
        path = self.tier.step_dir(step) / name
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.seek(size // 2)
            chunk = f.read(16)
            f.seek(size // 2)
            f.write(bytes(b ^ 0xFF for b in chunk))
        return str(path)

    def drop(self, step: int) -> list[str]:
        """Chaos: this node's copies of a step are lost (the files go, as with the node's memory)."""
        d = self.tier.step_dir(step)
        names = sorted(p.name for p in d.iterdir()) if d.is_dir() else []
        import shutil

        shutil.rmtree(d, ignore_errors=True)
        return names


def start_store(node_id: str, base: str, job: dict):
    """A node's NodeStore actor, pinned to it, on STORE_THREADS threads (not waited for)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(NodeStore).options(
        num_cpus=0, max_restarts=0, max_concurrency=STORE_THREADS,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(base, job)


def push_copy(store, step: int, path: str | os.PathLike, size: int, crc32: int, chunk: int = 64 << 20) -> bool:
    """Send a local file to another node's store, in chunks through the object store (two in
    flight: never more than two chunks of the file in memory); True if it arrived whole."""
    import ray

    name = Path(path).name
    pending = []
    with open(path, "rb") as f:
        offset = 0
        while True:
            data = f.read(chunk)
            if not data and offset:
                break
            pending.append(store.receive.remote(step, name, offset, data))
            offset += len(data)
            if len(pending) >= 2:
                ray.get(pending.pop(0), timeout=io_timeout_s(2 * chunk))
            if len(data) < chunk:
                break
    ray.get(pending, timeout=io_timeout_s(2 * chunk))
    return ray.get(store.received.remote(step, name, size, crc32), timeout=io_timeout_s(0))

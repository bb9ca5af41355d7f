"""NodeStore: the Ray actor that keeps one node's memory tier, one per node that trains.

It outlives the training processes of its node (a killed worker's files stay servable), receives
its ring predecessor's shards as peer copies, records each committed step's manifest, serves its
files in chunks to ranks on other nodes, and prunes. It holds no checkpoint in its own memory
beyond one chunk at a time: the files are in the node's memory tier (/dev/shm).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

from airay.checkpoint.tiers import MemoryTier


class NodeStore:
    def __init__(self, base: str, job: dict):
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.tier = MemoryTier(base, self.node_id, job)
        self.foreign = self.tier.open()
        self._incoming: dict[tuple[int, str], int] = {}  # (step, file) -> running crc32 of a peer copy

    def info(self) -> dict:
        """This node's id, its memory directory, and another job's stamp it found (and cleared)."""
        return {"node_id": self.node_id, "root": str(self.tier.root), "foreign": self.foreign}

    def receive(self, step: int, name: str, offset: int, data: bytes) -> int:
        """Write a chunk of a peer copy (chunks arrive in order); returns the bytes written."""
        path = self.tier.step_dir(step) / f".{name}.part"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.write(data)
        key = (step, name)
        self._incoming[key] = zlib.crc32(data, self._incoming.get(key, 0) if offset else 0)
        return len(data)

    def received(self, step: int, name: str, size: int, crc32: int) -> bool:
        """A peer copy is complete: keep it if it arrived whole (size and CRC-32 of the sender's)."""
        part = self.tier.step_dir(step) / f".{name}.part"
        got = self._incoming.pop((step, name), None)
        if not part.exists() or part.stat().st_size != size or got != crc32:
            part.unlink(missing_ok=True)
            return False
        os.replace(part, self.tier.step_dir(step) / name)
        return True

    def commit(self, step: int, manifest_json: str) -> None:
        self.tier.commit(step, manifest_json)

    def catalog(self) -> dict[int, dict]:
        """{step: {"manifest": whether it is committed here, "files": {name: size}}} of every step
        here (the manifests themselves are read one at a time: `manifest`)."""
        return {step: {"manifest": (self.tier.step_dir(step) / "manifest.json").exists(),
                       "files": self.tier.files(step)} for step in self.tier.steps()}

    def manifest(self, step: int) -> str | None:
        """The text of a step's manifest here, or None."""
        path = self.tier.step_dir(step) / "manifest.json"
        return path.read_text() if path.exists() else None

    def read(self, step: int, name: str, offset: int, size: int) -> bytes:
        """Up to `size` bytes of a file from `offset` (b"" past its end)."""
        with open(self.tier.step_dir(step) / name, "rb") as f:
            f.seek(offset)
            return f.read(size)

    def upload(self, step: int, names: list[str], location: str) -> dict:
        """Upload files of `step` this node holds to durable storage (for a rank lost mid-upload);
        returns {file: [size, crc32]} of the bytes sent, as a rank's upload does."""
        import time

        from airay.checkpoint.layout import step_name
        from airay.checkpoint.storage import Storage

        storage, start = Storage(location), time.time()
        sent = {name: list(storage.upload_file(self.tier.step_dir(step) / name, f"{step_name(step)}/{name}"))
                for name in names}
        return {"files": sent, "window": [start, time.time()]}

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
                ray.get(pending.pop(0), timeout=300)
            if len(data) < chunk:
                break
    ray.get(pending, timeout=300)
    return ray.get(store.received.remote(step, name, size, crc32), timeout=300)

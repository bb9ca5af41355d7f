"""The two places a checkpoint lives: each node's memory, and durable storage.

MemoryTier: a directory in a node's memory (/dev/shm), private to the user (0700; a directory
owned by someone else is refused) and stamped with the job's identity: a different job's
checkpoints left on the same path are never resumed (they are cleared, and the caller records
it). Each node's directory is named after the node, so raylets that share one machine (a local
cluster) keep their tiers apart as separate machines would.

DurableTier: `checkpoint.path`, a shared directory or any pyarrow filesystem URI. Its root is
stamped too; a run of another job on it fails before any actor starts. A step is complete when
its manifest is there and every file it lists has its size (checked from a listing: the driver
reads manifests, never checkpoint bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from airay.checkpoint.checksum import crc32
from airay.checkpoint.layout import KEEP_MARKER, MANIFEST, OWNER, CheckpointInfo, Manifest, private_dir, \
    step_name, step_of
from airay.checkpoint.storage import Storage, display
from airay.config import ConfigError


def default_memory_path() -> Path:
    """Where memory tiers live when the spec sets no checkpoint.memory_path: node memory."""
    return Path("/dev/shm/airay" if os.path.isdir("/dev/shm") else os.path.join(tempfile.gettempdir(), "airay-mem"))


def memory_base(base: str | None, durable: str) -> Path:
    """The job's memory-tier directory on every node: one per durable location, the same on every
    run, so a job re-run on the same nodes finds its memory checkpoints."""
    if base is None:
        base = default_memory_path()
    key = hashlib.sha1(display(durable).encode()).hexdigest()[:12]
    return Path(base) / f"ckpt-{key}"


def node_dir(base: str | os.PathLike, node_id: str) -> Path:
    """A node's own memory tier under the job's: named after the node, so raylets sharing one
    machine (a local cluster) keep their tiers apart as separate machines would."""
    return Path(base) / f"node-{node_id[:16]}"


def scratch_dir() -> Path:
    """Node-local memory for this process's files on their way somewhere (a load's directory)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(base) / f"airay-{os.getpid()}"


def remove_stale_scratch() -> list[Path]:
    """Delete scratch directories of processes that no longer exist (a worker killed mid-load
    leaves its files in node memory)."""
    removed = []
    for d in scratch_dir().parent.glob("airay-*"):
        pid = d.name.removeprefix("airay-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


class ForeignCheckpoints(ConfigError):
    """The durable tier holds another job's checkpoints: the user must pick another path."""


class MemoryTier:
    """One node's memory tier: `<base>/node-<id>/step_NNNNNNNN/`."""

    def __init__(self, base: str | os.PathLike, node_id: str, job: dict):
        self.base, self.job = Path(base), job
        self.root = node_dir(base, node_id)

    def open(self) -> dict | None:
        """Create the tier (private, stamped). A tier stamped by another job is cleared; returns
        that job's stamp then (for the caller's event), else None."""
        private_dir(self.base)
        private_dir(self.root)
        stamp = self.root / OWNER
        foreign = None
        if stamp.exists():
            try:
                owner = json.loads(stamp.read_text())
            except ValueError:
                owner = {"id": None, "unreadable": True}
            if owner.get("id") != self.job["id"]:
                foreign = owner
                for child in self.root.iterdir():
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        if foreign is not None or not stamp.exists():
            tmp = stamp.with_name(OWNER + ".tmp")
            tmp.write_text(json.dumps({**self.job, "uid": os.getuid(), "created": time.time()}))
            os.replace(tmp, stamp)
        return foreign

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def steps(self) -> list[int]:
        return sorted(step_of(p.name) for p in self.root.glob("step_*") if p.is_dir())

    def files(self, step: int) -> dict[str, int]:
        d = self.step_dir(step)
        return {p.name: p.stat().st_size for p in d.iterdir()
                if p.is_file() and not p.name.startswith(".") and p.name != MANIFEST} if d.is_dir() else {}

    def bytes(self) -> int:
        """Bytes of every file in the tier (steps, peer copies, partial ones)."""
        return sum(p.stat().st_size for p in self.root.glob("step_*/*") if p.is_file())

    def manifest(self, step: int) -> Manifest | None:
        path = self.step_dir(step) / MANIFEST
        try:
            return Manifest.from_json(path.read_text())
        except (OSError, ValueError):
            return None

    def commit(self, step: int, manifest_json: str) -> None:
        """Write the step's manifest, atomically (the step is complete on this node's books)."""
        d = self.step_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / (MANIFEST + ".tmp")
        tmp.write_text(manifest_json)
        os.replace(tmp, d / MANIFEST)

    def prune(self, keep: set[int]) -> list[int]:
        """Remove every step directory not in `keep` (committed or not); returns the steps removed."""
        removed = []
        for step in self.steps():
            if step not in keep:
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
                removed.append(step)
        return removed

    def remove(self) -> None:
        """The run is over: the job's whole memory tier goes (every node directory visible here)."""
        shutil.rmtree(self.base, ignore_errors=True)


class DurableTier:
    def __init__(self, location: str, job: dict):
        self.storage, self.job = Storage(location), job
        if self.storage.is_local:
            Path(self.storage.base).mkdir(parents=True, exist_ok=True)

    @classmethod
    def reading(cls, location: str) -> "DurableTier":
        """The tier at `location` opened to read or prune (`airay checkpoints`, `airay prune`), not
        to write a run's checkpoints: no owner claimed, nothing created."""
        tier = cls.__new__(cls)
        tier.storage, tier.job = Storage(location), {}
        return tier

    @property
    def location(self) -> str:
        return self.storage.location

    def claim(self) -> None:
        """Stamp the tier with this job, or refuse it if another job's checkpoints are there."""
        try:
            owner = json.loads(self.storage.read_bytes(OWNER))
        except (OSError, ValueError):
            owner = None
        if owner is not None and owner.get("id") != self.job["id"]:
            raise ForeignCheckpoints(
                f"checkpoint.path {self.storage.uri()} holds the checkpoints of job '{owner.get('name')}' "
                f"(id {owner.get('id')}), not of this job '{self.job['name']}' (id {self.job['id']}: its name, "
                "model and ZeRO stage); give this job its own checkpoint.path, or run the same job to resume")
        if owner is None:
            self.storage.write_bytes(OWNER, json.dumps({**self.job, "created": time.time()}).encode())

    def complete(self) -> list[CheckpointInfo]:
        """Every complete step, newest first (manifest there, every listed file of its size)."""
        out = []
        for name in sorted((n for n in self.storage.list_dirs() if n.startswith("step_")), reverse=True):
            info = self.verify(name)
            if info is not None:
                out.append(info)
        return out

    def verify(self, name: str) -> CheckpointInfo | None:
        try:
            manifest = Manifest.from_json(self.storage.read_bytes(f"{name}/{MANIFEST}"))
        except (OSError, ValueError, KeyError):
            return None
        sizes = self.storage.sizes(name)
        if any(sizes.get(n) != f.size for n, f in manifest.files.items()):
            return None
        return CheckpointInfo(manifest.step, manifest.world_size, manifest.bytes, "durable", self.storage.uri(name),
                              manifest.created, keep=KEEP_MARKER in sizes, manifest=manifest)

    def commit(self, manifest: Manifest) -> float:
        """Write the step's manifest last (its files are uploaded and fsynced): the step is durable."""
        name = step_name(manifest.step)
        self.storage.sync_dir(name)
        manifest.created = time.time()
        self.storage.write_bytes(f"{name}/{MANIFEST}", manifest.to_json().encode())
        return manifest.created

    def prune(self, keep_last: int, protect: set[int] = frozenset(), dry_run: bool = False) -> list[int]:
        """Delete all but the newest `keep_last` complete steps (and incomplete older ones), never
        one marked KEEP, one in `protect`, or one newer than the newest complete step (it may
        still be uploading). Returns the steps deleted (`dry_run`: that would be)."""
        removed, complete_seen, newest_seen = [], 0, False
        for name in sorted((n for n in self.storage.list_dirs() if n.startswith("step_")), reverse=True):
            info = self.verify(name)
            if info is not None and not info.keep:
                complete_seen += 1
                newest_seen = True
            step = step_of(name)
            if not newest_seen or step in protect or (info is not None and info.keep):
                continue
            if info is None or complete_seen > max(1, keep_last):
                if not dry_run:
                    self.storage.delete_dir(name)
                removed.append(step)
        return removed

    def reject(self, step: int) -> str:
        """Set a step with a corrupt file aside (kept for inspection, never loaded again)."""
        name = step_name(step)
        self.storage.move_dir(name, "rejected_" + name)
        return self.storage.uri("rejected_" + name)


def describe(location: str, check_crc: bool = False) -> list[dict]:
    """One row per step directory (and set-aside one) of a durable tier, newest first: step,
    world size, bytes and status: verified (manifest and sizes, and with `check_crc` checksums,
    hold), incomplete (no manifest or a file missing or short: never loaded), corrupt (a checksum
    differs), rejected (set aside by a run). For `airay checkpoints`, which may read every byte."""

    tier = DurableTier.reading(location)
    storage = tier.storage
    rows = []
    names = sorted((n for n in storage.list_dirs() if n.startswith(("step_", "rejected_step_"))),
                   key=lambda n: (step_of(n), n), reverse=True)
    for name in names:
        info = tier.verify(name)
        row = {"step": step_of(name), "tier": "durable", "path": storage.uri(name), "world_size": None,
               "bytes": sum(storage.sizes(name).values()), "keep": False}
        if info is not None:
            row.update(world_size=info.world_size, bytes=info.bytes, keep=info.keep)
        if name.startswith("rejected_"):
            row["status"] = "rejected"
        elif info is None:
            row["status"] = "incomplete"
        else:
            row["status"] = "verified"
            if check_crc:
                for fname, entry in info.manifest.files.items():
                    crc = 0
                    for chunk in storage.chunks(f"{name}/{fname}"):
                        crc = crc32(chunk, crc)
                    if crc != entry.crc32:
                        row["status"] = "corrupt"
                        break
        rows.append(row)
    return rows


def describe_memory(base: str | os.PathLike) -> list[dict]:
    """The memory-tier steps this machine holds (every node directory under the job's), newest
    first: complete where a manifest is and every file it lists for that node's ranks is here."""
    rows = []
    for node in sorted(Path(base).glob("node-*")):
        for step_path in sorted(node.glob("step_*"), reverse=True):
            try:
                manifest = Manifest.from_json((step_path / MANIFEST).read_text())
            except (OSError, ValueError):
                manifest = None
            held = {p.name: p.stat().st_size for p in step_path.iterdir() if p.is_file() and p.name != MANIFEST}
            rows.append({"step": step_of(step_path.name), "tier": "memory", "path": str(step_path),
                         "world_size": manifest.world_size if manifest else None, "bytes": sum(held.values()),
                         "keep": False, "status": "committed" if manifest else "incomplete"})
    return sorted(rows, key=lambda r: -r["step"])

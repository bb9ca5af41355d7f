"""Checkpoint layout, verification, tiers, resharding and retention.

One directory per committed step, in each tier that holds it:

    step_00000010/
      native/        DeepSpeed's own save (one file per rank's ZeRO partition)
      universal/     the same state as one file per parameter (DeepSpeed universal
                     checkpoint), loadable at any world size
      manifest.json  written last: the step, world size, format, every file's size and CRC-32
      KEEP           optional: a checkpoint marked to keep is never pruned

Two tiers. The durable tier is `checkpoint.path`: a directory shared by the nodes, or any pyarrow
filesystem URI (s3://, gs://, ...; airay.storage). The memory tier (`checkpoint.fast_every_n_steps`)
is a directory in the memory of the driver's node (/dev/shm), written more often, loaded first.
Each committed memory-tier checkpoint is then copied, in the background, to a replica actor on a
peer node (MemoryReplica, in that node's memory), so losing the driver node's memory (or the
committer holding it) still recovers from memory: the newest complete copy that answers wins.

Saving never writes the ranks' files where they become visible: each rank saves into its own
node's memory (the only time the step loop blocks), hands its files to the committer actor
through Ray's object store, and the committer assembles the checkpoint, reshards it to the
universal format, writes the manifest last, and (on durable steps) uploads the files then the
manifest: with a memory tier after the step is committed there, in the committer's upload thread,
so no later save waits for an upload (Checkpointer, UploadQueue). A step directory without a
manifest that matches the files' sizes is incomplete and is never loaded. Before a checkpoint is
loaded its files' CRC-32s are checked too; one that does not match is corrupt: it is set aside (renamed rejected_step_NNNNNNNN, event
checkpoint_rejected) and the next newest is loaded instead. Resharding is DeepSpeed universal
checkpointing: ZeRO 1-3 partitions are merged per parameter once, off the step loop, so
recovery at a new world size only reads files.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from airay.storage import Storage, display

MANIFEST = "manifest.json"
KEEP_MARKER = "KEEP"
NATIVE_TAG = "native"
UNIVERSAL_TAG = "universal"
TIERS = ("memory", "durable")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / step_name(step)


def memory_root(base: str | os.PathLike | None, durable: str) -> Path:
    """The memory tier's directory for a durable location: one per checkpoint path, the same on
    every run of the job, so a job re-run on the same node finds its memory checkpoints."""
    if base is None:
        base = "/dev/shm/airay" if os.path.isdir("/dev/shm") else os.path.join(tempfile.gettempdir(), "airay-mem")
    key = hashlib.sha1(display(durable).encode()).hexdigest()[:12]
    return Path(base) / f"ckpt-{key}"


def replica_root(memory: str | os.PathLike) -> Path:
    """Where the memory tier's replica keeps its copies on its (peer) node: beside the primary's
    name, so nodes sharing one /dev/shm (a local cluster) never mix the two."""
    return Path(str(memory) + "-replica")


def scratch_root() -> Path:
    """Node-local memory for files on their way somewhere (a rank's save, a load's download)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return Path(base) / f"airay-{os.getpid()}"


def remove_stale_scratch() -> list[Path]:
    """Delete scratch directories of processes that no longer exist (a worker killed between
    its save and the hand-off leaves its files in node memory)."""
    base = scratch_root().parent
    removed = []
    for d in base.glob("airay-*"):
        pid = d.name.removeprefix("airay-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str  # a local path or a URI
    world_size: int
    load_tag: str  # the DeepSpeed tag to load: universal, or native for ZeRO stage 0
    bytes: int
    committed_ts: float = 0.0  # unix time the manifest was written
    tier: str = "durable"
    keep: bool = False  # marked KEEP: never pruned
    root: str = ""  # the tier's location (airay.storage.Storage), with any URI parameters
    name: str = ""  # the step directory's name under root
    copy: str = "primary"  # memory tier: primary (driver's node, the committer) or replica (a peer node)


def _files_with_sizes(root: Path, subdirs: list[str]) -> dict[str, int]:
    out = {}
    for sub in subdirs:
        for p in sorted((root / sub).rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = p.stat().st_size
    return out


def crc32(path: str | os.PathLike) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _as_storage(root: str | os.PathLike | Storage) -> Storage:
    return root if isinstance(root, Storage) else Storage(root)


def _split(path: str | os.PathLike) -> tuple[Storage, str]:
    p = Path(path)
    return Storage(p.parent), p.name


def convert_to_universal(path: str | os.PathLike) -> float:
    """Merge the native ZeRO partitions under `path` into a universal checkpoint; returns seconds."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    path = Path(path)
    t0 = time.perf_counter()
    out = path / UNIVERSAL_TAG
    shutil.rmtree(out, ignore_errors=True)
    args = Namespace(input_folder=str(path / NATIVE_TAG), output_folder=str(out), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    # ds_to_universal prints progress bars for every parameter; keep the logs readable.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)
    return time.perf_counter() - t0


def commit(path: str | os.PathLike, step: int, world_size: int, zero_stage: int,
           tier: str = "durable") -> CheckpointInfo:
    """Make a fully written local checkpoint visible: reshard it if needed, then write its manifest last."""
    path = Path(path)
    load_tag = UNIVERSAL_TAG if zero_stage > 0 else NATIVE_TAG
    if load_tag == UNIVERSAL_TAG:
        convert_to_universal(path)
    files = _files_with_sizes(path, list(dict.fromkeys([NATIVE_TAG, load_tag])))
    created = time.time()
    checksums = {rel: crc32(path / rel) for rel in files}
    manifest = {"step": step, "world_size": world_size, "zero_stage": zero_stage, "load_tag": load_tag,
                "created": created, "files": files, "crc32": checksums}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path / MANIFEST)  # atomic: readers see no manifest or a whole one
    return CheckpointInfo(step, str(path), world_size, load_tag, sum(files.values()), created, tier,
                          root=str(path.parent), name=path.name)


def publish(local: str | os.PathLike, storage: Storage, name: str) -> float:
    """Copy a committed local checkpoint to `storage`: every file first, the manifest last, so
    the copy is visible only when whole (object stores have no rename). Returns the commit time."""
    local = Path(local)
    manifest = json.loads((local / MANIFEST).read_text())
    storage.delete_dir(name)  # a partial copy from a run that died while uploading
    storage.upload(local, name, sorted(manifest["files"]))
    manifest["created"] = time.time()
    storage.write_bytes(f"{name}/{MANIFEST}", json.dumps(manifest, indent=1).encode())
    return manifest["created"]


def verify_at(storage: Storage, name: str, tier: str = "durable") -> CheckpointInfo | None:
    """The checkpoint's info if its manifest exists and every listed file has its size, else None."""
    try:
        manifest = json.loads(storage.read_bytes(f"{name}/{MANIFEST}"))
    except (OSError, ValueError):
        return None
    if not manifest.get("files"):
        return None
    sizes = storage.sizes(name)
    if any(sizes.get(rel) != size for rel, size in manifest["files"].items()):
        return None
    return CheckpointInfo(manifest["step"], storage.uri(name), manifest["world_size"], manifest["load_tag"],
                          sum(manifest["files"].values()), manifest.get("created", 0.0), tier,
                          keep=KEEP_MARKER in sizes, root=storage.location, name=name)


def verify(path: str | os.PathLike) -> CheckpointInfo | None:
    return verify_at(*_split(path))


def corrupt_files_at(storage: Storage, name: str) -> list[str]:
    """Files of a size-verified checkpoint whose CRC-32 differs from its manifest's (reads them all)."""
    manifest = json.loads(storage.read_bytes(f"{name}/{MANIFEST}"))
    bad = []
    for rel, expected in manifest.get("crc32", {}).items():
        crc = 0
        for chunk in storage.chunks(f"{name}/{rel}"):
            crc = zlib.crc32(chunk, crc)
        if crc != expected:
            bad.append(rel)
    return bad


def corrupt_files(path: str | os.PathLike) -> list[str]:
    return corrupt_files_at(*_split(path))


def reject_at(storage: Storage, name: str) -> str:
    """Set a corrupt checkpoint aside, out of the step directories (kept for inspection, not
    loaded again); returns where it went."""
    storage.move_dir(name, "rejected_" + name)
    return storage.uri("rejected_" + name)


def reject(path: str | os.PathLike) -> Path:
    return Path(reject_at(*_split(path)))


def step_names(storage: Storage) -> list[str]:
    """Step directories, newest first."""
    return sorted((n for n in storage.list_dirs() if n.startswith("step_")), reverse=True)


def step_dirs(root: str | os.PathLike) -> list[Path]:
    storage = Storage(root)
    return [Path(storage.full(n)) for n in step_names(storage)]


def complete(root: str | os.PathLike | Storage, tier: str = "durable") -> list[CheckpointInfo]:
    """Every checkpoint under `root` whose manifest and sizes hold, newest first."""
    storage = _as_storage(root)
    return [info for n in step_names(storage) if (info := verify_at(storage, n, tier)) is not None]


def latest_complete(root: str | os.PathLike | Storage) -> CheckpointInfo | None:
    """The newest verified checkpoint; incomplete or corrupt ones are skipped."""
    found = complete(root)
    return found[0] if found else None


def load_order(candidates: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """The order to try checkpoints in: newest step first; at the same step the memory tier
    first (it loads faster than storage), its primary copy before the replica (on the driver's
    node, where the committer serves it without crossing the network twice)."""
    return sorted(candidates, key=lambda c: (-c.step, TIERS.index(c.tier), c.copy != "primary"))


def prune(root: str | os.PathLike | Storage, keep_last: int,
          protect: str | os.PathLike | list | tuple | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` verified checkpoints (and incomplete older dirs).

    Never deletes `protect` (the checkpoint being loaded or just committed; a list or tuple for
    several, e.g. memory-tier steps still being uploaded), one marked KEEP, or a directory newer
    than the newest verified one (it may still be being written); keep_last is at least 1, so
    the newest good checkpoint always stays.
    """
    storage = _as_storage(root)
    keep_last = max(1, keep_last)
    protected = protect if isinstance(protect, (list, tuple)) else [] if protect is None else [protect]
    protect_names = {Path(str(p).split("?", 1)[0]).name for p in protected}
    removed = []
    verified_seen = 0
    newest_verified_passed = False
    for name in step_names(storage):
        info = verify_at(storage, name)
        if info is not None and not info.keep:
            verified_seen += 1
            newest_verified_passed = True
        if not newest_verified_passed or name in protect_names or (info is not None and info.keep):
            continue
        if info is None or verified_seen > keep_last:
            storage.delete_dir(name)
            removed.append(Path(storage.full(name)))
    return removed


def describe(root: str | os.PathLike | Storage, tier: str = "durable", check_crc: bool = False) -> list[dict]:
    """One row per step directory (and set-aside one) under `root`, newest first: step, world
    size, tier, bytes, and status: verified (manifest, sizes and, with `check_crc`, checksums
    hold), incomplete (no manifest or a file missing or short: never loaded), corrupt (a
    checksum differs) or rejected (set aside by a run)."""
    storage = _as_storage(root)
    rows = []
    names = sorted((n for n in storage.list_dirs() if n.startswith(("step_", "rejected_step_"))),
                   key=lambda n: (int(n.rsplit("_", 1)[-1]), n), reverse=True)
    for name in names:
        info = verify_at(storage, name, tier)
        row = {"step": int(name.rsplit("_", 1)[-1]), "tier": tier, "path": storage.uri(name), "world_size": None,
               "bytes": sum(storage.sizes(name).values()), "keep": False}
        if info is not None:
            row.update(world_size=info.world_size, bytes=info.bytes, keep=info.keep)
        if name.startswith("rejected_"):
            row["status"] = "rejected"
        elif info is None:
            row["status"] = "incomplete"
        else:
            row["status"] = "corrupt" if check_crc and corrupt_files_at(storage, name) else "verified"
        rows.append(row)
    return rows


@dataclass
class PendingSave:
    """A save the driver follows from the ranks' copy to its last commit."""
    step: int
    durable: bool
    t0: float  # unix time the ranks began to save
    blocking_s: float
    previous_commit_wait_s: float
    ref: object = None  # the commit's, then (a durable step with a memory tier) the upload's
    path: str = ""  # the memory tier's copy, once committed
    memory_ts: float = 0.0  # when that copy's manifest was written
    bytes: int = 0
    world_size: int = 0
    upload_t0: float = 0.0


class UploadQueue:
    """Which durable uploads run when (pure; the Checkpointer acts on its answers).

    With a memory tier a durable step is committed to memory first (loadable from there at once)
    and uploaded after, beside later saves, which never wait for it. One upload runs at a time:
    uploads share the storage's bandwidth, and one at a time keeps the durable tier's steps
    appearing in order. A durable step committed while one runs waits; a newer one supersedes a
    step still waiting: it stays in the memory tier, and uploading it after the newer one starts
    would only delay the newer one. The caller records every superseded step.
    """

    def __init__(self):
        self.running = None
        self.waiting = None

    def add(self, item):
        """A durable step was committed to memory: (the item to start now or None, the item it
        superseded or None)."""
        if self.running is None:
            self.running = item
            return item, None
        superseded, self.waiting = self.waiting, item
        return None, superseded

    def finished(self):
        """The running upload ended (done or failed): the waiting one, to start now, or None."""
        self.running, self.waiting = self.waiting, None
        return self.running

    def items(self) -> list:
        return [i for i in (self.running, self.waiting) if i is not None]


class Checkpointer:
    """Owns the checkpoint tiers: collective save, background commit, choice of what to load.

    The step loop blocks only while the ranks save into their nodes' memory (and, for a save that
    follows the previous one closer than its commit takes, until that commit is done); assembling,
    resharding, the manifest and the upload to durable storage happen in the group's committer
    while training goes on. With a memory tier a durable step is committed to memory first and
    uploaded after (UploadQueue), so no save waits for an upload.
    """

    def __init__(self, root: str | os.PathLike, zero_stage: int, keep_last: int, recorder,
                 memory: str | os.PathLike | None = None, memory_keep_last: int = 2):
        self.storage = Storage(root)
        if self.storage.is_local:
            Path(self.storage.base).mkdir(parents=True, exist_ok=True)
        self.memory = Path(memory) if memory is not None else None
        if self.memory is not None:
            self.memory.mkdir(parents=True, exist_ok=True)
        self.zero_stage, self.keep_last, self.memory_keep_last, self.rec = zero_stage, keep_last, memory_keep_last, recorder
        self._inflight: PendingSave | None = None  # the save whose commit is in flight
        self._uploads = UploadQueue()  # of PendingSave: durable steps committed to memory, to upload
        self._group = None  # the worker group of the last save (its committer uploads)
        self._to_replicate: tuple[int, str] | None = None  # (step, path) committed, not yet copied
        self._replicating = None  # (ref, step, path, unix start time)
        self._retried_step: int | None = None
        self.last_saved_step: int | None = None
        self.last_saved_durable = False
        self._last_committed: CheckpointInfo | None = None

    @property
    def root(self) -> str:
        return self.storage.uri()

    def save(self, group, step: int, data_position: dict | None = None, durable: bool = True):
        """Collective save of `step` (with the data position at it, when data is streamed) into
        the memory tier, and also to durable storage when `durable` (always without a memory
        tier); returns the ranks' outcomes (all ok, or a loss to handle)."""
        t_wait = time.time()
        # The previous save's commit only (the ranks' stage directories and the committer's
        # memory tier are free once it is done); an upload still running goes on beside this save.
        self._finish_commit()
        durable = durable or self.memory is None
        t0 = time.time()
        outcomes, values = group.save(step, data_position)
        if any(o.kind != "ok" for o in outcomes):
            return outcomes
        blocking = time.time() - t0
        self._group = group
        spec = {"step": step, "world_size": len(group.active), "zero_stage": self.zero_stage,
                # With a memory tier the commit ends there; the upload is the committer's apart.
                "durable": self.storage.location if durable and self.memory is None else None,
                "keep_last": self.keep_last, "memory": str(self.memory) if self.memory is not None else None,
                "memory_keep_last": self.memory_keep_last,
                "protect": [step_name(s.step) for s in self._uploads.items()]}  # their upload reads them
        ref = group.commit(spec, [v["dir"] for v in values])
        # The previous commit still going when this save came (checkpoints closer together than a
        # commit takes) held the step loop too: reported apart as previous_commit_wait_s.
        self._inflight = PendingSave(step, durable, t0, blocking, t0 - t_wait, ref)
        self.last_saved_step, self.last_saved_durable = step, durable
        return outcomes

    def poll(self, group=None) -> None:
        running = self._uploads.running
        if running is not None and _ready(running.ref):
            self._finish_upload()
        if self._inflight is not None and _ready(self._inflight.ref):
            self._finish_commit()
        if group is not None:
            self._replicate(group)

    def wait(self, uploads: bool = True) -> None:
        """Block until the save in flight is committed and, with `uploads`, until every durable
        upload has ended (without: what a load needs, the memory tier holds already)."""
        self._finish_commit()
        while uploads and self._uploads.running is not None:
            self._finish_upload()

    def abandon(self) -> None:
        """The run ends without waiting (it failed): its committer goes, and with it the uploads
        not finished; recorded, so no durable step disappears without a word."""
        for save in self._uploads.items():
            self.rec.event("checkpoint_failed", step=save.step, tier="durable",
                           error="the run ended before its upload to durable storage finished")
        self._uploads = UploadQueue()

    def _replicate(self, group, block: bool = False) -> None:
        """Copy the newest committed memory-tier checkpoint to the group's replica, in the
        background (one copy at a time; a newer commit supersedes one not yet started)."""
        import ray

        if self._replicating is not None and (block or _ready(self._replicating[0])):
            ref, step, path, t0 = self._replicating
            self._replicating = None
            try:
                done = ray.get(ref)
                self.rec.event("checkpoint_replicated", step=step, node_id=done["node_id"], path=done["path"],
                               bytes=done["bytes"], replicate_s=done["replicated_ts"] - t0)
            except Exception as exc:
                self.rec.event("checkpoint_replication_failed", step=step, error=str(exc).splitlines()[0])
                if group.replica_died(exc):
                    # Its node is gone: place a new replica on a live peer and copy this step again
                    # (unless a newer one waits); once, a second failure waits for the next commit.
                    group.replica_lost()
                    if self._to_replicate is None and self._retried_step != step:
                        self._to_replicate, self._retried_step = (step, path), step
        if self._replicating is None and self._to_replicate is not None:
            step, path = self._to_replicate
            self._to_replicate = None
            ref = group.replicate(path)
            if ref is not None:
                self._replicating = (ref, step, path, time.time())
        if block and self._replicating is not None:
            self._replicate(group, block=True)

    def wait_replicated(self, group) -> None:
        """Block until the newest committed memory-tier checkpoint is on the replica."""
        self.wait()
        self._replicate(group, block=True)

    def _finish_commit(self) -> None:
        import ray

        if self._inflight is None:
            return
        save, self._inflight = self._inflight, None
        try:
            done = ray.get(save.ref)
        except Exception as exc:  # a rank or the committer died: the step stays invisible
            self.rec.event("checkpoint_failed", step=save.step, tier="durable" if save.durable else "memory",
                           error=str(exc).splitlines()[0])
            self.last_saved_step = None
            return
        save.path, save.bytes, save.world_size = done["path"], done["bytes"], done["world_size"]
        save.memory_ts = done["memory_ts"] or 0.0
        tier = "durable" if save.durable else "memory"
        self._committed(save, "memory" if self.memory is not None else "durable", done["committed_ts"])
        if save.durable and self.memory is not None:
            start, superseded = self._uploads.add(save)
            if superseded is not None:
                self.rec.event("checkpoint_upload_skipped", step=superseded.step, superseded_by=save.step,
                               uploading_step=self._uploads.running.step, path=superseded.path,
                               reason="a newer durable step was committed while this one waited for an upload")
                self._saved(superseded, "memory", superseded.path, superseded.memory_ts, durable_skipped=True)
            if start is not None:
                self._start_upload(start)
            return
        if tier == "memory":
            self._to_replicate = (save.step, save.path)
        self._saved(save, tier, save.path, done["committed_ts"])

    def _start_upload(self, save: PendingSave) -> None:
        save.upload_t0 = time.time()
        save.ref = self._group.upload(save.path, self.storage.location, self.keep_last)

    def _finish_upload(self) -> None:
        import ray

        save = self._uploads.running
        try:
            done = ray.get(save.ref)
        except Exception as exc:  # the committer died (its node, or chaos) or storage failed
            self.rec.event("checkpoint_failed", step=save.step, tier="durable", error=str(exc).splitlines()[0])
            if save.step == self.last_saved_step:
                self.last_saved_durable = False
        else:
            self._committed(save, "durable", done["committed_ts"], done["path"])
            self._saved(save, "durable", done["path"], done["committed_ts"],
                        upload_s=done["committed_ts"] - save.upload_t0, upload_wait_s=save.upload_t0 - save.memory_ts)
        following = self._uploads.finished()
        if following is not None:
            self._start_upload(following)

    def _committed(self, save: PendingSave, tier: str, committed_ts: float, path: str | None = None) -> None:
        if self._last_committed is None or save.step >= self._last_committed.step:
            self._last_committed = CheckpointInfo(save.step, path or save.path, save.world_size, "", save.bytes,
                                                  committed_ts, tier)

    def _saved(self, save: PendingSave, tier: str, path: str, committed_ts: float, **extra) -> None:
        # total_s ends when the committer wrote the last manifest, not when the driver looked.
        memory = {"memory_s": save.memory_ts - save.t0} if save.memory_ts else {}
        self.rec.event("checkpoint_saved", step=save.step, path=path, tier=tier, blocking_s=save.blocking_s,
                       total_s=committed_ts - save.t0, bytes=save.bytes, world_size=save.world_size,
                       previous_commit_wait_s=save.previous_commit_wait_s, **memory, **extra)

    def latest_known(self) -> CheckpointInfo | None:
        """The last checkpoint this run committed (no reading of storage: for a quick exit)."""
        self.wait()
        return self._last_committed

    def candidates(self) -> list[CheckpointInfo]:
        found = complete(self.storage)
        if self.memory is not None:
            found += complete(Storage(self.memory), tier="memory")
        return load_order(found)

    def latest(self, group=None) -> CheckpointInfo | None:
        """The newest complete checkpoint of either tier (and, given the worker group, of the
        memory tier's replica) whose checksums hold; corrupt ones are rejected (and the next
        newest tried). Waits for the commit in flight, not for uploads: a step being uploaded
        is in the memory tier already."""
        self.wait(uploads=False)
        replicas = []
        if group is not None:
            replicas, rejected = group.replica_checkpoints()
            for r in rejected:  # checked where the replica lives (this node cannot read its files)
                self.rec.event("checkpoint_rejected", tier="memory", copy="replica", **r)
        for info in load_order(self.candidates() + replicas):
            if info.copy == "replica":
                return info
            storage = Storage(info.root)
            # Read at every load decision (rare: start, recovery, grow), so a file damaged after
            # its commit is caught too.
            bad = corrupt_files_at(storage, info.name)
            if not bad:
                return info
            dest = reject_at(storage, info.name)
            self.rec.event("checkpoint_rejected", step=info.step, path=info.path, tier=info.tier, moved_to=dest,
                           reason=f"CRC-32 mismatch in {bad[:3]}")
        return None


def _ready(ref) -> bool:
    import ray

    return bool(ray.wait([ref], timeout=0)[0])


def read_files(root: str | os.PathLike, names: list[str]) -> dict[str, bytes]:
    root = Path(root)
    return {n: (root / n).read_bytes() for n in names}


def write_files(root: str | os.PathLike, files: dict[str, bytes]) -> None:
    root = Path(root)
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)


def fetch_for_load(path: str, tag: str, source: str = "path", files: dict[str, bytes] | None = None,
                   root: str | None = None, name: str | None = None) -> tuple[str, Path | None]:
    """Make `tag` of a checkpoint readable on this node: (directory to load from, a scratch
    directory to delete afterwards or None). source: path (read in place), memory (`files`
    served by the committer), storage (download `name` from `root`)."""
    if source == "path":
        return path, None
    local = scratch_root() / "load"
    shutil.rmtree(local, ignore_errors=True)
    if source == "memory":
        write_files(local, files)
    else:
        storage = Storage(root)
        storage.download(name, local, [f"{tag}/{rel}" for rel in storage.sizes(f"{name}/{tag}")])
    return str(local), local


def package(path: str | os.PathLike, subdir: str = "") -> dict[str, bytes]:
    """The files under `path`/`subdir` as {path relative to `path`: bytes} (sent through the
    object store: other nodes cannot read this node's memory)."""
    root = Path(path)
    return read_files(root, [str(p.relative_to(root)) for p in sorted((root / subdir).rglob("*")) if p.is_file()])


class Committer:
    """Ray actor body, on the driver's node: assembles, reshards and commits checkpoints off the
    training processes, holds the memory tier, and serves it to loading ranks."""

    def __init__(self):
        import deepspeed.checkpoint.ds_to_universal  # noqa: F401  (import once, not per commit)

    def commit(self, spec: dict, *rank_files: dict[str, bytes]) -> dict:
        """`rank_files`: each rank's files of the step (arrive through the object store).
        spec["durable"]: the storage to upload to in this call too (the Checkpointer gives it only
        without a memory tier; with one it calls `upload` apart, so later commits never wait for
        an upload); spec["protect"]: memory-tier steps retention must leave (being uploaded)."""
        name = step_name(spec["step"])
        durable = Storage(spec["durable"]) if spec["durable"] is not None else None
        if spec["memory"] is not None:
            local, tier = Path(spec["memory"]) / name, "memory"
        elif durable is not None and durable.is_local:
            local, tier = Path(durable.full(name)), "durable"  # assembled in place: no copy
        else:
            local, tier = scratch_root() / name, "scratch"
        shutil.rmtree(local, ignore_errors=True)
        try:
            for files in rank_files:
                write_files(local, files)
            del rank_files
            info = commit(local, spec["step"], spec["world_size"], spec["zero_stage"])
            memory_ts = info.committed_ts if tier == "memory" else None
            committed_ts, path = info.committed_ts, str(local)
            if durable is not None and tier != "durable":
                uploaded = self.upload(str(local), spec["durable"], spec["keep_last"])
                committed_ts, path = uploaded["committed_ts"], uploaded["path"]
            elif durable is not None:
                prune(durable, spec["keep_last"], protect=name)
            if tier == "memory":
                prune(Storage(spec["memory"]), spec["memory_keep_last"], protect=[name, *spec.get("protect", ())])
        finally:
            if tier == "scratch":
                shutil.rmtree(local, ignore_errors=True)
        return {"path": path, "bytes": info.bytes, "world_size": info.world_size, "memory_ts": memory_ts,
                "committed_ts": committed_ts}

    def upload(self, path: str, durable: str, keep_last: int) -> dict:
        """Copy the committed checkpoint at `path` (node memory) to the durable storage, manifest
        last, then apply that tier's retention. Runs in its own thread of this actor
        (WorkerGroup.upload), beside the commits of later saves."""
        storage, name = Storage(durable), Path(path).name
        committed_ts = publish(path, storage, name)
        prune(storage, keep_last, protect=name)
        return {"path": storage.uri(name), "committed_ts": committed_ts}

    def package(self, path: str, tag: str) -> dict[str, bytes]:
        """The files a rank needs to load `tag` of a memory-tier checkpoint (sent to every node
        once through the object store)."""
        return package(path, tag)

    def package_step(self, path: str) -> dict[str, bytes]:
        """A whole committed memory-tier checkpoint, manifest included, for the replica."""
        return package(path)


class MemoryReplica:
    """Ray actor body, on a peer node of the committer's: a second copy of the memory tier in that
    node's memory, so the loss of the driver node's memory still recovers from memory."""

    def __init__(self, root: str, keep_last: int):
        import ray

        self.root, self.keep_last = Path(root), keep_last
        self.root.mkdir(parents=True, exist_ok=True)
        self.node_id = ray.get_runtime_context().get_node_id()

    def receive(self, name: str, files: dict[str, bytes]) -> dict:
        """Write a committed checkpoint's files, its manifest last (visible only when whole)."""
        local = self.root / name
        shutil.rmtree(local, ignore_errors=True)
        manifest = files.pop(MANIFEST)
        write_files(local, files)
        Storage(self.root).write_bytes(f"{name}/{MANIFEST}", manifest)
        prune(Storage(self.root), self.keep_last, protect=name)
        return {"node_id": self.node_id, "path": str(local), "bytes": sum(map(len, files.values())),
                "replicated_ts": time.time()}

    def checkpoints(self) -> tuple[list[CheckpointInfo], list[dict]]:
        """(complete copies whose checksums hold, newest first; the corrupt ones set aside)."""
        import dataclasses

        storage, good, rejected = Storage(self.root), [], []
        for info in complete(storage, tier="memory"):
            bad = corrupt_files_at(storage, info.name)
            if bad:
                rejected.append({"step": info.step, "path": info.path, "moved_to": reject_at(storage, info.name),
                                 "reason": f"CRC-32 mismatch in {bad[:3]}"})
            else:
                good.append(dataclasses.replace(info, copy="replica"))
        return good, rejected

    def package(self, path: str, tag: str) -> dict[str, bytes]:
        return package(path, tag)

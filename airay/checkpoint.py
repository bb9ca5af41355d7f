"""Checkpoint layout, verification, resharding and retention.

One directory per committed step under the checkpoint root:

    step_00000010/
      native/        DeepSpeed's own save (one file per rank's ZeRO partition)
      universal/     the same state as one file per parameter (DeepSpeed universal
                     checkpoint), loadable at any world size
      manifest.json  written last: the step, world size, format, every file's size and CRC-32

A step directory without a manifest that matches the files' sizes on disk is incomplete and is
never loaded. Before a checkpoint is loaded its files' CRC-32s are checked too; one that does not
match is corrupt: it is set aside (renamed rejected_step_NNNNNNNN, event checkpoint_rejected) and
the previous checkpoint is loaded instead. Resharding is DeepSpeed universal checkpointing: ZeRO 1-3 partitions are merged per
parameter once, off the step loop, so recovery at a new world size only reads files.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
NATIVE_TAG = "native"
UNIVERSAL_TAG = "universal"


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    world_size: int
    load_tag: str  # the DeepSpeed tag to load: universal, or native for ZeRO stage 0
    bytes: int
    committed_ts: float = 0.0  # unix time the manifest was written


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


def commit(path: str | os.PathLike, step: int, world_size: int, zero_stage: int) -> CheckpointInfo:
    """Make a fully written checkpoint visible: reshard it if needed, then write its manifest last."""
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
    return CheckpointInfo(step, path, world_size, load_tag, sum(files.values()), created)


def verify(path: str | os.PathLike) -> CheckpointInfo | None:
    """The checkpoint's info if its manifest exists and every listed file has its size, else None."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    for rel, size in manifest.get("files", {}).items():
        f = path / rel
        if not f.is_file() or f.stat().st_size != size:
            return None
    if not manifest.get("files"):
        return None
    return CheckpointInfo(manifest["step"], path, manifest["world_size"], manifest["load_tag"],
                          sum(manifest["files"].values()), manifest.get("created", 0.0))


def corrupt_files(path: str | os.PathLike) -> list[str]:
    """Files of a size-verified checkpoint whose CRC-32 differs from its manifest's (reads them all)."""
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    return [rel for rel, crc in manifest.get("crc32", {}).items() if crc32(path / rel) != crc]


def reject(path: str | os.PathLike) -> Path:
    """Set a corrupt checkpoint aside, out of step_dirs (kept for inspection, not loaded again)."""
    path = Path(path)
    dest = path.with_name("rejected_" + path.name)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(path, dest)
    return dest


def step_dirs(root: str | os.PathLike) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")), reverse=True)


def latest_complete(root: str | os.PathLike) -> CheckpointInfo | None:
    """The newest verified checkpoint; incomplete or corrupt ones are skipped."""
    for p in step_dirs(root):
        info = verify(p)
        if info is not None:
            return info
    return None


def prune(root: str | os.PathLike, keep_last: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep_last` verified checkpoints (and incomplete older dirs).

    Never deletes `protect` (the checkpoint being loaded) or a directory newer than the newest
    verified one (it may still be being written).
    """
    removed = []
    verified_seen = 0
    newest_verified_passed = False
    for p in step_dirs(root):
        ok = verify(p) is not None
        if ok:
            verified_seen += 1
            newest_verified_passed = True
        if not newest_verified_passed or (protect is not None and p.resolve() == Path(protect).resolve()):
            continue
        if (ok and verified_seen > keep_last) or (not ok):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


class Checkpointer:
    """Owns the checkpoint directory: collective save, background commit, choice of what to load.

    The step loop blocks only for the ranks' save; resharding to universal format and the
    manifest happen in the group's committer process while training goes on.
    """

    def __init__(self, root: str | os.PathLike, zero_stage: int, keep_last: int, recorder):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.zero_stage, self.keep_last, self.rec = zero_stage, keep_last, recorder
        self._inflight = None  # (ref, step, path, unix start time, blocking_s)
        self.last_saved_step: int | None = None

    def save(self, group, step: int, data_position: dict | None = None):
        """Collective save of `step` (with the data position at it, when data is streamed);
        returns the ranks' outcomes (all ok, or a loss to handle)."""
        self.wait()
        path = step_dir(self.root, step)
        shutil.rmtree(path, ignore_errors=True)  # a partial save from before a failure
        t0 = time.time()
        outcomes, _ = group.save(str(path), step, data_position)
        if any(o.kind != "ok" for o in outcomes):
            return outcomes
        blocking = time.time() - t0
        ref = group.commit(str(path), step, len(group.active), self.zero_stage, self.keep_last)
        self._inflight = (ref, step, path, t0, blocking)
        self.last_saved_step = step
        return outcomes

    def poll(self) -> None:
        if self._inflight is not None and _ready(self._inflight[0]):
            self._finish()

    def wait(self) -> None:
        if self._inflight is not None:
            self._finish()

    def _finish(self) -> None:
        import ray

        ref, step, path, t0, blocking = self._inflight
        self._inflight = None
        try:
            info = ray.get(ref)
        except Exception as exc:  # the committer died (its node was lost): the step stays invisible
            self.rec.event("checkpoint_failed", step=step, path=str(path), error=str(exc).splitlines()[0])
            self.last_saved_step = None
            return
        # total_s ends when the committer wrote the manifest, not when the driver looked.
        self.rec.event("checkpoint_saved", step=step, path=str(path), blocking_s=blocking,
                       total_s=info.committed_ts - t0, bytes=info.bytes, world_size=info.world_size)

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint whose checksums hold; corrupt ones are rejected."""
        self.wait()
        while (info := latest_complete(self.root)) is not None:
            # Read at every load decision (rare: start, recovery, grow), so a file damaged after
            # its commit is caught too.
            bad = corrupt_files(info.path)
            if not bad:
                return info
            dest = reject(info.path)
            self.rec.event("checkpoint_rejected", step=info.step, path=str(info.path), moved_to=str(dest),
                           reason=f"CRC-32 mismatch in {bad[:3]}")
        return None


def _ready(ref) -> bool:
    import ray

    return bool(ray.wait([ref], timeout=0)[0])


class Committer:
    """Ray actor body: reshards and commits checkpoints off the training processes."""

    def __init__(self):
        import deepspeed.checkpoint.ds_to_universal  # noqa: F401  (import once, not per commit)

    def commit(self, path: str, step: int, world_size: int, zero_stage: int, keep_last: int) -> CheckpointInfo:
        info = commit(path, step, world_size, zero_stage)
        prune(Path(path).parent, keep_last, protect=Path(path))
        return info

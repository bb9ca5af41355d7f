"""Where durable checkpoints live: a local or NFS directory, or any pyarrow filesystem URI.

`Storage("/nfs/ckpt")`, `Storage("s3://bucket/run1")`, `Storage("gs://bucket/run1")`: one small
surface (list, sizes, read, write, upload, download, delete) over `pyarrow.fs`, so the checkpoint
code never cares which. Paths inside are relative to the root and use "/".

Object stores have no rename, so nothing here relies on one: a checkpoint is made visible by
writing its manifest last (airay.checkpoint); a single object PUT is atomic on S3 and GCS, and
on a local filesystem the manifest is written aside, fsynced and renamed. Files uploaded to a local
(or NFS) directory are fsynced before the call returns, so a manifest written after them never
names a file that a crash could still lose.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow.fs as pafs

from airay.checkpoint.checksum import crc32
from airay.checkpoint.ranges import coalesce

# Files are copied in pieces of this size: large enough for object stores' throughput, small
# enough that a copy never holds a whole multi-GB shard in memory.
CHUNK = 8 << 20
# Ranged reads of one file an object store is sent at once (read_spans).
READ_CONCURRENCY = 8


def is_uri(location: str) -> bool:
    return "://" in str(location) and not str(location).startswith("file://")


_USERINFO = re.compile(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s?]+(?::[^@\s?]*)?@", re.IGNORECASE)
_SECRET_PARAM = re.compile(r"((?:access_key|secret_key|session_token|password|token)=)[^&\s'\"]+", re.IGNORECASE)


def mask_secrets(text: str) -> str:
    """`text` with the credentials a storage URI may carry masked: user:secret@ and
    access_key= / secret_key= / session_token= parameters (pyarrow reads them from URIs)."""
    return _SECRET_PARAM.sub(r"\1***", _USERINFO.sub(r"\1***@", text))


def display(location: str | os.PathLike) -> str:
    """A location as users see it: an absolute path, or the URI without its query parameters
    (endpoint_override=... says how to reach the store, not where in it) and credentials.
    Touches nothing."""
    location = str(location)
    if is_uri(location):
        return mask_secrets(location.split("?", 1)[0].rstrip("/"))
    return str(Path(location.removeprefix("file://")).absolute())


class Storage:
    def __init__(self, location: str | os.PathLike):
        location = str(location)
        if is_uri(location):
            self.fs, self.base = pafs.FileSystem.from_uri(location)
            self.base = self.base.rstrip("/")
        else:
            self.fs = pafs.LocalFileSystem()
            self.base = str(Path(location.removeprefix("file://")).absolute())
        self.location = location
        self.dropped_bytes = 0  # read by read_spans between the spans asked for, and dropped

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def full(self, rel: str = "") -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def uri(self, rel: str = "") -> str:
        """A name for users and events: the local path, or the URI."""
        if self.is_local:
            return self.full(rel)
        return display(self.location) + (f"/{rel}" if rel else "")

    # ---- reading ---------------------------------------------------------------------------

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the directories right under `rel` ([] if it does not exist). On object
        stores a "directory" is a common key prefix."""
        sel = pafs.FileSelector(self.full(rel), allow_not_found=True, recursive=False)
        return sorted(i.base_name for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.Directory)

    def sizes(self, rel: str) -> dict[str, int]:
        """{path relative to `rel`: size} of every file under `rel`."""
        root = self.full(rel)
        sel = pafs.FileSelector(root, allow_not_found=True, recursive=True)
        return {i.path[len(root) + 1:]: i.size for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.File}

    def size(self, rel: str) -> int | None:
        info = self.fs.get_file_info(self.full(rel))
        return info.size if info.type == pafs.FileType.File else None

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.full(rel)) as f:
            return f.read()

    def chunks(self, rel: str):
        with self.fs.open_input_stream(self.full(rel)) as f:
            while chunk := f.read(CHUNK):
                yield chunk

    # ---- writing ---------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write one file so readers see none of it or all of it, durably."""
        if self.is_local:
            path = Path(self.full(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        else:
            with self.fs.open_output_stream(self.full(rel)) as f:  # one PUT: atomic on S3/GCS
                f.write(data)

    def upload_file(self, local_path: str | os.PathLike, rel: str) -> tuple[int, int]:
        """Copy a local file to `rel` (fsynced on a local filesystem); returns (size, crc32) of
        the bytes sent, so the caller can check them against the manifest's."""
        crc, size = 0, 0
        dest = self.full(rel)
        if self.is_local:
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            with open(local_path, "rb") as src, open(dest, "wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    crc, size = crc32(chunk, crc), size + len(chunk)
                out.flush()
                os.fsync(out.fileno())
            return size, crc
        self.fs.create_dir(dest.rsplit("/", 1)[0], recursive=True)
        with open(local_path, "rb") as src, self.fs.open_output_stream(dest) as out:
            while chunk := src.read(CHUNK):
                out.write(chunk)
                crc, size = crc32(chunk, crc), size + len(chunk)
        return size, crc

    def read_spans(self, rel: str, spans: list[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each (offset, size) of `rel`, the file opened once, in as few ranged reads
        as ranges.coalesce makes of them (the bytes between spans read and dropped are counted in
        `dropped_bytes`), an object store's sent READ_CONCURRENCY at a time (each is a GET: at
        70B a resharding rank needs thousands of pieces of each old partition)."""
        reads, where = coalesce(spans)
        with self.fs.open_input_file(self.full(rel)) as f:
            def read(r):
                return memoryview(f.read_at(r[1], r[0]))

            if self.is_local or len(reads) == 1:
                got = [read(r) for r in reads]
            else:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(min(READ_CONCURRENCY, len(reads))) as pool:
                    got = list(pool.map(read, reads))
        pieces = [got[r][at:at + size] for (_, size), (r, at) in zip(spans, where)]
        self.dropped_bytes += max(0, sum(map(len, got)) - sum(map(len, pieces)))  # overlapping spans: none
        return pieces

    def download_file(self, rel: str, dest: str | os.PathLike) -> tuple[int, int]:
        """Copy `rel` into the local file `dest`; returns (size, crc32) of what arrived."""
        crc, size = 0, 0
        Path(dest).parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as out:
            for chunk in self.chunks(rel):
                out.write(chunk)
                crc, size = crc32(chunk, crc), size + len(chunk)
        return size, crc

    def sync_dir(self, rel: str) -> None:
        """Make a local directory's entries durable (the files in it were fsynced one by one)."""
        if self.is_local and os.path.isdir(self.full(rel)):
            _fsync_dir(Path(self.full(rel)))

    def delete_dir(self, rel: str) -> None:
        """Remove a directory and everything in it; one that is not there is no error."""
        try:
            self.fs.delete_dir(self.full(rel))
        except FileNotFoundError:
            pass

    def move_dir(self, rel: str, new_rel: str) -> None:
        """Rename a directory (local filesystems; object stores copy then delete)."""
        self.delete_dir(new_rel)
        if self.is_local:
            os.replace(self.full(rel), self.full(new_rel))
            return
        for name in self.sizes(rel):
            self.fs.copy_file(f"{self.full(rel)}/{name}", f"{self.full(new_rel)}/{name}")
        self.delete_dir(rel)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

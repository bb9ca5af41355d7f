"""Parquet files as a row-addressable dataset: scanned from metadata, read in row ranges.

A scan lists the files (sorted, so global row ids are stable), reads only their footers (row
counts, row groups, schema) and fails with the file and the fix for anything a run would
otherwise trip over later on a worker. Reading a set of row ids reads just the row groups that
hold them. Paths are local paths or any URI pyarrow's filesystems understand (s3://, gs://,
hdfs://, file://).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from airay.config import ConfigError


class DataError(ConfigError):
    """A dataset the user must fix; the message names the path or column."""


@dataclass(frozen=True)
class ParquetFile:
    path: str              # as the filesystem knows it (no scheme)
    rows: int
    group_rows: tuple[int, ...]
    size: int


@dataclass(frozen=True)
class ParquetDataset:
    uri: str               # a path or URI that names the filesystem; every file lives on it
    files: tuple[ParquetFile, ...]
    columns: tuple[str, ...]

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def fingerprint(self) -> str:
        """Changes when files, their sizes or row counts, or the columns read change: a
        checkpoint's data position means nothing for another dataset."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f"{f.path}\0{f.rows}\0{f.size}\n".encode())
        h.update(",".join(self.columns).encode())
        return h.hexdigest()[:16]

    def filesystem(self) -> pafs.FileSystem:
        return _filesystem(self.uri)[0]

    def read_rows(self, ids: np.ndarray, groups: "RowGroupCache | None" = None) -> pa.Table:
        """The rows `ids` (global row ids), in that order, with this dataset's columns; the
        row groups that hold them come from `groups` when given (and are kept there)."""
        fs = self.filesystem()
        offsets = np.cumsum([0] + [f.rows for f in self.files])
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        parts = []
        for i in np.unique(np.searchsorted(offsets, sorted_ids, side="right") - 1):
            f = self.files[i]
            in_file = sorted_ids[(sorted_ids >= offsets[i]) & (sorted_ids < offsets[i + 1])] - offsets[i]
            group_ends = np.cumsum(f.group_rows)
            group_of = np.searchsorted(group_ends, in_file, side="right")
            groups_read = np.unique(group_of)
            if groups is None:
                with fs.open_input_file(f.path) as fh:
                    table = pq.ParquetFile(fh).read_row_groups(groups_read.tolist(), columns=list(self.columns))
            else:
                tables = [groups.get(self, int(i), int(g)) for g in groups_read]
                table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
            # Where each read row group starts inside `table`, then each wanted row's index in it.
            read_start = np.cumsum([0] + [f.group_rows[g] for g in groups_read[:-1]])
            group_start = group_ends - np.asarray(f.group_rows)
            at = read_start[np.searchsorted(groups_read, group_of)] + in_file - group_start[group_of]
            parts.append(table.take(pa.array(at)))
        table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return table.take(pa.array(inverse))


class RowGroupCache:
    """Decoded row groups a reader read last, up to `max_bytes` (least recently used go first).

    A shuffled epoch reads windows of a few hundred rows out of row groups that often hold
    thousands: without it, each row group is decoded once per window that touches it (8 times
    over for row groups of 4096 rows and windows of 512)."""

    def __init__(self, max_bytes: int):
        from collections import OrderedDict

        self.max_bytes, self.bytes = max_bytes, 0
        self._groups: OrderedDict = OrderedDict()

    def get(self, dataset: ParquetDataset, file: int, group: int) -> pa.Table:
        key = (dataset.files[file].path, group)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        with dataset.filesystem().open_input_file(dataset.files[file].path) as fh:
            table = pq.ParquetFile(fh).read_row_group(group, columns=list(dataset.columns))
        if table.nbytes <= self.max_bytes:
            self._groups[key] = table
            self.bytes += table.nbytes
            while self.bytes > self.max_bytes:
                self.bytes -= self._groups.popitem(last=False)[1].nbytes
        return table


def _filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    if "://" in path:
        try:
            return pafs.FileSystem.from_uri(path)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as exc:
            raise DataError(f"data.paths: cannot open filesystem of '{path}': {exc}") from None
    import os

    return pafs.LocalFileSystem(), os.path.abspath(path)


def scan(paths: list[str], columns: list[str] | None) -> ParquetDataset:
    """List and check the parquet files under `paths` (files or directories) from metadata."""
    if not paths:
        raise DataError("data.paths is empty; name parquet files or directories")
    fs, _ = _filesystem(paths[0])
    found: list[tuple[str, int]] = []
    for p in paths:
        p_fs, p_path = _filesystem(p)
        if type(p_fs) is not type(fs):
            raise DataError(f"data.paths mixes filesystems ('{paths[0]}' and '{p}'); keep all on one")
        info = p_fs.get_file_info(p_path)
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"data.paths: '{p}' does not exist; check the path (relative paths are "
                            "relative to the directory airay runs in)")
        if info.type == pafs.FileType.Directory:
            inner = [i for i in p_fs.get_file_info(pafs.FileSelector(p_path, recursive=True))
                     if i.type == pafs.FileType.File and i.path.endswith(".parquet")]
            if not inner:
                raise DataError(f"data.paths: directory '{p}' holds no *.parquet files")
            found += [(i.path, i.size) for i in inner]
        else:
            found.append((info.path, info.size))
    files, schema0 = [], None
    for path, size in sorted(set(found)):
        try:
            with fs.open_input_file(path) as fh:
                meta = pq.ParquetFile(fh).metadata
                schema = meta.schema.to_arrow_schema()
        except (pa.ArrowInvalid, OSError) as exc:
            raise DataError(f"data.paths: '{path}' is not a readable parquet file ({exc}); "
                            "remove it or rewrite it with pyarrow.parquet.write_table") from None
        wanted = columns or schema.names
        missing = [c for c in wanted if c not in schema.names]
        if missing:
            raise DataError(f"data.columns: {missing} not in '{path}' (it has {schema.names}); "
                            "fix data.columns or the file")
        if schema0 is None:
            schema0 = (wanted, [schema.field(c).type for c in wanted])
        elif [schema.field(c).type for c in schema0[0]] != schema0[1]:
            raise DataError(f"'{path}' has column types {[str(schema.field(c).type) for c in schema0[0]]}, "
                            f"other files have {[str(t) for t in schema0[1]]}; all files must share one schema")
        groups = tuple(meta.row_group(i).num_rows for i in range(meta.num_row_groups))
        files.append(ParquetFile(path, meta.num_rows, groups, size))
    ds = ParquetDataset(paths[0], tuple(f for f in files if f.rows), tuple(schema0[0]))
    if ds.rows == 0:
        raise DataError(f"data.paths: {paths} hold no rows; point data.paths at non-empty parquet files")
    return ds


def to_numpy(table: pa.Table) -> dict[str, np.ndarray]:
    """Columns as numpy arrays: fixed-size and equal-length list columns become 2-D arrays,
    binary and string columns object arrays."""
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            lengths = np.unique(col.value_lengths().to_numpy(zero_copy_only=False)) if len(col) else np.array([0])
            if len(lengths) != 1:
                raise DataError(f"column '{name}' holds lists of different lengths {lengths[:5].tolist()}...; "
                                "pad them, or give data.preprocess to turn them into fixed-shape arrays")
            values = col.flatten().to_numpy(zero_copy_only=False)
            out[name] = values.reshape(len(col), int(lengths[0]), *values.shape[1:])
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out

"""What the data pipeline's reader actors run: build one window of a streamed dataset.

Imported by Ray Data's reader actors, so it stays light: no torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from airay.config import resolve_callable
from airay.data.parquet import DataError, ParquetDataset, RowGroupCache, to_numpy


def make_batch(dataset: ParquetDataset, ids: np.ndarray, preprocess: str | None,
               preprocess_kwargs: dict[str, Any], groups: RowGroupCache | None = None) -> dict[str, np.ndarray]:
    """Rows `ids` as a preprocessed batch of numpy arrays, plus their `sample_id`s."""
    return finish_batch(to_numpy(dataset.read_rows(ids, groups)), ids, preprocess, preprocess_kwargs)


def finish_batch(batch: dict[str, np.ndarray], ids: np.ndarray, preprocess: str | None,
                 preprocess_kwargs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Preprocess the rows `ids` and check that what comes out can become tensors."""
    if preprocess is not None:
        batch = resolve_callable(preprocess)(batch, **preprocess_kwargs)
    if not isinstance(batch, dict):
        raise DataError(f"data.preprocess must return a dict of arrays, got {type(batch).__name__}")
    if "sample_id" in batch:
        raise DataError("data.preprocess returned a 'sample_id' key: airay adds it (the row's id); rename it")
    out = {}
    for key, value in batch.items():
        arr = np.asarray(value)
        if arr.ndim == 0 or len(arr) != len(ids):
            raise DataError(f"data.preprocess returned '{key}' with {len(arr) if arr.ndim else 0} rows for "
                            f"{len(ids)} input rows; it must map each row to one row")
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            raise DataError(f"column '{key}' has dtype {arr.dtype}, which cannot become a torch tensor; "
                            "convert it in data.preprocess (e.g. np.frombuffer for bytes) or leave it out "
                            "of data.columns")
        out[key] = arr
    out["sample_id"] = ids.astype(np.int64)
    return out


class WindowReader:
    """Ray Data map UDF: a window descriptor {epoch, window} -> that window's rows, in order."""

    def __init__(self, stream):  # an airay.data.pipeline.Stream
        self.stream = stream
        self.groups = RowGroupCache(stream.cache_bytes)

    def __call__(self, item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        epoch, window = int(item["epoch"][0]), int(item["window"][0])
        ids = self.stream.layout.window_rows(epoch, window)
        return make_batch(self.stream.dataset, ids, self.stream.preprocess, self.stream.preprocess_kwargs,
                          self.groups)


def bytes_to_uint8(batch: dict[str, np.ndarray], columns: list[str]) -> dict[str, np.ndarray]:
    """A ready-made data.preprocess: binary columns of equal-length values -> uint8 arrays
    (rows x bytes), so they can become tensors. Other columns pass through."""
    out = dict(batch)
    for name in columns:
        values = batch[name]
        out[name] = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(len(values), -1) if len(values) \
            else np.zeros((0, 0), np.uint8)
    return out


class WindowAssembler:
    """Ray actor body (num_cpus=0, on the driver's node) for a user's ray.data.Dataset: it has
    no random access, so the feeder reads it in order and this assembles each window from the
    block slices that hold its rows, shuffled and preprocessed like a parquet window."""

    def window(self, stream, epoch: int, window: int, first_row: int, spans: list[tuple[int, int]],
               *blocks) -> Any:
        import pyarrow as pa
        from ray.data.block import BlockAccessor

        tables = [BlockAccessor.for_block(b).to_arrow().slice(lo, hi - lo) for b, (lo, hi) in zip(blocks, spans)]
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        ids = stream.layout.window_rows(epoch, window)
        table = table.take(pa.array(ids - first_row))
        batch = BlockAccessor.for_block(table).to_batch_format("numpy")
        out = finish_batch(batch, ids, stream.preprocess, stream.preprocess_kwargs)
        return BlockAccessor.batch_to_block(out)

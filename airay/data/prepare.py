"""Checks on a dataset before any actor starts, and what the pipeline will stream.

A missing path, a file that is not readable parquet, a missing column, files of different
schemas, an empty dataset, preprocessing that fails, and a preprocessed batch that does not fit
the model each fail here with the path, column or field and the fix; max_steps is resolved from
data.epochs. The result is a Stream for airay.data.pipeline.
"""

from __future__ import annotations

import sys

import numpy as np

from airay.config import JobConfig, resolve_callable
from airay.data.layout import EpochLayout
from airay.data.parquet import DataError, scan
from airay.data.pipeline import Stream
from airay.data.readers import finish_batch, make_batch

SCHEMA_PROBE_ROWS = 4


def model_input_schema(config: JobConfig) -> dict[str, tuple[str, tuple]] | None:
    """What the model declares it consumes: `input_schema(**model.kwargs)` in its factory's
    module, e.g. {'tokens': ('int', (seq_len + 1,))}. None when the module declares nothing."""
    factory = resolve_callable(config.model.factory)
    declare = getattr(sys.modules.get(factory.__module__), "input_schema", None)
    return declare(**config.model.kwargs) if callable(declare) else None


def prepare(config: JobConfig) -> tuple[JobConfig, Stream | None]:
    """Check a parquet dataset and resolve max_steps from it, before Ray is touched.

    Errors name the path, column or field: a missing path, an unreadable or non-parquet file, a
    missing column, an empty dataset, preprocessing that fails, and a preprocessed batch that
    does not fit the model's declared input schema (checked on the first rows).
    """
    spec = config.data
    if spec.source != "parquet":
        return config, None
    dataset = scan(spec.paths, spec.columns)
    layout = EpochLayout(dataset.rows, config.global_batch_size, spec.seed, spec.chunk_rows, spec.window_steps,
                         spec.shuffle)
    if layout.steps_per_epoch == 0:
        raise DataError(f"data.paths hold {dataset.rows} rows, fewer than global_batch_size "
                        f"{config.global_batch_size}: not one step per epoch; add data or lower global_batch_size")
    config = resolve_max_steps(config, layout.steps_per_epoch)
    stream = Stream(dataset, layout, spec.preprocess, spec.preprocess_kwargs, dataset.fingerprint,
                    spec.reader_cache_mb * 1024**2)
    probe = np.arange(min(SCHEMA_PROBE_ROWS, dataset.rows))
    check_probe(config, lambda: make_batch(dataset, probe, spec.preprocess, spec.preprocess_kwargs),
                f"the first rows of '{dataset.files[0].path}'")
    return config, stream


def prepare_dataset(config: JobConfig, ds) -> tuple[JobConfig, Stream]:
    """The same checks for a ray.data.Dataset passed to airay.fit (Ray is up: counting it runs
    its pipeline on the cluster, the rows stay there). Its row order must be deterministic."""
    spec = config.data
    if spec.columns:
        ds = ds.select_columns(spec.columns)
    rows = ds.count()
    if rows == 0:
        raise DataError("the dataset passed to airay.fit(dataset=...) holds no rows")
    # No random access: one chunk (rows keep the dataset's order), rows shuffled within windows.
    layout = EpochLayout(rows, config.global_batch_size, spec.seed, rows, spec.window_steps, spec.shuffle)
    if layout.steps_per_epoch == 0:
        raise DataError(f"the dataset holds {rows} rows, fewer than global_batch_size {config.global_batch_size}")
    config = resolve_max_steps(config, layout.steps_per_epoch)
    import hashlib

    fingerprint = hashlib.sha256(f"{rows}\0{ds.schema()}".encode()).hexdigest()[:16]
    stream = Stream(None, layout, spec.preprocess, spec.preprocess_kwargs, fingerprint)
    probe = ds.take_batch(min(SCHEMA_PROBE_ROWS, rows), batch_format="numpy")
    check_probe(config, lambda: finish_batch(dict(probe), np.arange(len(next(iter(probe.values())))),
                                             spec.preprocess, spec.preprocess_kwargs), "the dataset's first rows")
    return config, stream


def check_probe(config: JobConfig, build, where: str) -> None:
    spec = config.data
    try:
        batch = build()
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"data.preprocess '{spec.preprocess}' failed on {where}: {type(exc).__name__}: {exc}") from exc
    expected = model_input_schema(config)
    if expected is not None:
        problems = check_batch_schema(batch, expected)
        if problems:
            raise DataError(f"the data does not fit model '{config.model.factory}' (kwargs {config.model.kwargs}): "
                            + "; ".join(problems) + ". Fix data.columns / data.preprocess or the model kwargs")


def resolve_max_steps(config: JobConfig, steps_per_epoch: int) -> JobConfig:
    """max_steps from data.epochs (or checked against it); re-validated so chaos steps are too."""
    epochs = config.data.epochs
    max_steps = config.max_steps
    if epochs is not None:
        if max_steps is None:
            max_steps = epochs * steps_per_epoch
        elif max_steps > epochs * steps_per_epoch:
            raise DataError(f"max_steps {max_steps} exceeds data.epochs {epochs} x {steps_per_epoch} steps per "
                            "epoch; lower max_steps or raise data.epochs (or leave max_steps unset)")
    if max_steps == config.max_steps:
        return config
    return JobConfig.from_dict({**config.model_dump(mode="json"), "max_steps": max_steps})


def check_batch_schema(batch: dict[str, np.ndarray], expected: dict[str, tuple[str, tuple]],
                       ) -> list[str]:
    """What is wrong with a preprocessed batch for a model declaring `expected`:
    {key: (dtype kind 'int' | 'float' | 'uint8' ..., per-row shape with None for any size)}.
    Returns one message per problem; empty when it fits."""
    problems = []
    for key, (kind, shape) in expected.items():
        if key not in batch:
            problems.append(f"the model needs '{key}' but the preprocessed batch has only {sorted(batch)}")
            continue
        arr = np.asarray(batch[key])
        ok_kind = {"int": np.issubdtype(arr.dtype, np.integer),
                   "float": np.issubdtype(arr.dtype, np.floating)}.get(kind, arr.dtype == np.dtype(kind))
        if not ok_kind:
            problems.append(f"'{key}' has dtype {arr.dtype}, the model needs {kind}")
        row_shape = arr.shape[1:]
        if len(row_shape) != len(shape) or any(s is not None and s != r for s, r in zip(shape, row_shape)):
            want = tuple("any" if s is None else s for s in shape)
            problems.append(f"'{key}' rows have shape {row_shape}, the model needs {want}")
    return problems

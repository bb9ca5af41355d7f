import pytest
import torch

from airay import policy
from airay.data.layout import micro_batch_rows, step_sample_ids
from airay.data.source import SyntheticSource
from airay.models import tiny_gpt


@pytest.mark.parametrize("gbs", [24, 16])
def test_every_world_size_trains_on_the_same_samples_per_step(gbs):
    for step in (0, 7):
        expected = list(step_sample_ids(step, gbs))
        for w in (1, 2, 3, 4, 5, 6):
            plan = policy.plan_batch(gbs, 4, w)
            rows = [(i, n) for r in range(w) for mb, n in zip(micro_batch_rows(plan, r), plan.micro_sizes(r))
                    for i in mb if n]
            assert [expected[i] for i, _ in rows] == expected, w
            for r in range(w):
                assert [len(mb) for mb in micro_batch_rows(plan, r)] == [n or 1 for n in plan.micro_sizes(r)]


def test_a_padded_micro_batch_repeats_the_ranks_first_sample():
    plan = policy.plan_batch(16, 1, 3)  # rank 1: 5 samples over 6 micro-batches
    assert micro_batch_rows(plan, 1) == [range(6, 7), range(7, 8), range(8, 9), range(9, 10), range(10, 11),
                                         range(6, 7)]


def test_synthetic_samples_are_deterministic_and_distinct():
    a = tiny_gpt.synthetic_sample(5, seed=1)["tokens"]
    assert torch.equal(a, tiny_gpt.synthetic_sample(5, seed=1)["tokens"])
    assert not torch.equal(a, tiny_gpt.synthetic_sample(6, seed=1)["tokens"])
    src = SyntheticSource(tiny_gpt.synthetic_sample, 0, {})
    batches = src.micro_batches(2, 1, policy.plan_batch(24, 4, 3))
    assert [b["sample_id"].tolist() for b in batches] == [[56, 57, 58, 59], [60, 61, 62, 63]]


# ---- streamed datasets: the epoch layout and the checks before a run ------------------------

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airay import JobConfig
from airay.config import ConfigError
from airay.data.layout import EpochLayout
from airay.data.parquet import DataError, RowGroupCache, scan
from airay.data.pipeline import data_stalled
from airay.data.prepare import check_batch_schema, prepare


def layout(**kw):
    args = {"rows": 1000, "global_batch_size": 24, "seed": 3, "chunk_rows": 37, "window_steps": 5}
    return EpochLayout(**{**args, **kw})


def test_each_epoch_covers_rows_once_in_an_order_fixed_by_seed_and_epoch():
    lay = layout()
    assert lay.steps_per_epoch == 41 and lay.windows_per_epoch == 9  # 1000 // 24; 16 rows dropped per epoch
    epochs = [np.concatenate([lay.step_rows(e * 41 + s) for s in range(41)]) for e in range(3)]
    for ids in epochs:
        assert len(ids) == len(set(ids.tolist())) == 41 * 24 and ids.min() >= 0 and ids.max() < 1000
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    assert np.array_equal(epochs[1], np.concatenate([layout().step_rows(41 + s) for s in range(41)]))
    assert not np.array_equal(epochs[0], np.concatenate([layout(seed=4).step_rows(s) for s in range(41)]))
    # Divisible rows: every row exactly once per epoch.
    even = layout(rows=24 * 10)
    assert sorted(np.concatenate([even.step_rows(10 + s) for s in range(10)]).tolist()) == list(range(240))


def test_step_rows_split_the_same_way_at_every_world_size():
    lay = layout()
    for step in (0, 7, 44):
        rows = lay.step_rows(step)
        for w in (2, 3, 4, 5):
            plan = policy.plan_batch(24, 4, w)
            parts = [rows[slice(*plan.rank_rows(r))] for r in range(w)]
            assert np.array_equal(np.concatenate(parts), rows)


def test_unshuffled_layout_is_file_order():
    lay = layout(shuffle=False)
    assert np.array_equal(np.concatenate([lay.step_rows(s) for s in range(41)]), np.arange(41 * 24))


def test_data_stall_and_schema_checks():
    assert data_stalled(0.2, 1.0) and not data_stalled(0.05, 1.0) and not data_stalled(0.0, 0.0)
    good = {"tokens": np.zeros((4, 33), np.int32)}
    assert check_batch_schema(good, {"tokens": ("int", (33,))}) == []
    assert check_batch_schema(good, {"tokens": ("int", (None,))}) == []
    bad = check_batch_schema({"tokens": np.zeros((4, 20), np.float32)}, {"tokens": ("int", (33,))})
    assert any("dtype float32" in p for p in bad) and any("(20,)" in p and "(33,)" in p for p in bad)
    assert "needs 'tokens'" in check_batch_schema({"x": np.zeros((4, 3))}, {"tokens": ("int", (33,))})[0]


def write(path, table, **kw):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, **kw)
    return path


def tokens_table(rows, width=33, start=0):
    ids = np.arange(start, start + rows)
    flat = pa.array(((ids[:, None] + np.arange(width)) % 256).ravel().astype(np.int32))
    return pa.table({"row": ids, "tokens": pa.FixedSizeListArray.from_arrays(flat, width)})


def parquet_job(paths, max_steps=None, **data):
    return JobConfig.from_dict({
        "model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
        "global_batch_size": 8, "micro_batch_size": 4, "max_steps": max_steps,
        "data": {"source": "parquet", "paths": [str(p) for p in paths], "columns": ["tokens"], **data}})


def test_scan_reads_rows_in_any_order_across_files_and_row_groups(tmp_path):
    write(tmp_path / "b.parquet", tokens_table(50, start=70), row_group_size=16)
    write(tmp_path / "a.parquet", tokens_table(70), row_group_size=16)
    ds = scan([str(tmp_path)], ["row", "tokens"])
    assert ds.rows == 120 and [f.path.rsplit("/", 1)[1] for f in ds.files] == ["a.parquet", "b.parquet"]
    ids = np.random.default_rng(0).permutation(120)[:50]
    assert ds.read_rows(ids).column("row").to_numpy().tolist() == ids.tolist()


def test_row_group_cache_gives_the_same_rows_and_stays_within_its_bytes(tmp_path):
    write(tmp_path / "b.parquet", tokens_table(50, start=70), row_group_size=16)
    write(tmp_path / "a.parquet", tokens_table(70), row_group_size=16)
    ds = scan([str(tmp_path)], ["row", "tokens"])
    group_bytes = ds.read_rows(np.arange(16)).nbytes  # one full row group of a.parquet
    cache = RowGroupCache(3 * group_bytes)
    for seed in range(6):  # windows of a shuffled order: some row groups again, some new
        ids = np.random.default_rng(seed).permutation(120)[:20]
        assert ds.read_rows(ids, cache).equals(ds.read_rows(ids)), seed
        assert 0 < cache.bytes <= 3 * group_bytes
    assert ds.read_rows(np.arange(120), RowGroupCache(0)).column("row").to_numpy().tolist() == list(range(120))


def test_epochs_set_max_steps_and_the_batch_is_checked_against_the_model(tmp_path):
    write(tmp_path / "d" / "x.parquet", tokens_table(100))
    cfg, stream = prepare(parquet_job([tmp_path / "d"], epochs=2))
    assert cfg.max_steps == 2 * 12 and stream.layout.steps_per_epoch == 12
    with pytest.raises(DataError, match="max_steps 30 exceeds data.epochs 2 x 12"):
        prepare(parquet_job([tmp_path / "d"], max_steps=30, epochs=2))


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("not_parquet", "is not a readable parquet file"),
    ("missing_column", "data.columns: \\['tokenz'\\] not in"),
    ("empty", "hold no rows"),
    ("wrong_shape", "rows have shape \\(20,\\), the model needs \\(33,\\)"),
    ("mixed_schema", "all files must share one schema"),
    ("bad_preprocess", "data.preprocess 'tests.test_data:broken_preprocess' failed"),
])
def test_clear_errors_name_the_file_or_field(tmp_path, case, message):
    d = tmp_path / "d"
    columns = ["tokens"]
    data = {}
    if case == "missing":
        d = tmp_path / "nope"
    elif case == "not_parquet":
        d.mkdir()
        (d / "x.parquet").write_text("not parquet")
    elif case == "missing_column":
        write(d / "x.parquet", tokens_table(10))
        columns = ["tokenz"]
    elif case == "empty":
        write(d / "x.parquet", tokens_table(0))
    elif case == "wrong_shape":
        write(d / "x.parquet", tokens_table(10, width=20))
    elif case == "mixed_schema":
        write(d / "a.parquet", tokens_table(10))
        write(d / "b.parquet", pa.table({"tokens": pa.array([[1, 2]] * 10, pa.list_(pa.int64()))}))
    elif case == "bad_preprocess":
        write(d / "x.parquet", tokens_table(10))
        data["preprocess"] = "tests.test_data:broken_preprocess"
    cfg = parquet_job([d], max_steps=1, **{"columns": columns, **data})
    with pytest.raises(DataError, match=message):
        prepare(cfg)


def broken_preprocess(batch):
    raise KeyError("text")


def test_spec_errors_for_data_fields():
    with pytest.raises(ConfigError, match="data.source is parquet but data.paths is empty"):
        JobConfig.from_dict({"model": {"factory": "airay.models.tiny_gpt:build"},
                             "loss_fn": "airay.models.tiny_gpt:loss", "global_batch_size": 8,
                             "micro_batch_size": 4, "max_steps": 2, "data": {"source": "parquet"}})
    with pytest.raises(ConfigError, match="set data.source: parquet"):
        JobConfig.from_dict({"model": {"factory": "airay.models.tiny_gpt:build"},
                             "loss_fn": "airay.models.tiny_gpt:loss", "global_batch_size": 8,
                             "micro_batch_size": 4, "max_steps": 2, "data": {"paths": ["x"]}})
    with pytest.raises(ConfigError, match="set max_steps"):
        JobConfig.from_dict({"model": {"factory": "airay.models.tiny_gpt:build"},
                             "loss_fn": "airay.models.tiny_gpt:loss", "global_batch_size": 8,
                             "micro_batch_size": 4})


def test_fetch_timeout_is_below_the_hang_timeout_and_data_faults_need_streamed_data():
    base = {"model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
            "global_batch_size": 8, "micro_batch_size": 4, "max_steps": 4}
    streamed = {"source": "parquet", "paths": ["x"]}
    cfg = JobConfig.from_dict({**base, "data": streamed, "timeouts": {"hang_timeout_s": 20}})
    assert cfg.data_fetch_timeout_s == 10  # default: half the hang timeout
    assert JobConfig.from_dict({**base, "data": {**streamed, "fetch_timeout_s": 3}}).data_fetch_timeout_s == 3
    with pytest.raises(ConfigError, match=r"data.fetch_timeout_s \(60\) must be < timeouts.hang_timeout_s \(60\).*"
                                          "lower data.fetch_timeout_s"):
        JobConfig.from_dict({**base, "data": {**streamed, "fetch_timeout_s": 60}})
    with pytest.raises(ConfigError, match="data.fetch_timeout_s"):
        JobConfig.from_dict({**base, "data": {**streamed, "fetch_timeout_s": 0}})
    with pytest.raises(ConfigError, match=r"chaos\[0\]: stall_data_block .* needs data.source parquet or dataset"):
        JobConfig.from_dict({**base, "chaos": [{"fault": "stall_data_block", "at_step": 1}]})


def test_data_fetch_error_keeps_its_step_and_rank_across_pickling():
    import pickle

    from airay.data.source import DataFetchError, pieces_identity

    err = pickle.loads(pickle.dumps(DataFetchError("rank 1, step 7: block lost", 7, 1)))
    assert (str(err), err.step, err.rank) == ("rank 1, step 7: block lost", 7, 1)

    class Ref:
        def __init__(self, b):
            self.b = b

        def binary(self):
            return self.b

    assert pieces_identity([(Ref(b"a"), 0, 4)]) == pieces_identity([(Ref(b"a"), 0, 4)])
    assert pieces_identity([(Ref(b"a"), 0, 4)]) != pieces_identity([(Ref(b"b"), 0, 4)])


def test_a_stalled_pipeline_is_restarted_then_fails_never_waits_forever():
    import threading
    import time

    from airay.data.pipeline import PIPELINE_RETRIES, Feeder, Stream

    class StalledFeeder(Feeder):
        """Its pipeline produces nothing (as a reader stuck for good would), until told to stop."""

        starts = 0
        stop = threading.Event()

        def _parquet_pieces(self, start):
            StalledFeeder.starts += 1
            while not self.stop.wait(0.02):
                pass
            yield from ()

    layout = EpochLayout(96, 8, seed=0, chunk_rows=8, window_steps=2)
    feeder = StalledFeeder(Stream(None, layout, None, {}, "fp"), max_steps=12, capacity=4)
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match=r"did not produce steps 0-2 within 0.2s \(data.pipeline_timeout_s\)"):
            feeder.steps(0, 3, timeout_s=0.2)
    finally:
        StalledFeeder.stop.set()
        feeder.close()
    assert StalledFeeder.starts == 1 + PIPELINE_RETRIES  # restarted, then given up
    assert time.monotonic() - t0 < 5

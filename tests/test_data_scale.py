"""Streamed data at scale and the text example, on a local cluster with small object stores."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from airay import JobConfig, fit
from airay.events import read_jsonl
from tests.conftest import assert_released, ray_cluster

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
STORE = 75 * 1024**2  # the smallest object store Ray allows, on the head and on each node


@pytest.fixture(scope="module")
def small_store_cluster():
    with ray_cluster(nodes=2, object_store_memory=STORE) as lc:
        yield lc


def test_dataset_several_times_the_object_store_streams_through(tmp_path, small_store_cluster):
    """500 rows of 1 MiB incompressible bytes go to the workers as tensors, one 4-row step at a
    time: 7x the head's object store (where the readers put every block) and over 2x the whole
    cluster's. (Ray still spills some blocks to disk here: the driver's buffer and Ray Data's
    queues are bounded in steps, not in bytes.)"""
    row_bytes, rows, files = 1024**2, 500, 5
    rng = np.random.default_rng(0)
    for i, ids in enumerate(np.array_split(np.arange(rows), files)):
        payload = pa.array([rng.bytes(row_bytes) for _ in ids], pa.binary())
        tokens = pa.FixedSizeListArray.from_arrays(pa.array(np.tile(np.arange(9, dtype=np.int32), len(ids))), 9)
        pq.write_table(pa.table({"payload": payload, "tokens": tokens}), tmp_path / f"big-{i}.parquet",
                       compression="none", row_group_size=10)
    data_bytes = sum(p.stat().st_size for p in tmp_path.glob("big-*.parquet"))
    store_total = STORE * len(ray.nodes())
    assert data_bytes > 6 * STORE and data_bytes > 2 * store_total
    cfg = JobConfig.from_dict({
        "name": "big", "run_dir": str(tmp_path / "run"),
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"seq_len": 8, "d_model": 16, "n_layers": 1}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "data": {"source": "parquet", "paths": [str(tmp_path)], "epochs": 1, "window_steps": 2, "chunk_rows": 20,
                 "readers": 1, "preprocess": "airay.data.readers:bytes_to_uint8",
                 "preprocess_kwargs": {"columns": ["payload"]}, "record_sample_ids": True},
        "global_batch_size": 4, "micro_batch_size": 4, "steps_per_round": 5,
        "scaling": {"min_workers": 1, "max_workers": 1}, "checkpoint": {"every_n_steps": 1000},
    })
    result = fit(cfg, echo=False)
    assert result.status == "finished" and result.final_step == rows // 4, result.error
    samples = read_jsonl(f"{result.run_dir}/samples.jsonl")
    assert sorted(i for s in samples for i in s["sample_ids"]) == list(range(rows))
    assert_released()


def test_text_job_trains_on_tokenized_stdlib_text(tmp_path, small_store_cluster):
    data_dir = tmp_path / "text"
    subprocess.run([sys.executable, str(ROOT / "jobs" / "make_text_parquet.py"), str(data_dir), "--rows", "1200"],
                   check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    cfg = JobConfig.from_yaml(ROOT / "jobs" / "text.yaml", [
        f"data.paths=[{data_dir}]", "cluster=", "scaling.max_workers=2", f"run_dir={tmp_path / 'run'}"])
    result = fit(cfg, echo=False)
    assert result.status == "finished" and result.final_step == 1200 // 48 and result.world_sizes == [2]
    losses = [m["loss"] for m in read_jsonl(f"{result.run_dir}/metrics.jsonl")]
    assert losses[-1] < losses[0] - 1.0  # bytes of Python source are far from uniform over 256
    assert all("data_wait_s" in m for m in read_jsonl(f"{result.run_dir}/metrics.jsonl"))
    assert_released()


def test_a_ray_dataset_passed_to_fit_streams_each_row_once_per_epoch(tmp_path, small_store_cluster):
    rows, gbs = 96, 8
    tokens = (np.arange(rows)[:, None] * 3 + np.arange(33)[None, :]) % 256
    ds = ray.data.from_items([{"tokens": tokens[i].astype(np.int64)} for i in range(rows)])
    cfg = JobConfig.from_dict({
        "name": "rayds", "run_dir": str(tmp_path / "run"),
        "model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
        "data": {"source": "dataset", "epochs": 2, "seed": 5, "window_steps": 4, "record_sample_ids": True},
        "global_batch_size": gbs, "micro_batch_size": 4, "steps_per_round": 5,
        "scaling": {"min_workers": 2, "max_workers": 2}, "checkpoint": {"every_n_steps": 1000}})
    result = fit(cfg, echo=False, dataset=ds)
    assert result.status == "finished" and result.final_step == 2 * rows // gbs, result.error
    samples = {s["step"]: s["sample_ids"] for s in read_jsonl(f"{result.run_dir}/samples.jsonl")}
    from airay.data.layout import EpochLayout

    layout = EpochLayout(rows, gbs, seed=5, chunk_rows=rows, window_steps=4)
    assert all(samples[s] == sorted(layout.step_rows(s).tolist()) for s in samples)
    for epoch in (0, 1):
        assert sorted(i for s in range(epoch * 12, epoch * 12 + 12) for i in samples[s]) == list(range(rows))
    assert_released()


class Fetcher:
    """A training worker's data path without the model: fetch a rank's rows of given steps."""

    def fetch(self, steps, rank, plan):
        from airay.data.source import fetch_rank_batches
        from airay.policy import BatchPlan

        plan = BatchPlan(**plan)
        out = {}
        for step, pieces in steps.items():
            batches = fetch_rank_batches(pieces, rank, plan)
            out[step] = (np.concatenate([b["sample_id"].numpy() for b in batches]),
                         np.concatenate([b["tokens"].numpy() for b in batches]))
        return out


def test_blocks_stay_fetchable_after_ray_data_releases_its_readers(tmp_path, small_store_cluster):
    """Ray Data drops its reader actors once they have read every window, while the feeder still
    holds blocks it has not handed out yet. A worker on another node fetches every step only
    after the pipeline has closed (its readers gone) and gets each step's rows. (A suspect in
    benchmarks/data.py's hang at its default size, where a fetch began just after Ray Data let
    the block's reader go and never returned; this test passes, so that alone is not the cause.)"""
    from airay.data.pipeline import Feeder
    from airay.data.prepare import prepare
    from airay.policy import plan_batch
    from tests.test_data_stream import write_token_parquet

    rows, gbs, seq_len = 256, 16, 32
    write_token_parquet(tmp_path / "data", rows, files=2, seq_len=seq_len)
    cfg = JobConfig.from_dict({
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"seq_len": seq_len}},
        "loss_fn": "airay.models.tiny_gpt:loss", "global_batch_size": gbs, "micro_batch_size": 8,
        "data": {"source": "parquet", "paths": [str(tmp_path / "data")], "columns": ["tokens"], "epochs": 1,
                 "window_steps": 2, "chunk_rows": 32}})
    cfg, stream = prepare(cfg)
    feeder = Feeder(stream, cfg.max_steps, capacity=cfg.max_steps)
    fetcher = ray.remote(Fetcher).options(num_cpus=1).remote()  # on a worker node: the head has no CPU
    try:
        steps = feeder.steps(0, cfg.max_steps)
        feeder._thread.join()  # the producer has closed the pipeline: Ray Data released its readers
        got = ray.get(fetcher.fetch.remote(steps, 0, plan_batch(gbs, 8, 1).__dict__), timeout=60)  # a hang fails
    finally:
        feeder.close()
        ray.kill(fetcher)
    assert sorted(got) == list(range(rows // gbs))
    for step, (ids, tokens) in got.items():
        assert sorted(ids.tolist()) == sorted(stream.layout.step_rows(step).tolist())
        start, stride = (ids * 7) % 256, 1 + ids % 7  # what write_token_parquet wrote for these rows
        assert np.array_equal(tokens, (start[:, None] + stride[:, None] * np.arange(seq_len + 1)) % 256)


def slow_rows(batch, seconds):
    """A preprocess made slow on purpose in the readers (an actor); in the driver, where
    airay.data.prepare checks it on the first rows, it returns at once."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        time.sleep(seconds)
    return batch


def test_closing_the_feeder_ends_its_producer_and_shuts_its_pipeline_down(tmp_path, small_store_cluster):
    """A run can end while the feeder's producer waits on Ray Data for a block (here its readers
    are slow on purpose: ten minutes a window). Closing the feeder shuts that execution down and
    ends the producer before it returns: nothing of the run is left to call into Ray after it.
    (Before, the producer ran on; when ray.shutdown took the readers, Ray Data's shutdown of the
    execution called ray.wait from it and Ray's auto-init connected the process again.)"""
    from airay.data.pipeline import Feeder
    from airay.data.prepare import prepare
    from tests.conftest import live_airay_threads, running_data_executions
    from tests.test_data_stream import write_token_parquet

    write_token_parquet(tmp_path / "data", 64, files=1, seq_len=8)
    cfg = JobConfig.from_dict({
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"seq_len": 8}},
        "loss_fn": "airay.models.tiny_gpt:loss", "global_batch_size": 8, "micro_batch_size": 8,
        "data": {"source": "parquet", "paths": [str(tmp_path / "data")], "columns": ["tokens"], "epochs": 1,
                 "window_steps": 2, "chunk_rows": 16, "readers": 1,
                 "preprocess": "tests.test_data_scale:slow_rows", "preprocess_kwargs": {"seconds": 600}}})
    cfg, stream = prepare(cfg)
    feeder = Feeder(stream, cfg.max_steps, capacity=cfg.max_steps)
    before = set(running_data_executions())
    feeder.seek(0)  # the producer starts the pipeline and waits for its first block
    producer = feeder._thread
    deadline = time.monotonic() + 120
    while not set(running_data_executions()) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(running_data_executions()) - before, "the pipeline never started"
    assert producer.is_alive() and not feeder.ready(0, 1)  # waiting: the readers sleep
    feeder.close()
    assert not producer.is_alive()
    assert set(running_data_executions()) <= before and live_airay_threads() == []

"""Parquet data streamed through Ray Data on a real 4-node local cluster: the samples of every
committed step are the same whatever happens to the world (worker kill, node removal, regrow,
a driver restart that resumes from a checkpoint) or to the data (a block lost, a block that never
arrives), each epoch covers every row once, and the losses equal the fault-free run's (rtol as in
test_elastic)."""

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from airay import JobConfig, fit
from airay.checkpoint.layout import step_name
from airay.events import committed_losses, read_jsonl
from tests.conftest import assert_released

pytestmark = pytest.mark.cluster

RTOL = 1e-4
GBS, STEPS_PER_EPOCH, EPOCHS = 24, 20, 3
STEPS = STEPS_PER_EPOCH * EPOCHS
ROWS = GBS * STEPS_PER_EPOCH


def write_token_parquet(root, rows, files=3, seq_len=32):
    """Learnable rows (arithmetic progressions mod 256), split over several files and row groups;
    column `row` is the row's global index, so a test can check what was read."""
    root.mkdir(parents=True, exist_ok=True)
    for i, ids in enumerate(np.array_split(np.arange(rows), files)):
        start, stride = (ids * 7) % 256, 1 + ids % 7
        tokens = (start[:, None] + stride[:, None] * np.arange(seq_len + 1)) % 256
        table = pa.table({"row": ids, "tokens": pa.FixedSizeListArray.from_arrays(
            pa.array(tokens.ravel().astype(np.int32)), seq_len + 1), "note": [f"r{j}" for j in ids]})
        pq.write_table(table, root / f"part-{i}.parquet", row_group_size=40)
    return root


def spec(tmp_path, name, data_dir, chaos=(), data_extra=None, **overrides):
    data = {
        "name": "stream",  # one job: the restarted driver resumes the faulty run's checkpoints
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": 0.08}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 8}},
                      "zero_optimization": {"stage": 2}},
        "data": {"source": "parquet", "paths": [str(data_dir)], "columns": ["tokens"], "epochs": EPOCHS,
                 "seed": 7, "chunk_rows": 20, "window_steps": 3, "record_sample_ids": True, **(data_extra or {})},
        "global_batch_size": GBS, "micro_batch_size": 4, "steps_per_round": 5,
        "scaling": {"min_workers": 2, "max_workers": 4},
        "checkpoint": {"every_n_steps": 5},
        "chaos": list(chaos),
        "run_dir": str(tmp_path / name),
    }
    data.update(overrides)
    return JobConfig.from_dict(data)


def committed_samples(*run_dirs):
    """step -> sorted sample ids as finally committed (later lines and later runs win)."""
    out = {}
    for run_dir in run_dirs:
        out.update({r["step"]: r["sample_ids"] for r in read_jsonl(f"{run_dir}/samples.jsonl")})
    return out


def events(run_dir, type_):
    return [e for e in read_jsonl(f"{run_dir}/events.jsonl") if e["type"] == type_]


def test_samples_and_losses_survive_faults_regrow_and_driver_restart(tmp_path, local_cluster):
    lc = local_cluster(nodes=4)
    data_dir = write_token_parquet(tmp_path / "data", ROWS)
    # No forward delay for the baseline: it paces the faulty runs (a sleep), not the math.
    base = fit(spec(tmp_path, "base", data_dir, model={"factory": "airay.models.tiny_gpt:build"}), echo=False)
    assert base.status == "finished" and base.final_step == STEPS_PER_EPOCH * EPOCHS and base.world_sizes == [4]
    expected = committed_samples(base.run_dir)
    assert sorted(expected) == list(range(STEPS)) and all(len(ids) == GBS for ids in expected.values())
    for epoch in range(EPOCHS):  # every row exactly once per epoch, in another order each epoch
        steps = range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
        assert sorted(i for s in steps for i in expected[s]) == list(range(ROWS))
    assert expected[0] != expected[STEPS_PER_EPOCH] != expected[2 * STEPS_PER_EPOCH]
    # The workers trained on exactly these rows: the first step's ids are the layout's.
    from airay.data.layout import EpochLayout

    layout = EpochLayout(ROWS, GBS, seed=7, chunk_rows=20, window_steps=3)
    assert expected[13] == sorted(layout.step_rows(13).tolist())
    # The head (the driver's node) decoded nothing: every reader ran on a node that trains.
    import ray

    readers = [a for a in ray.state.actors().values() if "MapWorker" in a["ActorClassName"]]
    assert readers and all(a["Address"]["NodeID"] != lc.cluster.head_node.node_id for a in readers)

    # Faults, then a driver restart: a worker is killed (the world shrinks, then regrows when
    # its replacement is up), a node is removed and another added; the first driver stops at
    # step 48 and its last checkpoint (48) is deleted as if it died before writing it, so the
    # second driver resumes from step 45 and replays steps 45-47. The second run then loses
    # data: rank 1's rows of step 52 come from a block whose owner died, and rank 2's of step 57
    # from one that never arrives; each costs its round (rounds 50-54 and 55-59), on the same world.
    ckpt = tmp_path / "ckpt"
    chaos = [{"fault": "kill_worker", "at_step": 4, "rank": 1}, {"fault": "remove_node", "at_step": 42, "rank": 2},
             {"fault": "add_node", "at_step": 43}]
    first = fit(spec(tmp_path, "faults", data_dir, chaos, max_steps=48, checkpoint={"every_n_steps": 5,
                                                                                 "path": str(ckpt)}),
                echo=False, local_cluster=lc)
    assert first.status == "finished" and first.final_step == 48
    assert first.world_sizes[:4] == [4, 3, 4, 3]  # shrank, regrew, lost a node
    assert len(events(first.run_dir, "node_lost")) == 1 and len(events(first.run_dir, "worker_failed")) == 1
    shutil.rmtree(ckpt / step_name(48))
    data_faults = [{"fault": "lose_data_block", "at_step": 52, "rank": 1},
                   {"fault": "stall_data_block", "at_step": 57, "rank": 2}]
    second = fit(spec(tmp_path, "restart", data_dir, data_faults, data_extra={"fetch_timeout_s": 4},
                      checkpoint={"every_n_steps": 5, "path": str(ckpt)}), echo=False, local_cluster=lc)
    assert second.status == "finished" and second.final_step == STEPS
    assert [e["step"] for e in events(second.run_dir, "checkpoint_loaded")] == [45, 50, 55]
    lost = events(second.run_dir, "data_block_lost")
    assert [(e["step"], e["rank"], e["round_start"]) for e in lost] == [(52, 1, 50), (57, 2, 55)]
    assert "OwnerDiedError" in lost[0]["error"] and "within data.fetch_timeout_s=4s" in lost[1]["error"]
    assert second.world_sizes == [4, 4, 4] and second.restarts == 2  # nobody was replaced or dropped
    assert [(e["old_world_size"], e["new_world_size"], e["cause"]) for e in events(second.run_dir, "resize_started")] \
        == [(4, 4, "data_lost")] * 2
    assert not any(events(second.run_dir, t) for t in ("worker_failed", "hang_detected", "node_lost"))

    assert committed_samples(first.run_dir, second.run_dir) == expected
    losses = {**committed_losses(first.run_dir), **committed_losses(second.run_dir)}
    ref = committed_losses(base.run_dir)
    assert sorted(losses) == sorted(ref) == list(range(STEPS))
    for step in ref:
        assert losses[step] == pytest.approx(ref[step], rel=RTOL), step
    assert ref[STEPS - 1] < ref[0] - 0.5  # it trained
    assert_released()

"""Elasticity on a real multi-node Ray cluster (ray.cluster_utils raylets on this machine).

The global batch is 16: a world of 3 does not divide it, so its ranks train on 6, 5 and 5 samples
(micro-batches of 3, 3 / 3, 2 / 3, 2, each loss weighted by its share) while a world of 4 trains
on 4 each. Tolerance for loss equality: fp32 everywhere; a world of 3 sums gradients in a
different order (and groups samples into different micro-batches) than a world of 4, so losses
agree to float rounding, not bit for bit. rtol=1e-4 leaves room for that rounding to accumulate over 60 steps,
while a wrong sample, a lost optimizer moment or a skipped LR step moves the loss by far more
(the loss falls by >0.5 over the run, ~1e-2 per step).
"""

import json
import signal
from pathlib import Path

import pytest

from airay import JobConfig, fit
from airay.events import committed_losses, read_jsonl
from tests.conftest import assert_released, connected, signal_rank_after

pytestmark = pytest.mark.cluster

RTOL = 1e-4
SHARED_NODES = 4  # one cluster for the module's runs of 4 workers (tests.conftest.shared_cluster)


def spec(tmp_path, name, zero_stage=2, chaos=(), **overrides):
    data = {
        "name": name,
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": 0.08}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 8}},
                      "zero_optimization": {"stage": zero_stage}},
        "global_batch_size": 16, "micro_batch_size": 4, "max_steps": 60, "steps_per_round": 5,
        "data": {"record_sample_ids": True},
        "scaling": {"min_workers": 2, "max_workers": 4},
        "checkpoint": {"every_n_steps": 5},
        "timeouts": {"capacity_wait_s": 60},
        "chaos": list(chaos),
        "run_dir": str(tmp_path / name),
    }
    data.update(overrides)
    return JobConfig.from_dict(data)


def events(result, type_):
    return [e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["type"] == type_]


def committed_samples(run_dir) -> dict[int, list[int]]:
    """Each committed step's sample ids (a replayed step's later line wins, as in metrics)."""
    return {r["step"]: r["sample_ids"] for r in read_jsonl(f"{run_dir}/samples.jsonl")}


def assert_same_losses(run, baseline):
    a, b = committed_losses(run.run_dir), committed_losses(baseline.run_dir)
    assert sorted(a) == sorted(b) == list(range(60))
    for step in b:
        assert a[step] == pytest.approx(b[step], rel=RTOL), step
    assert b[59] < b[0] - 0.5  # it trained: equality is not between two flat lines
    # The same samples at every step, whatever the world size (no padded slot counted twice).
    samples = committed_samples(run.run_dir)
    assert samples == committed_samples(baseline.run_dir)
    assert all(ids == list(range(16 * step, 16 * (step + 1))) for step, ids in samples.items())


# First: its cluster of GPU nodes starts before the module's shared one (two clusters up at once
# slow each other down).
def test_one_gpu_per_rank_on_multi_gpu_nodes(tmp_path, local_cluster):
    """2 nodes x 2 logical GPUs, the second node's raylet under CUDA_VISIBLE_DEVICES=6,7 (as SLURM
    or Kubernetes hand a node a subset). Bundles default to {GPU: 1}; each rank reports, from
    inside its process, what it handed DeepSpeed: LOCAL_RANK (the CUDA ordinal DeepSpeed binds its
    device and NCCL's to), CUDA_VISIBLE_DEVICES and the CUDA device. Without CUDA the training
    itself falls back to CPU and gloo."""
    import os

    lc = local_cluster(nodes=1, cpus_per_node=2, gpus_per_node=2)
    os.environ["CUDA_VISIBLE_DEVICES"] = "6,7"  # inherited by the raylet started now, and its workers
    try:
        subset = lc.cluster.add_node(num_cpus=2, num_gpus=2, object_store_memory=lc.spec.object_store_memory).node_id
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    result = fit(spec(tmp_path, "gpu", 2, max_steps=4, scaling={"min_workers": 1, "max_workers": 4},
                      model={"factory": "airay.models.tiny_gpt:build"}), echo=False)
    assert result.status == "finished" and result.world_sizes == [4]
    placement = events(result, "placement")[0]
    assert placement["resources_per_worker"] == {"GPU": 1.0}
    workers = events(result, "world_formed")[0]["workers"]
    by_node = {}
    for w in workers:
        by_node.setdefault(w["node_id"], []).append(w)
    assert sorted(len(ws) for ws in by_node.values()) == [2, 2]
    for node, ws in by_node.items():
        ws.sort(key=lambda w: w["local_rank"])
        assert [w["local_rank"] for w in ws] == [0, 1]  # no two ranks of a node share a device
        assert [w["cuda_device"] for w in ws] == ["cuda:0", "cuda:1"]
        if node == subset:
            assert [w["gpu_ids"] for w in ws] == [["6"], ["7"]]  # Ray's ids: entries of the raylet's list
            assert {w["cuda_visible_devices"] for w in ws} == {"6,7"}  # not masked: NCCL sees both
        else:
            assert [w["gpu_ids"] for w in ws] == [["0"], ["1"]]
            assert {w["cuda_visible_devices"] for w in ws} == {None}
    assert all(w["device"] == "cpu" and w["backend"] == "gloo" and w["engine_device"] == "cpu" for w in workers)
    assert_released()


@pytest.fixture(scope="module")
def baselines(shared_cluster, tmp_path_factory):
    """Fault-free 4-worker runs, one per ZeRO stage, computed once for the module."""
    out = {}
    with connected(shared_cluster):
        for stage in (2, 3):
            # No forward delay: it paces the faulty runs (a sleep), it does not change the math.
            result = fit(spec(tmp_path_factory.mktemp("base"), f"base-z{stage}", stage,
                              model={"factory": "airay.models.tiny_gpt:build"}), echo=False)
            assert result.status == "finished" and result.world_sizes == [4] and result.restarts == 0
            out[stage] = result
        assert_released()
    return out


def test_worker_kill_shrinks_regrows_and_matches_fault_free(tmp_path, cluster, baselines, zero_stage=3):
    """ZeRO-3 (every parameter partitioned: the hardest state to reshard); ZeRO-2 shrinks and
    regrows with equal losses in test_node_loss_then_node_added and tests/test_fault_matrix.py.
    The kill comes from outside while rounds are pipelined (rounds of 2, checkpoints every 10):
    the rank dies with the next round queued behind the one it runs."""
    cfg = spec(tmp_path, f"kill-z{zero_stage}", zero_stage, steps_per_round=2, checkpoint={"every_n_steps": 10})
    killer = signal_rank_after(Path(cfg.run_dir), 13, 1, signal.SIGKILL)  # while 14-15 run, 16-17 queued
    result = fit(cfg, echo=False)
    killer.join(1)
    assert result.status == "finished" and result.final_step == 60
    assert result.world_sizes == [4, 3, 4]
    (failed,) = events(result, "worker_failed")
    assert (failed["rank"], failed["outcome"]) == (1, "died") and failed["step"] in (14, 16)
    (dropped,) = events(result, "queued_round_dropped")
    assert (dropped["step"], dropped["end"], dropped["lost_ranks"]) == (failed["step"] + 2, failed["step"] + 4, [])
    shrink, grow = events(result, "resize_finished")
    assert (shrink["old_world_size"], shrink["new_world_size"], shrink["resumed_step"]) == (4, 3, 10)
    assert shrink["recovery_s"] > 0 and shrink["reason"] == "failure"
    assert (grow["old_world_size"], grow["new_world_size"], grow["reason"]) == (3, 4, "grow")
    loaded = events(result, "checkpoint_loaded")
    assert [(e["step"], e["saved_world_size"], e["world_size"]) for e in loaded][0] == (10, 4, 3)
    assert loaded[1]["step"] == grow["resumed_step"] and loaded[1]["world_size"] == 4
    # The survivors' failed step held their engine in its frames (a ZeRO-3 engine and its
    # optimizer): leaving freed it anyway, before the next world's engine was built.
    formed = events(result, "world_formed")
    assert [w["engine_outlived_leave"] for w in formed[1]["workers"]] == [False] * 3
    assert_same_losses(result, baselines[zero_stage])
    assert_released()


def test_node_loss_then_node_added(tmp_path, cluster, baselines):
    # Slower steps (the sleep does not change the math: losses still equal the baseline's) leave
    # the replacement on the new node, a cold process, time to start and warm up before step 60.
    slow = {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": 0.16}}
    # Checksums per 4 KiB (the partitions are ~100 KB): each new rank reads and verifies only the
    # chunks of the old partitions it needs, from the surviving nodes' stores.
    result = fit(spec(tmp_path, "node", 2, chaos=[{"fault": "remove_node", "at_step": 7, "rank": 2},
                                                   {"fault": "add_node", "at_step": 12}], model=slow,
                      checkpoint={"every_n_steps": 5, "chunk_mib": 4 / 1024}),
                 echo=False, local_cluster=cluster)
    assert result.status == "finished" and result.world_sizes == [4, 3, 4]
    lost = events(result, "node_lost")
    assert len(lost) == 1 and lost[0]["rank"] == 2 and lost[0]["step"] == 7
    shrink, grow = events(result, "resize_finished")
    assert (shrink["new_world_size"], shrink["resumed_step"]) == (3, 5)
    assert grow["new_world_size"] == 4 and grow["resumed_step"] >= 12
    for loaded in events(result, "checkpoint_loaded"):  # the shrink's load and the grow's
        assert loaded["resharded"] and loaded["partial_files"] >= 4, loaded
        assert loaded["bytes_needed"] <= loaded["bytes_read"] < 1.5 * loaded["bytes_needed"], loaded
    assert_same_losses(result, baselines[2])
    assert_released()


def test_below_min_workers_fails_cleanly_and_keeps_checkpoints(tmp_path, cluster):
    cfg = spec(tmp_path, "fail", 2, chaos=[{"fault": "remove_node", "at_step": 7, "rank": 0}],
               scaling={"min_workers": 4, "max_workers": 4}, timeouts={"capacity_wait_s": 3})
    result = fit(cfg, echo=False, local_cluster=cluster)
    assert result.status == "failed"
    assert "below scaling.min_workers=4" in result.error and "capacity_wait_s" in result.error
    assert events(result, "run_failed")[0]["error"] == result.error
    assert json.loads(open(f"{result.run_dir}/result.json").read())["status"] == "failed"
    from airay.checkpoint.tiers import DurableTier

    # Nothing lost: the durable step 5 is complete (no job check needed to list it).
    assert [c.step for c in DurableTier(f"{result.run_dir}/checkpoints", {}).complete()] == [5]
    assert_released()


def test_user_code_error_fails_fast_with_rank_and_traceback(tmp_path, cluster):
    result = fit(spec(tmp_path, "bad-model", 2, scaling={"min_workers": 1, "max_workers": 2},
                      model={"factory": "airay.models.tiny_gpt:build", "kwargs": {"n_layerz": 2}}), echo=False)
    assert result.status == "failed" and result.restarts == 0 and result.world_sizes == []
    assert "rank 0: TypeError" in result.error and "unexpected keyword argument 'n_layerz'" in result.error
    assert "Traceback" in result.error and "tiny_gpt.py" in result.error
    assert_released()

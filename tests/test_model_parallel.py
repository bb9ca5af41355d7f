"""Elastic training with model parallelism: a Hugging Face Llama whose replicas are groups of 2
ranks, sliced by tensor parallelism (DeepSpeed AutoTP) or splitting each sequence by sequence
parallelism (DeepSpeed Ulysses), elastic over its data-parallel replicas, on a real local cluster
of 2 nodes x 2 CPUs (a group fits a node), gloo on CPU.

A killed rank retires its whole group: the world goes 4 -> 2 (one replica, on one node), and back
to 4 when the killed rank's replacement completes a group on its node. Every step trains on the
same samples in the same order at every data-parallel size, so the per-step losses equal the
fault-free run's (the same samples and math in every layout: the sequence-parallel run is held to
the tensor-parallel run's losses); the checkpoints are resharded across data-parallel sizes (per
tensor-parallel slice), and one written after those reshards exports to a Hugging Face folder
whose loss on that step's batch is the logged loss.
"""

import pytest

from airay import fit
from airay.events import committed_losses, read_jsonl
from tests.conftest import assert_released, ray_cluster
from tests.test_hf import GBS, SEQ, step_loss
from tests.test_hf import spec as hf_spec

pytestmark = pytest.mark.cluster

STEPS = 12


TP = {"tensor_parallel": {"autotp_size": 2}}
SP = {"sequence_parallel_size": 2}


def spec(run_dir, layout, chaos=(), forward_delay_s=0.0):
    """test_hf's Llama spec at ZeRO-2, each replica over 2 ranks (`layout`: TP or SP)."""
    return hf_spec(run_dir, 2, chaos, forward_delay_s=forward_delay_s, steps_per_round=2, every_n_steps=2,
                   max_steps=STEPS, deepspeed=layout)


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=2, cpus_per_node=2) as lc:
        yield lc


@pytest.fixture(scope="module")
def base(cluster, tmp_path_factory):
    """The fault-free run: tensor parallel, 2 replicas all along."""
    result = fit(spec(tmp_path_factory.mktemp("base"), TP), echo=False, local_cluster=cluster)
    assert result.status == "finished" and result.world_sizes == [4], result.error
    assert_released()
    return result


def all_cpus_free():
    """Ray's per-node view of free resources lags a released run by up to a second; a replica's
    placement group is one node's, sized from that view, so the next run would start with one
    replica (and grow): wait until every CPU shows free again."""
    import time

    import ray

    from airay.placement import available_per_node

    deadline = time.time() + 20
    while sum(n.get("CPU", 0) for n in available_per_node()) < ray.cluster_resources()["CPU"] and time.time() < deadline:
        time.sleep(0.2)


@pytest.mark.parametrize("layout", [TP, SP], ids=["tensor-parallel", "sequence-parallel"])
def test_a_killed_rank_retires_its_group_the_replicas_shrink_and_regrow_with_the_losses_of_the_run_without(
        cluster, base, layout, tmp_path):
    from transformers import AutoModelForCausalLM

    from airay.export import export_hf

    # Paced steps: the killed rank's replacement (a cold process) is up while the run goes on.
    all_cpus_free()
    faulty = fit(spec(tmp_path / "kill", layout, [{"fault": "kill_worker", "at_step": 5, "rank": 1}],
                      forward_delay_s=0.5), echo=False, local_cluster=cluster)
    assert_released()
    assert faulty.status == "finished" and faulty.world_sizes == [4, 2, 4], faulty.error
    expected, got = committed_losses(base.run_dir), committed_losses(faulty.run_dir)
    assert sorted(got) == list(range(STEPS)) and got == pytest.approx(expected, rel=1e-4)
    assert expected[STEPS - 1] < expected[0]  # it trained

    events = read_jsonl(f"{faulty.run_dir}/events.jsonl")
    formed = [e for e in events if e["type"] == "world_formed"]
    assert [(e["world_size"], e["plan"]["world_size"]) for e in formed] == [(4, 2), (2, 1), (4, 2)]
    # Each group of 2 consecutive ranks shares a node; the world of one replica is the group
    # that lost no rank (ranks 2 and 3, on the other node than the killed rank 1).
    for e in formed:
        nodes = [w["node_id"] for w in e["workers"]]
        assert all(nodes[g] == nodes[g + 1] for g in range(0, len(nodes), 2)), nodes
    killed_node = next(e["node_id"] for e in events if e["type"] == "worker_failed")
    assert {w["node_id"] for w in formed[1]["workers"]} != {killed_node}
    loads = [e for e in events if e["type"] == "checkpoint_loaded"]
    assert [(e["saved_world_size"], e["world_size"], e["resharded"]) for e in loads] == [(4, 2, True), (2, 4, True)]
    # A replica's samples count once: the tokens of a step are the global batch's.
    metrics = [m for m in read_jsonl(f"{faulty.run_dir}/metrics.jsonl") if "tokens_per_s" in m]
    assert metrics and all(m["tokens_per_s"] * m["step_time_s"] == pytest.approx(GBS * SEQ) for m in metrics)

    # The first durable step saved after the state went through the reshards (4 -> 2 -> 4 ranks'
    # partitions), exported as one model (tensor parallel: its two slices joined).
    saved = [e["step"] for e in events if e["type"] == "checkpoint_saved" and e["tier"] == "durable"]
    step = min(s for s in saved if s > formed[2]["step"])
    out = export_hf(f"{faulty.run_dir}/checkpoints/step_{step:08d}", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert step_loss(model, step) == pytest.approx(got[step], rel=1e-5)

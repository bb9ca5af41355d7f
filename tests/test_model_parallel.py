"""Elastic training with tensor parallelism (DeepSpeed AutoTP): a Hugging Face Llama sliced over
model-parallel groups of 2 ranks, elastic over its data-parallel replicas, on a real local cluster
of 2 nodes x 2 CPUs (a group fits a node), gloo on CPU.

A killed rank retires its whole group: the world goes 4 -> 2 (one replica, on one node), and back
to 4 when the killed rank's replacement completes a group on its node. Every step trains on the
same samples in the same order at every data-parallel size, so the per-step losses equal the
fault-free run's with the same layout; the checkpoints are resharded per tensor-parallel slice
across data-parallel sizes, and one written after those reshards exports to a Hugging Face folder
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


def spec(run_dir, chaos=(), forward_delay_s=0.0):
    """test_hf's Llama spec at ZeRO-2, each replica over 2 tensor-parallel ranks."""
    return hf_spec(run_dir, 2, chaos, forward_delay_s=forward_delay_s, steps_per_round=2, every_n_steps=2,
                   max_steps=STEPS, deepspeed={"tensor_parallel": {"autotp_size": 2}})


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=2, cpus_per_node=2) as lc:
        yield lc


def test_a_killed_rank_retires_its_group_the_replicas_shrink_and_regrow_with_the_losses_of_the_run_without(
        cluster, tmp_path):
    from transformers import AutoModelForCausalLM

    from airay.export import export_hf

    base = fit(spec(tmp_path / "base"), echo=False, local_cluster=cluster)
    assert base.status == "finished" and base.world_sizes == [4], base.error
    assert_released()
    # Paced steps: the killed rank's replacement (a cold process) is up while the run goes on.
    faulty = fit(spec(tmp_path / "kill", [{"fault": "kill_worker", "at_step": 5, "rank": 1}], forward_delay_s=0.8),
                 echo=False, local_cluster=cluster)
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

    # The first durable step saved after the state went through the reshards (4 -> 2 -> 4
    # replicas' partitions): its two slices joined into the whole model.
    saved = [e["step"] for e in events if e["type"] == "checkpoint_saved" and e["tier"] == "durable"]
    step = min(s for s in saved if s > formed[2]["step"])
    out = export_hf(f"{faulty.run_dir}/checkpoints/step_{step:08d}", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert step_loss(model, step) == pytest.approx(got[step], rel=1e-5)

"""Hugging Face transformers models through airay: a Llama-architecture model trained elastically
on a real multi-node cluster, and its checkpoints exported as model folders that
`AutoModelForCausalLM.from_pretrained` loads and that compute the loss the run logged.

The loss check: a checkpoint "at step N" holds the weights step N trained from, and step N's
logged loss is the mean over its global batch (full-length sequences, so the weighted
micro-batch means are the global token mean). The exported model, in fp32, on step N's samples
must give that loss (rtol 1e-5).
"""

import pytest
import torch

from airay import JobConfig, fit
from airay.config import ConfigError
from airay.events import committed_losses, read_jsonl
from airay.models import hf
from airay.policy import plan_batch
from tests.conftest import assert_released, ray_cluster

pytestmark = pytest.mark.cluster

LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64}
SEQ, GBS, STEPS = 32, 12, 12


def paced_build(seed=0, forward_delay_s=0.0, **kwargs):
    """hf.build with a sleep before each forward: slower steps (the math is unchanged: losses
    equal an unpaced run's) leave the replacement of a killed worker, a cold process, time to
    start and warm up before the run ends, so the world regrows."""
    import time

    model = hf.build(seed, **kwargs)
    model.register_forward_pre_hook(lambda module, args: time.sleep(forward_delay_s))
    return model


paced_build.builds_partitioned = True  # through hf.build: transformers partitions it (airay.worker.build)


def counted_build(seed=0, calls_to="", **kwargs):
    """hf.build that appends a line to `calls_to` each time its first decoder layer's MLP starts:
    a forward, or its recompute in the backward pass under gradient checkpointing."""
    def count(module, args):  # returns None: the MLP's inputs stay as they are
        with open(calls_to, "a") as f:
            f.write("1\n")

    model = hf.build(seed, **kwargs)
    model.model.layers[0].mlp.register_forward_pre_hook(count)
    return model


counted_build.builds_partitioned = True


def spec(run_dir, stage, chaos=(), export=False, forward_delay_s=0.0, steps_per_round=4,
         every_n_steps=4, max_steps=STEPS, model=None, deepspeed=None):
    model = model or ({"factory": "tests.test_hf:paced_build",
                       "kwargs": {"config": LLAMA, "forward_delay_s": forward_delay_s}} if forward_delay_s else
                      {"factory": "airay.models.hf:build", "kwargs": {"config": LLAMA}})
    return JobConfig.from_dict({
        "name": run_dir.name, "model": model,
        "loss_fn": "airay.models.hf:loss",
        "data": {"sample_fn": "airay.models.hf:synthetic_tokens", "kwargs": {"vocab_size": 128, "seq_len": SEQ}},
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": stage},
                      **(deepspeed or {})},
        "global_batch_size": GBS, "micro_batch_size": 2, "max_steps": max_steps, "steps_per_round": steps_per_round,
        "scaling": {"min_workers": 2, "max_workers": 4}, "checkpoint": {"every_n_steps": every_n_steps, "keep_last": 8, "export_hf": export},
        "timeouts": {"capacity_wait_s": 30, "hang_timeout_s": 20, "collective_timeout_s": 30, "survivor_drain_s": 10},
        "chaos": list(chaos), "run_dir": str(run_dir)})


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=3, cpus_per_node=2) as lc:
        yield lc


@pytest.fixture(scope="module")
def base(cluster, tmp_path_factory):
    """The fault-free reference run (ZeRO-3, a world of 4, sdpa attention as the spec names it)."""
    model = {"factory": "airay.models.hf:build", "kwargs": {"config": LLAMA, "attn_implementation": "sdpa"}}
    result = fit(spec(tmp_path_factory.mktemp("base"), 3, model=model), echo=False, local_cluster=cluster)
    assert result.status == "finished" and result.world_sizes == [4], result.error
    return result


def step_loss(model, step):
    batch = [hf.synthetic_tokens(i, 0, vocab_size=128, seq_len=SEQ) for i in range(step * GBS, (step + 1) * GBS)]
    stacked = {k: torch.stack([b[k] for b in batch]) for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        return float(hf.loss(model, stacked))


def test_a_llama_shrinks_regrows_with_equal_losses_and_exports_a_folder_from_pretrained_loads(cluster, base,
                                                                                               tmp_path):
    """ZeRO-3, the stage a model of billions of parameters trains at: its export reads shards of
    every parameter. ZeRO-2's path through a kill and an export is the bf16 test's below."""
    from transformers import AutoModelForCausalLM

    from airay.export import export_hf

    # Paced steps and rounds of 2: the killed rank's replacement, a cold process (10-20 s to start
    # here), joins at a round's end (4 -> 3 -> 4) with 8 steps of about 2.4 s left to do it in (a
    # kill at 6 and 0.8 s left about 10 s: a run finished at [4, 3]); durable saves every 2 steps:
    # the world of 3 writes one (at 6) before it grows.
    faulty = fit(spec(tmp_path / "kill", 3, [{"fault": "kill_worker", "at_step": 4, "rank": 1}], export=True,
                      forward_delay_s=1.2, steps_per_round=2, every_n_steps=2), echo=False, local_cluster=cluster)
    assert_released()
    assert faulty.status == "finished" and faulty.world_sizes == [4, 3, 4], faulty.error
    expected, got = committed_losses(base.run_dir), committed_losses(faulty.run_dir)
    assert sorted(got) == list(range(STEPS)) and got == pytest.approx(expected, rel=1e-4)
    assert expected[STEPS - 1] < expected[0]  # it trained
    # A step the world of 3 saved (after the kill at 4), exported from its shards and loaded back.
    saved = {e["step"]: e["world_size"] for e in read_jsonl(f"{faulty.run_dir}/events.jsonl")
             if e["type"] == "checkpoint_saved" and e["tier"] == "durable"}
    step = min(s for s, w in saved.items() if w == 3)
    out = export_hf(f"{faulty.run_dir}/checkpoints/step_{step:08d}", tmp_path / "hf")
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert step_loss(model, step) == pytest.approx(got[step], rel=1e-5)
    # A run directory exports its newest durable step: the final one, other weights.
    # (`airay export RUN_DIR --out DIR`, as every command takes a run.)
    from airay.cli import main

    assert main(["export", faulty.run_dir, "--out", str(tmp_path / "final"), "--json"]) == 0
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final", local_files_only=True).eval()
    assert step_loss(final, step) != pytest.approx(got[step], rel=1e-3)
    # checkpoint.export_hf: the run wrote the same folder itself when it finished, from a task.
    (exported,) = [e for e in read_jsonl(f"{faulty.run_dir}/events.jsonl") if e["type"] == "exported"]
    assert exported["step"] == STEPS and exported["path"] == f"{faulty.run_dir}/checkpoints/hf"
    at_end = AutoModelForCausalLM.from_pretrained(exported["path"], local_files_only=True)
    assert all(torch.equal(a, b) for a, b in zip(at_end.state_dict().values(), final.state_dict().values()))


def test_gradient_checkpointing_with_sdpa_trains_with_the_losses_of_the_run_without(cluster, base, tmp_path):
    """ZeRO-3: each layer's recompute in the backward pass gathers its partitioned parameters
    again. The first steps of the reference run's spec, gradient checkpointing on."""
    calls, steps = tmp_path / "mlp_calls", 4
    model = {"factory": "tests.test_hf:counted_build",
             "kwargs": {"config": LLAMA, "attn_implementation": "sdpa", "gradient_checkpointing": True,
                        "calls_to": str(calls)}}
    result = fit(spec(tmp_path / "gc", 3, max_steps=steps, model=model), echo=False, local_cluster=cluster)
    assert result.status == "finished" and result.world_sizes == [4], result.error
    expected, got = committed_losses(base.run_dir), committed_losses(result.run_dir)
    assert sorted(got) == list(range(steps))
    assert [got[s] for s in range(steps)] == pytest.approx([expected[s] for s in range(steps)], rel=1e-5)
    # Each micro-batch's forward ran the layer twice: once forward, once recomputed in the backward.
    forwards = steps * 4 * plan_batch(GBS, 2, 4).grad_accum_steps
    assert len(calls.read_text().splitlines()) == 2 * forwards


def test_a_spec_with_a_missing_folder_or_unknown_model_fails_before_ray_names_the_field(tmp_path):
    base = {"loss_fn": "airay.models.hf:loss", "global_batch_size": 4, "micro_batch_size": 2, "max_steps": 2}
    with pytest.raises(ConfigError, match=r"model.kwargs.pretrained: .*no config.json"):
        JobConfig.from_dict({**base, "model": {"factory": "airay.models.hf:build",
                                               "kwargs": {"pretrained": str(tmp_path / "nowhere")}}})
    with pytest.raises(ConfigError, match=r"model.kwargs.config.model_type: 'lama'"):
        JobConfig.from_dict({**base, "model": {"factory": "airay.models.hf:build",
                                               "kwargs": {"config": {"model_type": "lama"}}}})
    # A pretrained folder saved locally loads back (nothing downloads).
    folder = tmp_path / "pre"
    hf.build(seed=0, config=LLAMA).save_pretrained(folder)
    again = hf.build(seed=1, pretrained=str(folder))
    ref = hf.build(seed=0, config=LLAMA)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ref.state_dict().values()))
    # Export takes any factory that returns a transformers model, and names the one that does not.
    from airay.export import build_fp32

    assert type(build_fp32("tests.test_hf:paced_build", {"config": LLAMA})).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match=r"model.factory airay.models.tiny_gpt:build builds a TinyGPT, not a "
                                         r"transformers PreTrainedModel"):
        build_fp32("airay.models.tiny_gpt:build", {})


def test_bf16_mixed_precision_trains_through_a_kill_and_exports_fp32_master_weights(cluster, tmp_path):
    """DeepSpeed's bf16 on its CPU accelerator (ZeRO-2): the run recovers like an fp32 one, and
    the export holds the fp32 master weights, whose fp32 loss on a step's batch is the loss the
    bf16 run logged there up to bf16 rounding."""
    from transformers import AutoModelForCausalLM

    from airay.export import export_hf

    data = spec(tmp_path / "bf16", 2, [{"fault": "kill_worker", "at_step": 6, "rank": 1}]).model_dump(mode="json")
    data["deepspeed"]["bf16"] = {"enabled": True}
    result = fit(JobConfig.from_dict(data), echo=False, local_cluster=cluster)
    assert_released()
    assert result.status == "finished" and result.world_sizes[:2] == [4, 3] and result.restarts == 1, result.error
    losses = committed_losses(result.run_dir)
    assert sorted(losses) == list(range(STEPS)) and losses[STEPS - 1] < losses[0]
    out = export_hf(f"{result.run_dir}/checkpoints/step_00000008", tmp_path / "hf", dtype="bfloat16")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    assert step_loss(model, 8) == pytest.approx(losses[8], rel=1e-2)


@pytest.mark.parametrize("tied", [True, False])
def test_export_assigns_the_checkpoints_tensors_ties_them_and_names_what_is_missing(tmp_path, tied, monkeypatch):
    """Export builds the model empty (meta) and assigns the consolidated state to it. The shard
    reader is replaced by a state in memory (the cluster test above reads real shards): a tied
    lm_head held once comes back tied, the folder computes the model's logits, a missing tensor
    is named."""
    from transformers import AutoModelForCausalLM

    from airay import export

    cfg = {**LLAMA, "tie_word_embeddings": tied}
    model = hf.build(seed=3, config=cfg).eval()
    state = {k: v.clone() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    monkeypatch.setattr(export, "consolidated_state", lambda step_dir, full_shapes=None: state)
    out = export.export_step(tmp_path / "step", tmp_path / "hf", export.HF_FACTORY, {"config": cfg})
    back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = torch.arange(16).view(1, 16)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        export.export_step(tmp_path / "step", tmp_path / "hf2", export.HF_FACTORY, {"config": cfg})

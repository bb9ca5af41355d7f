"""airay.models.hf's training options, without Ray: each key the spec accepts reaches
from_config/from_pretrained (or the model), an unknown one fails when the spec loads naming it,
gradient checkpointing recomputes each layer with the same gradients, and export builds the
architecture whatever the training options. (The run with gradient checkpointing on a cluster is
tests/test_hf.py's.)"""

import json
import sys

import pytest
import torch

from airay import JobConfig
from airay.config import ConfigError
from airay.models import hf

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 32}


def load(kwargs):
    return JobConfig.from_dict({"model": {"factory": "airay.models.hf:build", "kwargs": kwargs},
                                "loss_fn": "airay.models.hf:loss", "global_batch_size": 4, "micro_batch_size": 2,
                                "max_steps": 2})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("pre")
    hf.build(seed=0, config=LLAMA).save_pretrained(out)
    return out


def test_unknown_or_wrong_keys_fail_when_the_spec_loads_naming_them():
    with pytest.raises(ConfigError, match=r"model.kwargs: unknown \['attn_impl', 'low_cpu_mem_usage'\]; "
                                          r"airay.models.hf:build takes config, .*attn_implementation.*"
                                          r"gradient_checkpointing"):
        load({"config": LLAMA, "attn_impl": "sdpa", "low_cpu_mem_usage": True})
    cases = [({"dtype": "float32", "torch_dtype": "float32"}, r"give dtype or torch_dtype \(its old name\), not both"),
             ({"torch_dtype": "float16"}, r"model.kwargs.torch_dtype: Input should be 'float32' or 'bfloat16'"),
             ({"attn_implementation": "flash"}, r"model.kwargs.attn_implementation: 'flash' is not one of eager, .*sdpa"),
             ({"attn_implementation": "paged|eager"}, r"'paged\|eager' is not one of"),
             ({"experts_implementation": "fast"}, r"model.kwargs.experts_implementation: 'fast' is not one of eager"),
             ({"gradient_checkpointing": "sometimes"}, r"model.kwargs.gradient_checkpointing: Input should be a "
                                                       r"valid boolean"),
             ({"gradient_checkpointing_kwargs": {"use_reentrant": True}}, r"set gradient_checkpointing: true"),
             ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"reentrant": True}},
              r"gradient_checkpointing_kwargs: unknown \['reentrant'\]; torch.utils.checkpoint takes use_reentrant"),
             ({"config_overrides": {"attention_dropout": 0.1}}, r"model.kwargs.config_overrides: for a pretrained"),
             ({"trust_remote_code": True}, r"model.kwargs.trust_remote_code: for a pretrained folder's own code")]
    for extra, message in cases:
        with pytest.raises(ConfigError, match=message):
            load({"config": LLAMA, **extra})
    with pytest.raises(ConfigError, match=r"model.kwargs.attn_implementation: GPT2LMHeadModel does not support "
                                          r"'flex_attention'"):
        load({"config": {"model_type": "gpt2"}, "attn_implementation": "flex_attention"})
    with pytest.raises(ConfigError, match=r"model.kwargs.config.model_type: 't5' has no causal LM"):
        load({"config": {"model_type": "t5"}})


def test_each_option_reaches_the_model(folder, monkeypatch):
    # Checked on the driver by name and the model's support only: flash attention's package need
    # only import where the model builds (the workers).
    load({"config": LLAMA, "attn_implementation": "flash_attention_2", "torch_dtype": "bfloat16",
          "experts_implementation": "grouped_mm", "gradient_checkpointing": True,
          "gradient_checkpointing_kwargs": {"use_reentrant": True, "preserve_rng_state": False}})
    model = hf.build(config=LLAMA, attn_implementation="eager", torch_dtype="bfloat16")
    assert model.config._attn_implementation == "eager" and model.dtype == torch.bfloat16
    assert hf.build(config=LLAMA).config._attn_implementation == "sdpa"  # transformers' default here
    with pytest.raises(ConfigError, match=r"config_overrides.atention_dropout: LlamaConfig has no attribute"):
        load({"pretrained": str(folder), "config_overrides": {"atention_dropout": 0.1}})
    load({"pretrained": str(folder), "config_overrides": {"attention_dropout": 0.1}, "attn_implementation": "sdpa"})
    # from_pretrained returns a model in eval mode: build trains it (dropout, checkpointing on).
    model = hf.build(pretrained=str(folder), config_overrides={"attention_dropout": 0.1}, dtype="bfloat16")
    assert model.training and model.config.attention_dropout == 0.1 and model.dtype == torch.bfloat16
    # trust_remote_code reaches transformers only when the spec sets it.
    from transformers import AutoModelForCausalLM

    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(dict(kwargs))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    hf.build(pretrained=str(folder))
    hf.build(pretrained=str(folder), trust_remote_code=True)
    assert "trust_remote_code" not in seen[0] and seen[1]["trust_remote_code"] is True


def test_a_folder_with_its_own_code_needs_trust_remote_code(tmp_path, monkeypatch):
    """A local folder whose config.json maps the auto classes to its own modules (a Llama
    subclass here): refused before Ray unless the spec trusts it, then built, built for a
    checkpoint and built empty for export from the folder's class."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))  # where transformers copies the code
    monkeypatch.setattr(sys, "path", list(sys.path))  # it appends that folder
    folder = tmp_path / "custom"
    hf.build(seed=0, config=LLAMA).save_pretrained(folder)
    (folder / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_llama'\n")
    (folder / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_llama", auto_map={"AutoConfig": "configuration_tiny.TinyConfig",
                                                     "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"holds its own modeling code .*set model.kwargs.trust_remote_code: true"):
        load({"pretrained": str(folder)})
    kwargs = {"pretrained": str(folder), "trust_remote_code": True, "attn_implementation": "sdpa"}
    load(kwargs)
    assert type(hf.build(**kwargs)).__name__ == "TinyForCausalLM"
    assert type(hf.without_weights(**kwargs)).__name__ == "TinyForCausalLM"
    assert type(hf.build_empty(**kwargs)).__name__ == "TinyForCausalLM"


def layer_calls(model, ids):
    """(how often each decoder layer's MLP ran in one forward and backward, the loss, the grads)."""
    calls = []  # a pre-hook: a recompute stops (early_stop) once it has the tensors backward needs
    hooks = [layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1)) for layer in model.model.layers]
    loss = hf.loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    loss.backward()
    for hook in hooks:
        hook.remove()
    return len(calls) / len(model.model.layers), loss.item(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_each_layer_with_the_same_gradients(folder, reentrant):
    ids = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    plain = hf.build(seed=1, config=LLAMA, attn_implementation="sdpa")
    options = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
    checkpointed = hf.build(seed=1, config=LLAMA, attn_implementation="sdpa", **options)
    assert checkpointed.is_activation_checkpointing and not checkpointed.config.use_cache
    assert not plain.is_activation_checkpointing
    (once, loss, grads), (twice, loss_gc, grads_gc) = layer_calls(plain, ids), layer_calls(checkpointed, ids)
    assert (once, twice) == (1, 2)  # each layer ran again in the backward pass
    assert loss_gc == loss and all(torch.allclose(a, b, rtol=1e-6, atol=1e-9) for a, b in zip(grads, grads_gc))
    # A world that resizes builds for a checkpoint to fill: it keeps checkpointing; so does a pretrained model.
    assert hf.without_weights(config=LLAMA, **options).is_activation_checkpointing
    assert hf.build(pretrained=str(folder), **options).is_activation_checkpointing


def test_export_builds_the_architecture_whatever_the_training_options(folder):
    """Export builds on the meta device in fp32: the training options do not apply (flash
    attention's package need not import where it runs); config_overrides do (they may change
    the architecture)."""
    from airay.export import HF_FACTORY, build_fp32

    model = build_fp32(HF_FACTORY, {"config": LLAMA, "attn_implementation": "flash_attention_2", "dtype": "bfloat16",
                                    "gradient_checkpointing": True})
    assert model.dtype == torch.float32 and model.device.type == "meta"
    assert not model.is_activation_checkpointing
    model = build_fp32(HF_FACTORY, {"pretrained": str(folder), "config_overrides": {"num_hidden_layers": 1}})
    assert len(model.model.layers) == 1


def _counting_initialisers(monkeypatch) -> list[str]:
    """Every initialiser torch's modules and transformers' `_init_weights` call, counted where it
    writes a parameter (and still run): the list of their names."""
    import torch.nn.init
    import transformers.initialization as hf_init

    calls = []
    for module in (torch.nn.init, hf_init):
        for name in hf_init.TORCH_INIT_FUNCTIONS:
            fn = getattr(module, name, None)
            if fn is None:
                continue

            def counted(tensor, *args, _fn=fn, _name=name, **kwargs):
                if isinstance(tensor, torch.nn.Parameter):
                    calls.append(_name)
                return _fn(tensor, *args, **kwargs)

            monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("tied", [False, True])
def test_a_build_for_a_checkpoint_initialises_nothing_keeps_ties_and_trains_as_the_model(monkeypatch, tied):
    # At stages 0-2 every rank holds the whole model, and `without_weights` (a resize's build)
    # ran transformers' initialisation over all of it (twice: each layer's own, then the
    # model's): about 3 s a rank at 160M parameters here, for weights the load replaces.
    cfg = {**LLAMA, "tie_word_embeddings": tied}
    reference = hf.build(seed=0, config=cfg)
    calls = _counting_initialisers(monkeypatch)
    hf.build(seed=0, config=cfg)
    assert len(calls) > 2 * LLAMA["num_hidden_layers"], calls  # the counters see a usual build's initialisers
    calls.clear()
    model = hf.without_weights(seed=0, config=cfg)
    assert calls == []
    # What the checkpoint does not hold is as a usual build makes it: the ties, the rotary buffers.
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = torch.arange(16).view(1, 16) % LLAMA["vocab_size"]
    for m in (reference, model):  # a step of training: tied weights get both uses' gradients
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    after, expected = model.state_dict(), reference.state_dict()
    assert all(torch.equal(after[k], expected[k]) for k in expected)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss)

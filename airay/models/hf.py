"""Hugging Face `transformers` causal LMs, as they are, trained by airay.

In a job spec:

    model:
      factory: airay.models.hf:build
      kwargs: {config: {model_type: llama, vocab_size: 512, hidden_size: 64, ...}}   # random init
      # or:  {pretrained: /path/to/a/local/model/folder}                           # from_pretrained
      # and: tokenizer: FOLDER (the data's tokenizer, written beside the weights by airay export)
    loss_fn: airay.models.hf:loss

The loss is the model's own (labels = input ids, padding masked with -100 from the attention
mask). Nothing is downloaded: `pretrained` is a local folder (a model saved with
`save_pretrained`). `check_kwargs` runs when the spec is loaded, before Ray starts, so a missing
folder or an unknown model type fails naming the field. Anything else: write your own factory
returning a `PreTrainedModel` and keep `loss` (or your own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


# The keywords `build` takes (model.kwargs). The `from_pretrained`/`from_config` ones that make
# sense for training pass through; anything else is refused before Ray starts, naming the key.
KWARGS = ("config", "pretrained", "dtype", "torch_dtype", "tokenizer", "attn_implementation", "trust_remote_code",
          "config_overrides", "gradient_checkpointing", "gradient_checkpointing_kwargs")
DTYPES = ("float32", "bfloat16")
ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the field when `build(**kwargs)` could not work."""
    config, pretrained = kwargs.get("config"), kwargs.get("pretrained")
    unknown = sorted(set(kwargs) - set(KWARGS) - {"seed"})
    if unknown:
        raise ValueError(f"model.kwargs: unknown {unknown}; airay.models.hf:build takes {', '.join(KWARGS)}")
    if (config is None) == (pretrained is None):
        raise ValueError("model.kwargs: give exactly one of `config` (a transformers config as a mapping, with "
                         "model_type: random init) or `pretrained` (a local folder saved with save_pretrained)")
    if "dtype" in kwargs and "torch_dtype" in kwargs:
        raise ValueError("model.kwargs: give `dtype` or its older name `torch_dtype`, not both")
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", "float32"))
    if dtype not in DTYPES:
        key = "torch_dtype" if "torch_dtype" in kwargs else "dtype"
        raise ValueError(f"model.kwargs.{key}: {dtype!r}: give one of {', '.join(DTYPES)} (mixed precision is "
                         "DeepSpeed's bf16 section: the model's master weights stay fp32)")
    attention = kwargs.get("attn_implementation")
    if attention is not None and attention not in ATTENTION:
        raise ValueError(f"model.kwargs.attn_implementation: {attention!r} is not one of {', '.join(ATTENTION)}")
    for key in ("trust_remote_code", "gradient_checkpointing"):
        if not isinstance(kwargs.get(key, False), bool):
            raise ValueError(f"model.kwargs.{key}: true or false, not {kwargs[key]!r}")
    for key in ("config_overrides", "gradient_checkpointing_kwargs"):
        if not isinstance(kwargs.get(key) or {}, dict):
            raise ValueError(f"model.kwargs.{key}: a mapping, not {kwargs[key]!r}")
    if kwargs.get("gradient_checkpointing_kwargs") and not kwargs.get("gradient_checkpointing"):
        raise ValueError("model.kwargs.gradient_checkpointing_kwargs: set gradient_checkpointing: true to use them")
    if pretrained is not None:
        folder = Path(pretrained)
        if not (folder / "config.json").is_file():
            raise ValueError(f"model.kwargs.pretrained: {pretrained} is not a model folder (no config.json there); "
                             "give a local folder written by save_pretrained (nothing is downloaded)")
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        model_type = dict(config).get("model_type")
        try:
            cfg = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
        except (ValueError, TypeError) as exc:
            raise ValueError(f"model.kwargs.config.model_type: {model_type!r} is not a transformers model type: "
                             f"{str(exc).splitlines()[0]}") from None
        if type(cfg) not in AutoModelForCausalLM._model_mapping:
            raise ValueError(f"model.kwargs.config.model_type: {model_type!r} has no causal LM in transformers")


def _options(dtype: str, torch_dtype: str | None, attn_implementation: str | None,
             trust_remote_code: bool) -> dict[str, Any]:
    """The keywords from_pretrained/from_config get: the dtype (torch_dtype is its older name),
    the attention implementation when given, trust_remote_code only when the spec says so."""
    options: dict[str, Any] = {"dtype": getattr(torch, torch_dtype or dtype)}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    if trust_remote_code:
        options["trust_remote_code"] = True
    return options


def _train_options(model, gradient_checkpointing: bool, gradient_checkpointing_kwargs: dict | None):
    """Gradient checkpointing (activations recomputed in the backward, not kept), non-reentrant by
    default: the form that works under ZeRO-3's parameter hooks; the KV cache off, as training has it."""
    if gradient_checkpointing:
        model.activation_checkpointing_enable(  # transformers 5's name for gradient_checkpointing_enable
            activation_checkpointing_kwargs={"use_reentrant": False, **(gradient_checkpointing_kwargs or {})})
        model.config.use_cache = False
    return model


def build(seed: int = 0, config: dict[str, Any] | None = None, pretrained: str | None = None,
          dtype: str = "float32", tokenizer: str | None = None, torch_dtype: str | None = None,
          attn_implementation: str | None = None, trust_remote_code: bool = False,
          config_overrides: dict[str, Any] | None = None, gradient_checkpointing: bool = False,
          gradient_checkpointing_kwargs: dict[str, Any] | None = None):
    """A transformers causal LM: from `config` (random init from `seed`) or `pretrained`.
    `tokenizer`: the folder of the tokenizer the data was made with; not used to train, written
    beside the weights by `airay export`. `config_overrides`: fields set on the config (a
    pretrained folder's too), e.g. {rope_scaling: ..., attention_dropout: 0.1}."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    options = _options(dtype, torch_dtype, attn_implementation, trust_remote_code)
    if pretrained is not None:
        cfg = config_of(None, pretrained, config_overrides, trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(pretrained, config=cfg, local_files_only=True, **options)
    else:
        model = AutoModelForCausalLM.from_config(config_of(config, None, config_overrides), **options)
    return _train_options(model, gradient_checkpointing, gradient_checkpointing_kwargs)


def without_weights(seed: int = 0, config: dict[str, Any] | None = None, pretrained: str | None = None,
                    dtype: str = "float32", tokenizer: str | None = None, torch_dtype: str | None = None,
                    attn_implementation: str | None = None, trust_remote_code: bool = False,
                    config_overrides: dict[str, Any] | None = None, gradient_checkpointing: bool = False,
                    gradient_checkpointing_kwargs: dict[str, Any] | None = None):
    """`build`'s architecture for a checkpoint to fill (a resize, a resumed run): the pretrained
    folder's weights are not read and nothing is initialised. Under ZeRO-3 (transformers'
    DeepSpeed integration registered, airay.worker.build) the partitions are allocated, not
    filled: transformers 5's from_config initialises a ZeRO-3 model afterwards by gathering
    each module's parameters (`initialize_weights_zero3`), which is skipped here."""
    import transformers.integrations.deepspeed as hf_deepspeed
    from transformers import AutoModelForCausalLM

    initialise = hf_deepspeed.initialize_weights_zero3
    hf_deepspeed.initialize_weights_zero3 = lambda model: None  # imported from here at each call
    try:
        model = AutoModelForCausalLM.from_config(
            config_of(config, pretrained, config_overrides, trust_remote_code),
            **_options(dtype, torch_dtype, attn_implementation, trust_remote_code))
    finally:
        hf_deepspeed.initialize_weights_zero3 = initialise
    return _train_options(model, gradient_checkpointing, gradient_checkpointing_kwargs)


# airay.worker.build: transformers builds these partitioned itself under ZeRO-3.
build.builds_partitioned = True
build.without_weights = without_weights
without_weights.builds_partitioned = True


def build_empty(config: dict[str, Any] | None = None, pretrained: str | None = None,
                config_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False, **_):
    """The model's architecture in fp32 on the meta device: no memory for weights, none read.
    For export, whose weights come from the checkpoint: one copy of the model in memory, not two."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_of(config, pretrained, config_overrides, trust_remote_code),
                                                dtype=torch.float32,
                                                **({"trust_remote_code": True} if trust_remote_code else {}))


def config_of(config: dict[str, Any] | None = None, pretrained: str | None = None,
              config_overrides: dict[str, Any] | None = None, trust_remote_code: bool = False):
    """The transformers config of `build`'s kwargs: the mapping's, or the pretrained folder's,
    with `config_overrides` set on it."""
    from transformers import AutoConfig

    overrides = dict(config_overrides or {})
    if pretrained is not None:
        return AutoConfig.from_pretrained(pretrained, local_files_only=True, **overrides,
                                          **({"trust_remote_code": True} if trust_remote_code else {}))
    return AutoConfig.for_model(config["model_type"],
                                **{**{k: v for k, v in config.items() if k != "model_type"}, **overrides})


def labels_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's labels: the input ids, with padding (attention_mask 0) ignored."""
    labels = batch["input_ids"].long()  # parquet columns arrive as int32
    mask = batch.get("attention_mask")
    if mask is not None:
        labels[mask == 0] = -100
    return labels


def loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own causal-LM loss (it shifts the labels), mean over the micro-batch's tokens."""
    out = model(input_ids=batch["input_ids"].long(), attention_mask=batch.get("attention_mask"), labels=labels_of(batch))
    return out.loss.float()


def synthetic_tokens(sample_id: int, seed: int, vocab_size: int = 512, seq_len: int = 64) -> dict[str, torch.Tensor]:
    """Sample `sample_id`: a learnable token sequence (an arithmetic progression mod vocab) from
    its own RNG, full length (no padding), so every micro-batch's mean is over the same count."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + sample_id)
    start, stride = torch.randint(0, vocab_size, (2,), generator=g).tolist()
    ids = (start + (stride | 1) * torch.arange(seq_len)) % vocab_size
    return {"input_ids": ids, "attention_mask": torch.ones(seq_len, dtype=torch.long),
            "sample_id": torch.tensor(sample_id)}

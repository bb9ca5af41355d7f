"""Hugging Face `transformers` causal LMs, as they are, trained by airay.

In a job spec:

    model:
      factory: airay.models.hf:build
      kwargs: {config: {model_type: llama, vocab_size: 512, hidden_size: 64, ...}}   # random init
      # or:  {pretrained: /path/to/a/local/model/folder}                           # from_pretrained
      # and any of the training options of `Options` below, e.g.
      #   {attn_implementation: sdpa, gradient_checkpointing: true, dtype: bfloat16}
    loss_fn: airay.models.hf:loss

The loss is the model's own (labels = input ids, padding masked with -100 from the attention
mask). Nothing is downloaded: `pretrained` is a local folder (a model saved with
`save_pretrained`). `check_kwargs` runs when the spec is loaded, before Ray starts, so an unknown
key, a missing folder, an unknown model type or an attention the model lacks fails naming the
field. Anything else: write your own factory returning a `PreTrainedModel` and keep `loss` (or
your own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# torch.utils.checkpoint.checkpoint's keywords a spec can write (its context_fn is a function).
CHECKPOINT_KWARGS = ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "early_stop")


class Options(BaseModel):
    """`model.kwargs` of airay.models.hf:build: the `from_pretrained`/`from_config` keywords that
    make sense for training, plus gradient checkpointing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: dict[str, Any] | None = Field(None, description="a transformers config as a mapping, with model_type: "
                                                            "random init from the run's seed")
    pretrained: str | None = Field(None, description="a local folder written by save_pretrained (nothing downloads)")
    tokenizer: str | None = Field(None, description="the folder of the tokenizer the data was made with; not used "
                                                    "to train, written beside the weights by `airay export`")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the weights' dtype (`torch_dtype`, its "
                                                                         "old name, is accepted)")
    attn_implementation: str | None = Field(None, description="eager, sdpa, flex_attention, flash_attention_2...; "
                                                              "default transformers' (sdpa where the model has it)")
    experts_implementation: str | None = Field(None, description="a mixture of experts' kernel (eager, grouped_mm, "
                                                                 "batched_mm...); default transformers'")
    trust_remote_code: bool = Field(False, description="run the pretrained folder's own modeling code (its "
                                                       "config.json has an auto_map); passed only when true")
    config_overrides: dict[str, Any] = Field(default_factory=dict, description="attributes set on the pretrained "
                                                                               "folder's config, e.g. attention_dropout")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                                            "backward pass instead of keeping them (use_cache off)")
    gradient_checkpointing_kwargs: dict[str, Any] = Field(default_factory=dict, description="torch.utils.checkpoint "
                                                          "keywords; use_reentrant defaults to false")


def options(kwargs: dict[str, Any]) -> Options:
    """`kwargs` as Options; ValueError naming each key that is unknown or wrong."""
    kwargs, named = dict(kwargs), {}
    if "torch_dtype" in kwargs:
        if "dtype" in kwargs:
            raise ValueError("model.kwargs: give dtype or torch_dtype (its old name), not both")
        kwargs["dtype"], named["dtype"] = kwargs.pop("torch_dtype"), "torch_dtype"
    unknown = sorted(set(kwargs) - set(Options.model_fields))
    if unknown:
        raise ValueError(f"model.kwargs: unknown {unknown}; airay.models.hf:build takes "
                         f"{', '.join(Options.model_fields)} (torch_dtype: dtype's old name)")
    try:
        return Options(**kwargs)
    except ValidationError as exc:
        raise ValueError("; ".join(f"model.kwargs.{'.'.join(str(named.get(k, k)) for k in e['loc'])}: {e['msg']}"
                                   for e in exc.errors())) from None


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the field when `build(**kwargs)` could not work."""
    opts = options(kwargs)
    if (opts.config is None) == (opts.pretrained is None):
        raise ValueError("model.kwargs: give exactly one of `config` (a transformers config as a mapping, with "
                         "model_type: random init) or `pretrained` (a local folder saved with save_pretrained)")
    if opts.pretrained is not None:
        folder = Path(opts.pretrained)
        if not (folder / "config.json").is_file():
            raise ValueError(f"model.kwargs.pretrained: {opts.pretrained} is not a model folder (no config.json "
                             "there); give a local folder written by save_pretrained (nothing is downloaded)")
        if "auto_map" in json.loads((folder / "config.json").read_text()) and not opts.trust_remote_code:
            raise ValueError(f"model.kwargs.pretrained: {opts.pretrained} holds its own modeling code (config.json "
                             "has an auto_map); set model.kwargs.trust_remote_code: true to run it")
    else:
        if opts.config_overrides:
            raise ValueError("model.kwargs.config_overrides: for a pretrained folder's config; with `config`, write "
                             "the values in it")
        if opts.trust_remote_code:
            raise ValueError("model.kwargs.trust_remote_code: for a pretrained folder's own code; `config` builds a "
                             "transformers model type")
    if opts.gradient_checkpointing_kwargs and not opts.gradient_checkpointing:
        raise ValueError("model.kwargs.gradient_checkpointing_kwargs: set gradient_checkpointing: true to use them")
    unknown = sorted(set(opts.gradient_checkpointing_kwargs) - set(CHECKPOINT_KWARGS))
    if unknown:
        raise ValueError(f"model.kwargs.gradient_checkpointing_kwargs: unknown {unknown}; torch.utils.checkpoint "
                         f"takes {', '.join(CHECKPOINT_KWARGS)}")
    model_class = _checked_class(opts)
    _check_implementations(opts, model_class)


def _checked_class(opts: Options):
    """The causal LM class the options build (None for a folder's own code), its config checked."""
    from transformers import AutoModelForCausalLM

    try:
        cfg = _config(opts.model_copy(update={"config_overrides": {}}))  # the attributes an override may set
    except (ValueError, TypeError, OSError) as exc:
        first = str(exc).splitlines()[0]
        if opts.config is not None:
            raise ValueError(f"model.kwargs.config.model_type: {opts.config.get('model_type')!r} is not a "
                             f"transformers model type: {first}") from None
        raise ValueError(f"model.kwargs.pretrained: {opts.pretrained}: its config does not load: {first}") from None
    for key in opts.config_overrides:
        if not hasattr(cfg, key):
            raise ValueError(f"model.kwargs.config_overrides.{key}: {type(cfg).__name__} has no attribute {key!r}")
    if opts.trust_remote_code and "AutoModelForCausalLM" in (getattr(cfg, "auto_map", None) or {}):
        return None  # the folder's own class: transformers checks it when it builds
    model_class = AutoModelForCausalLM._model_mapping.get(type(cfg), None)
    if model_class is None:
        field = "config.model_type" if opts.config is not None else "pretrained"
        raise ValueError(f"model.kwargs.{field}: {cfg.model_type!r} has no causal LM in transformers")
    return model_class


def _check_implementations(opts: Options, model_class) -> None:
    """attn_implementation and experts_implementation name one transformers has, and one the
    model supports. Whether flash attention's package imports is checked where the model builds
    (the workers, where the GPUs are; the driver may run on a CPU node)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn = opts.attn_implementation
    if attn is not None:
        # paged|...: continuous batching for generation, not training.
        known = ["eager"] + [k for k in ALL_ATTENTION_FUNCTIONS.valid_keys() if not k.startswith("paged|")]
        if attn not in known:
            raise ValueError(f"model.kwargs.attn_implementation: {attn!r} is not one of {', '.join(known)}")
        supports = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}.get(
            attn, "_supports_flash_attn" if attn.startswith("flash_attention") else None)
        if model_class is not None and supports and not getattr(model_class, supports, False):
            raise ValueError(f"model.kwargs.attn_implementation: {model_class.__name__} does not support {attn!r}")
    experts = opts.experts_implementation
    known = ["eager"] + sorted(set(ALL_EXPERTS_FUNCTIONS) | set(ALL_FP8_EXPERTS_FUNCTIONS))
    if experts is not None and experts not in known:
        raise ValueError(f"model.kwargs.experts_implementation: {experts!r} is not one of {', '.join(known)}")


def build(seed: int = 0, **kwargs):
    """A transformers causal LM of `Options(**kwargs)`, in train mode: from `config` (random
    init from `seed`) or `pretrained`."""
    from transformers import AutoModelForCausalLM

    opts = options(kwargs)
    torch.manual_seed(seed)
    if opts.pretrained is not None:
        model = AutoModelForCausalLM.from_pretrained(opts.pretrained, local_files_only=True, config=_config(opts),
                                                     **_load_kwargs(opts))
    else:
        model = AutoModelForCausalLM.from_config(_config(opts), **_load_kwargs(opts))
    return _for_training(model, opts)


def without_weights(seed: int = 0, **kwargs):
    """`build`'s model (its options too: a resized world keeps gradient checkpointing) for a
    checkpoint to fill (a resize, a resumed run): the pretrained folder's weights are not read
    and nothing is initialised. At every stage the model is constructed under transformers'
    `no_init_weights` (torch's initialisers and the model's `init_weights` are no-ops: at stages
    0-2 they filled every parameter twice, about 3 s a rank at 160M parameters here and minutes
    at 7B, at every resize) and its weights are tied after, which `init_weights` also did. Under
    ZeRO-3 (transformers' DeepSpeed integration registered, airay.worker.build) the partitions
    are allocated, not filled: transformers 5's from_config initialises a ZeRO-3 model afterwards
    by gathering each module's parameters (`initialize_weights_zero3`), which is skipped here."""
    import transformers.integrations.deepspeed as hf_deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    opts = options(kwargs)
    initialise = hf_deepspeed.initialize_weights_zero3
    hf_deepspeed.initialize_weights_zero3 = lambda model: None  # imported from here at each call
    try:
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(_config(opts), **_load_kwargs(opts))
    finally:
        hf_deepspeed.initialize_weights_zero3 = initialise
    model.tie_weights(recompute_mapping=False)  # init_weights' other half (ZeRO-3's from_config tied already)
    _init_unsaved_buffers(model)
    return _for_training(model, opts)


def _init_unsaved_buffers(model) -> None:
    """Give the modules that hold non-persistent buffers (rotary frequencies: in no checkpoint,
    so no load fills them) transformers' initialisation; a model may compute them there rather
    than in its constructor. Such modules are small (Llama's rotary embedding has no parameters)."""
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)


# airay.worker.build: transformers builds these partitioned itself under ZeRO-3.
build.builds_partitioned = True
build.without_weights = without_weights
without_weights.builds_partitioned = True


def build_empty(**kwargs):
    """The model's architecture in fp32 on the meta device: no memory for weights, none read.
    For export, whose weights come from the checkpoint: one copy of the model in memory, not two.
    The training options (dtype, attention, checkpointing) are not the folder's: an export on a
    CPU node must not need flash attention's package."""
    from transformers import AutoModelForCausalLM

    opts = options(kwargs)
    remote = {"trust_remote_code": True} if opts.trust_remote_code else {}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(opts), dtype=torch.float32, **remote)


def config_of(**kwargs):
    """The transformers config of `build`'s kwargs: the mapping's, or the pretrained folder's
    with its config_overrides."""
    return _config(options(kwargs))


def _config(opts: Options):
    from transformers import AutoConfig

    if opts.pretrained is None:
        return AutoConfig.for_model(opts.config.get("model_type"),
                                    **{k: v for k, v in opts.config.items() if k != "model_type"})
    remote = {"trust_remote_code": True} if opts.trust_remote_code else {}
    cfg = AutoConfig.from_pretrained(opts.pretrained, local_files_only=True, **remote)
    for key, value in opts.config_overrides.items():
        setattr(cfg, key, value)
    return cfg


def _load_kwargs(opts: Options) -> dict[str, Any]:
    """The keywords from_pretrained and from_config take; trust_remote_code only when the spec
    sets it (transformers then runs the folder's code)."""
    names = ("attn_implementation", "experts_implementation")
    out = {"dtype": getattr(torch, opts.dtype), **{n: getattr(opts, n) for n in names if getattr(opts, n)}}
    if opts.trust_remote_code:
        out["trust_remote_code"] = True
    return out


def _for_training(model, opts: Options):
    # from_pretrained returns the model in eval mode, where dropout and checkpointing are off;
    # DeepSpeed's engine does not change the mode.
    model.train()
    if opts.gradient_checkpointing:
        model.config.use_cache = False  # a cache of keys and values is memory the recompute cannot reuse
        # Non-reentrant unless the spec says otherwise (transformers 5's default, which a spec's
        # kwargs would replace): it needs no input that requires grad. Its recompute calls each
        # module again, so ZeRO-3's hooks gather the partitioned parameters again in the backward.
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False, **opts.gradient_checkpointing_kwargs})
    return model


def labels_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's labels: the input ids, with padding (attention_mask 0) ignored."""
    labels = batch["input_ids"].to(torch.long, copy=True)  # parquet columns arrive as int32; never the ids
    mask = batch.get("attention_mask")
    if mask is not None:
        labels[mask == 0] = -100
    return labels


def loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's own causal-LM loss (it shifts the labels), mean over the micro-batch's tokens.
    A sequence-parallel rank's share (airay.parallel.sequence.shard: labels already shifted, the
    divisor given) through the same loss function of the model's."""
    if "shift_labels" in batch:
        out = model(input_ids=batch["input_ids"].long(), position_ids=batch["position_ids"],
                    labels=batch["shift_labels"], shift_labels=batch["shift_labels"],
                    num_items_in_batch=batch["num_items_in_batch"])
        return out.loss.float()
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

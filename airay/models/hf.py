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


def check_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise ValueError naming the field when `build(**kwargs)` could not work."""
    config, pretrained = kwargs.get("config"), kwargs.get("pretrained")
    unknown = sorted(set(kwargs) - {"config", "pretrained", "dtype", "tokenizer"})
    if unknown:
        raise ValueError(f"model.kwargs: unknown {unknown}; airay.models.hf:build takes config, pretrained, dtype, "
                         "tokenizer")
    if (config is None) == (pretrained is None):
        raise ValueError("model.kwargs: give exactly one of `config` (a transformers config as a mapping, with "
                         "model_type: random init) or `pretrained` (a local folder saved with save_pretrained)")
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
    if kwargs.get("dtype", "float32") not in ("float32", "bfloat16"):
        raise ValueError("model.kwargs.dtype: float32 or bfloat16")


def build(seed: int = 0, config: dict[str, Any] | None = None, pretrained: str | None = None,
          dtype: str = "float32", tokenizer: str | None = None):
    """A transformers causal LM: from `config` (random init from `seed`) or `pretrained`.
    `tokenizer`: the folder of the tokenizer the data was made with; not used to train, written
    beside the weights by `airay export`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    if pretrained is not None:
        return AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True, dtype=torch_dtype)
    return AutoModelForCausalLM.from_config(config_of(config=config), dtype=torch_dtype)


def without_weights(seed: int = 0, config: dict[str, Any] | None = None, pretrained: str | None = None,
                    dtype: str = "float32", tokenizer: str | None = None):
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
        return AutoModelForCausalLM.from_config(config_of(config, pretrained), dtype=getattr(torch, dtype))
    finally:
        hf_deepspeed.initialize_weights_zero3 = initialise


# airay.worker.build: transformers builds these partitioned itself under ZeRO-3.
build.builds_partitioned = True
build.without_weights = without_weights
without_weights.builds_partitioned = True


def build_empty(config: dict[str, Any] | None = None, pretrained: str | None = None, **_):
    """The model's architecture in fp32 on the meta device: no memory for weights, none read.
    For export, whose weights come from the checkpoint: one copy of the model in memory, not two."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config_of(config, pretrained), dtype=torch.float32)


def config_of(config: dict[str, Any] | None = None, pretrained: str | None = None):
    """The transformers config of `build`'s kwargs: the mapping's, or the pretrained folder's."""
    from transformers import AutoConfig

    if pretrained is not None:
        return AutoConfig.from_pretrained(pretrained, local_files_only=True)
    return AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})


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

"""`airay export CHECKPOINT --hf OUT_DIR`: a checkpoint's weights as a Hugging Face model folder.

CHECKPOINT is a step directory of the durable tier (RUN_DIR/checkpoints/step_NNNNNNNN, or under
checkpoint.path) or a run directory (its newest durable step). The weights are consolidated from
the shards as they are on disk, whatever the world size that wrote them (ZeRO 1-3: DeepSpeed's
zero_to_fp32 reads the fp32 master partitions; stage 0: the module's own state), on the CPU,
without the training world. The model comes from the run's spec (its config.yaml, or --config):
its `model.factory` builds it again (`airay.models.hf:build` from its config or pretrained
folder, in fp32; a factory of your own as it builds it, then cast to fp32), it must be a
transformers `PreTrainedModel`, it is loaded with the consolidated weights and written with
`save_pretrained` (safetensors + config.json), plus the tokenizer when the spec names one
(`model.kwargs.tokenizer`, or a pretrained folder's).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

HF_FACTORY = "airay.models.hf:build"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


def resolve(checkpoint: str | Path, config: str | Path | None = None) -> tuple[Path, Path]:
    """(the step directory, the run's config.yaml) of what the user named."""
    from airay.checkpoint.layout import MANIFEST
    from airay.checkpoint.tiers import DurableTier
    from airay.config import JobConfig

    path = Path(checkpoint)
    if (path / "config.yaml").is_file() and not (path / MANIFEST).is_file():  # a run directory
        root = JobConfig.from_yaml(path / "config.yaml").checkpoint.path or path / "checkpoints"
        if "://" not in str(root) and not Path(root).is_dir():
            raise FileNotFoundError(f"{path} has no durable checkpoints ({root} does not exist)")
        complete = DurableTier(str(root), {}).complete()  # newest first, every file at its size
        if not complete:
            raise FileNotFoundError(f"{path} has no complete durable checkpoint in {root}")
        path = Path(complete[0].path)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint step (no {MANIFEST}); give "
                                "RUN_DIR/checkpoints/step_NNNNNNNN or a run directory")
    found = Path(config) if config else next((p / "config.yaml" for p in path.parents if (p / "config.yaml").is_file()),
                                             None)
    if found is None or not found.is_file():
        raise FileNotFoundError(f"no config.yaml above {path}: pass --config RUN_DIR/config.yaml (the run's spec)")
    return path, found


def consolidated_state(step_dir: Path, full_shapes: dict[str, tuple] | None = None) -> dict[str, Any]:
    """The full fp32 state dict of a checkpoint step, read from its shards on the CPU. A
    tensor-parallel checkpoint's slices are consolidated one by one, then joined
    (merge_tensor_parallel: `full_shapes`, the whole model's, say where each was cut)."""
    from airay.checkpoint.layout import Manifest, MANIFEST

    manifest = Manifest.from_json((step_dir / MANIFEST).read_text())
    if manifest.model_parallel == 1:
        return _slice_state(step_dir, manifest.zero_stage)
    if full_shapes is None:
        raise ValueError(f"{step_dir} holds {manifest.model_parallel} tensor-parallel slices: give the whole "
                         "model's shapes to join them")
    import tempfile

    from airay.checkpoint import reshard

    slices = []
    for m in range(manifest.model_parallel):
        # DeepSpeed's consolidation reads one slice's files under slice 0's names: link them so.
        with tempfile.TemporaryDirectory(prefix="airay-export-") as tmp:
            view = Path(tmp) / step_dir.name
            view.mkdir()
            for name in manifest.files:
                if f"mp_rank_{m:02d}" in name:
                    (view / name.replace(f"mp_rank_{m:02d}", "mp_rank_00")).symlink_to((step_dir / name).resolve())
            if not (view / reshard.MODEL_FILE).is_file():
                raise FileNotFoundError(f"{step_dir} has no {reshard.model_file(m)}: not a complete checkpoint")
            slices.append(_slice_state(view, manifest.zero_stage))
    return merge_tensor_parallel(slices, full_shapes)


def _slice_state(step_dir: Path, zero_stage: int) -> dict[str, Any]:
    import torch

    if zero_stage == 0:
        from airay.checkpoint.reshard import MODEL_FILE

        return torch.load(step_dir / MODEL_FILE, map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from airay.worker.deepspeed_compat import zero3_consolidation_shapes

    with zero3_consolidation_shapes():
        return get_fp32_state_dict_from_zero_checkpoint(str(step_dir.parent), tag=step_dir.name)


def merge_tensor_parallel(slices: list[dict[str, Any]], full_shapes: dict[str, tuple]) -> dict[str, Any]:
    """One state dict from tensor-parallel slices (in slice order): a tensor whose slices have the
    whole model's shape was replicated (slice 0's is taken); one cut along a dimension
    (DeepSpeed AutoTP: column-parallel layers along the output, row-parallel along the input,
    a vocabulary along its rows) is joined back along it. A tensor that fits neither names itself."""
    import torch

    out = {}
    for key, first in slices[0].items():
        parts = [s[key] for s in slices]
        full = tuple(full_shapes.get(key, first.shape))
        if all(tuple(p.shape) == full for p in parts):
            out[key] = first
            continue
        cut = [d for d in range(first.dim()) if first.shape[d] != full[d]]
        joined = torch.cat(parts, dim=cut[0]) if len(cut) == 1 else None
        if joined is None or tuple(joined.shape) != full:
            raise ValueError(f"tensor-parallel slices of {key} ({[tuple(p.shape) for p in parts]}) do not make its "
                             f"shape in the model {full}")
        out[key] = joined
    return out


def export_hf(checkpoint: str | Path, out_dir: str | Path, dtype: str = "float32",
              config: str | Path | None = None) -> Path:
    """Write the checkpoint as a Hugging Face model folder; returns it."""
    from airay.config import JobConfig

    step_dir, config_file = resolve(checkpoint, config)
    spec = JobConfig.from_yaml(config_file)
    return export_step(step_dir, out_dir, spec.model.factory, spec.model.kwargs, spec.seed, dtype)


def build_fp32(factory: str, model_kwargs: dict[str, Any], seed: int = 0):
    """The spec's model in fp32, checked to be one `save_pretrained` can write. airay's own
    factory's is built empty (on the meta device, airay.models.hf.build_empty): the checkpoint's
    weights are assigned to it, so export holds the model once, not a random init beside it."""
    from transformers import PreTrainedModel

    from airay.config import resolve_callable
    from airay.models import hf

    if factory == HF_FACTORY:
        model = hf.build_empty(**model_kwargs)
    else:
        model = resolve_callable(factory)(seed=seed, **model_kwargs)
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"model.factory {factory} builds a {type(model).__name__}, not a transformers "
                         f"PreTrainedModel: a Hugging Face folder holds transformers models only (use {HF_FACTORY}, "
                         "or a factory of your own that returns a PreTrainedModel)")
    return model.float()


def export_step(step_dir: str | Path, out_dir: str | Path, factory: str, model_kwargs: dict[str, Any],
                seed: int = 0, dtype: str = "float32") -> Path:
    """export_hf's work, given the spec's model (what a run's end hands a task on a worker node,
    checkpoint.export_hf)."""
    import torch

    step_dir = Path(step_dir)
    model = build_fp32(factory, model_kwargs, seed)
    state = consolidated_state(step_dir, {k: tuple(t.shape) for k, t in model.state_dict().items()})
    _, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()  # assigning replaced the parameters: tie them again where the config ties them
    # What save_pretrained writes must be the checkpoint's tensors (a tied one shares a loaded
    # tensor): anything else is still empty (meta) or a fresh init.
    loaded = {t.data_ptr() for t in state.values()}
    missing = sorted(k for k, t in model.state_dict().items() if t.data_ptr() not in loaded)
    if unexpected or missing:
        raise ValueError(f"{step_dir}: the checkpoint does not match the spec's model: missing "
                         f"{missing[:5]}, unexpected {sorted(unexpected)[:5]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    tokenizer = model_kwargs.get("tokenizer") or model_kwargs.get("pretrained")
    if tokenizer:
        if not (Path(tokenizer) / "tokenizer_config.json").is_file():
            raise FileNotFoundError(f"model.kwargs.tokenizer: {tokenizer} is not a tokenizer folder (no "
                                    f"tokenizer_config.json); the weights are in {out}, without a tokenizer")
        for name in TOKENIZER_FILES:
            if (Path(tokenizer) / name).is_file():
                shutil.copy2(Path(tokenizer) / name, out / name)
    return out

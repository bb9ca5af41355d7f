"""Building a rank's DeepSpeed engine for a world's batch plan, and one micro-batch's update.

The same two calls serve airay's workers and the benchmarks' plain-DeepSpeed baselines, so both
sides train the same way.
"""

from __future__ import annotations

import copy
from typing import Any

from airay.policy import BatchPlan
from airay.worker.deepspeed_compat import mark_universal_checkpoint_info


def engine_config(base: dict[str, Any], plan: BatchPlan, on_cpu: bool, load_universal: bool) -> dict[str, Any]:
    cfg = copy.deepcopy(base)
    cfg.update(plan.deepspeed_fields())
    opt = cfg.get("optimizer")
    if on_cpu and opt and opt.get("type", "").lower() in ("adam", "adamw"):
        # FusedAdam needs CUDA; torch's Adam is the same algorithm and runs anywhere.
        opt.setdefault("params", {}).setdefault("torch_adam", True)
    cfg.setdefault("steps_per_print", 10**9)
    cfg.setdefault("wall_clock_breakdown", False)
    cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": load_universal}
    return cfg


def build_engine(model, base_config: dict[str, Any], plan: BatchPlan, device: str, load_universal: bool = False):
    """A DeepSpeed engine of `model` on `device` for `plan` (the process group is already up).
    A model built partitioned (airay.worker.build) is already on its device: moving it would
    move nothing but the empty tensors that stand for its parameters."""
    import deepspeed

    from airay.worker.build import is_partitioned

    mark_universal_checkpoint_info(model)
    cfg = engine_config(base_config, plan, device == "cpu", load_universal)
    if not is_partitioned(model):
        model = model.to(device)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg, dist_init_required=False)
    return engine


def backward_micro_batch(engine, loss, samples: int, plan: BatchPlan) -> None:
    """Backward and (at the accumulation boundary) optimizer step for one micro-batch of
    `samples` samples whose mean loss is `loss`, weighted so the step's update is the exact
    mean over the global batch whatever this rank's share (BatchPlan.loss_scale)."""
    scale = plan.loss_scale(samples)
    engine.backward(loss if scale == 1.0 else loss * scale)
    engine.step()

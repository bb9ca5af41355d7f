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
    # DeepSpeed checks that every rank saves under the same tag (two all-reduces in each save);
    # airay's driver names every rank's tag (the step), so it is off unless the spec sets it.
    cfg["checkpoint"] = {"tag_validation": "Ignore", **cfg.get("checkpoint", {}), "load_universal": load_universal}
    return cfg


# DeepSpeed's defaults (0.19, runtime/zero/config.py) and their names in a config.
_ZERO3_MEMORY_KEYS = {"reduce_bucket_size": ("reduce_bucket_size",),
                      "stage3_prefetch_bucket_size": ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
                      "stage3_max_live_parameters": ("stage3_max_live_parameters", "max_live_parameters"),
                      "stage3_max_reuse_distance": ("stage3_max_reuse_distance", "max_reuse_distance")}
_DEEPSPEED_MAX = 5e8  # its reduce bucket; its live-parameter and reuse limits are 1e9


def zero3_memory_defaults(zero: dict[str, Any], largest_param: int) -> dict[str, int]:
    """ZeRO-3's bucket and gather limits for this model, where the spec leaves them unset.

    DeepSpeed's defaults are sized for big GPUs whatever the model: every rank allocates a
    5e8-element reduce bucket when the engine is built (2 GB in fp32), and keeps up to 1e9
    gathered elements live (a 300M-parameter model stays whole on every rank after its first
    forward). Here they follow the model's largest parameter, as transformers' "auto" values
    follow hidden_size squared: a bucket holds the largest parameter (at least 1e6 elements),
    prefetch 0.9 of it, live parameters and reuse distance three of it, never above
    DeepSpeed's own. The limits move no number: the same reductions, in smaller pieces."""
    bucket = int(min(_DEEPSPEED_MAX, max(1e6, largest_param)))
    wanted = {"reduce_bucket_size": bucket, "stage3_prefetch_bucket_size": int(0.9 * bucket),
              "stage3_max_live_parameters": int(min(1e9, 3 * bucket)),
              "stage3_max_reuse_distance": int(min(1e9, 3 * bucket))}
    return {k: v for k, v in wanted.items() if not any(name in zero for name in _ZERO3_MEMORY_KEYS[k])}


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
    elif cfg.get("zero_optimization", {}).get("stage") == 3:
        zero = cfg["zero_optimization"]
        zero.update(zero3_memory_defaults(zero, max(int(p.ds_numel) for p in model.parameters())))
    from airay.worker.deepspeed_compat import grad_hooks_without_gathering, sequence_parallel_mpu, tensor_parallel_mpu

    mpu = tensor_parallel_mpu(cfg) or sequence_parallel_mpu(model, cfg, plan.micro_batch_size)
    with grad_hooks_without_gathering():
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                          dist_init_required=False, mpu=mpu)
    return engine


def drop_engine(engine) -> None:
    """Destroy `engine` so that its state can go: a process that builds an engine per world must
    not keep the one before (ZeRO-3's module stack would: deepspeed_compat.release_zero3_modules).
    What is left is reference cycles (hooks, the checkpoint engine's fences): drop your own
    references, then gc.collect(), so the memory is back before the next engine is built."""
    from airay.worker.deepspeed_compat import release_zero3_modules

    try:
        engine.destroy()
    finally:
        release_zero3_modules()


def backward_micro_batch(engine, loss, samples: int, plan: BatchPlan) -> None:
    """Backward and (at the accumulation boundary) optimizer step for one micro-batch of
    `samples` samples whose mean loss is `loss`, weighted so the step's update is the exact
    mean over the global batch whatever this rank's share (BatchPlan.loss_scale)."""
    scale = plan.loss_scale(samples)
    engine.backward(loss if scale == 1.0 else loss * scale)
    engine.step()

"""Building a rank's model so that no rank ever holds the whole of it (ZeRO-3).

Under ZeRO-3 the factory runs inside `deepspeed.zero.Init`: each submodule's parameters are
partitioned over the world as soon as that submodule's constructor returns, so a rank holds its
partition of the model plus the one layer being built (a 70B model on 64 ranks: about 2 GB of
bf16 partition per rank instead of 140 GB). Hugging Face models are built through transformers'
own DeepSpeed integration (`HfDeepSpeedConfig` registered for the engine's life): `from_config`
and `from_pretrained` then use zero.Init themselves, and `from_pretrained` copies the shards'
tensors into the partitions.

A factory of its own that builds a transformers model declares it (`factory.builds_partitioned =
True`): transformers then partitions it, not an outer zero.Init (see build_model for why).

A rank whose weights a checkpoint is about to overwrite (a resize, a resumed run) builds the
architecture without initialising it: the factory's `without_weights` when it has one (a factory
that reads pretrained weights should: airay.models.hf does), otherwise the factory with torch's
in-place initialisers turned into no-ops; under ZeRO-3, zero.Init then keeps each rank's slice
as built instead of broadcasting rank 0's whole parameter first (a model's worth of traffic per
rank, for values the checkpoint replaces). Stages 0-2 keep the whole model on every rank (their
parameters are replicated), built the same way: no random initialisation either (at 101M
parameters about a second of a survivor's resize here; at 7B, minutes of CPU per rank), and the
load fills every weight (a ZeRO-1/2 load from the fp32 masters: airay.checkpoint.loading).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

# torch.nn.init's in-place initialisers: the calls every torch module's reset_parameters makes
# (looked up on the module at call time, so replacing them here reaches every layer).
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


@contextlib.contextmanager
def no_weight_init():
    """torch.nn.init's initialisers leave tensors as they are (allocated, not filled): for a
    model whose every parameter a checkpoint load overwrites. Process-wide while it lasts: the
    actor builds on its one training thread."""
    import torch.nn.init as init

    saved = {name: getattr(init, name) for name in _INITIALISERS if hasattr(init, name)}
    try:
        for name in saved:
            setattr(init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


def _keep(tensor, *args, **kwargs):
    return tensor


# glibc keeps the blocks a process frees below its mmap threshold (dynamic: raised to each mapped
# block freed, up to 32 MiB) in its heap: each layer's full parameters, freed once zero.Init has
# partitioned them, leave holes that the partitions allocated after them pin, so a build's peak
# RSS grew with what the process had freed rather than with what it holds (0.48-0.67 of the
# model's bytes at 101M on 4 ranks, whose partition is 0.25: benchmarks/zero3_malloc.py). Handing
# the free pages back each time this many bytes of such parameters have been freed keeps the peak
# near the partitions plus a layer; 0 turns it off. Tensors of 32 MiB and more are mapped and
# unmapped by glibc itself: they do not count.
TRIM_EVERY_BYTES = 4 << 20
_HEAP_MAX_BLOCK = 32 << 20  # glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)


@contextlib.contextmanager
def trimming_heap(every_bytes: int):
    """While a ZeRO-3 build runs: the C heap's free pages go back to the OS (airay.worker.memory.trim_heap)
    each time `every_bytes` of host parameters small enough for the heap have been partitioned
    away, and once at the end."""
    if not every_bytes:
        yield
        return
    from airay.worker.deepspeed_compat import after_each_partition
    from airay.worker.memory import trim_heap

    freed = 0

    def partitioned_one(module) -> None:
        nonlocal freed
        for p in module.parameters(recurse=False):
            part = getattr(p, "ds_tensor", None)
            if part is not None and part.device.type == "cpu" and p.ds_numel * part.element_size() < _HEAP_MAX_BLOCK:
                freed += (p.ds_numel - part.numel()) * part.element_size()
        if freed >= every_bytes:
            trim_heap()
            freed = 0

    with after_each_partition(partitioned_one):
        yield
    trim_heap()


def partitioned(ds_config: dict[str, Any]) -> bool:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0)) == 3


def hf_zero3(ds_config: dict[str, Any]):
    """Register `ds_config` with transformers' DeepSpeed integration (a ZeRO-3 config makes
    `from_config`/`from_pretrained` build under zero.Init); returns the object to keep alive
    while the engine lives (transformers holds it by weak reference)."""
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(ds_config)


def build_model(factory: Callable[..., Any], kwargs: dict[str, Any], seed: int, ds_config: dict[str, Any], *,
                init_weights: bool = True, call: Callable[..., Any] | None = None):
    """The model of `factory(seed=seed, **kwargs)` for an engine of `ds_config` (resolved for
    this world: airay.worker.engine.engine_config). ZeRO-3: built partitioned (module
    docstring). `init_weights` False: a checkpoint will overwrite every weight. `call` runs the
    user's code (the actor's: its errors carry the rank and traceback)."""
    call = call or (lambda fn, *a, **k: fn(*a, **k))
    without = getattr(factory, "without_weights", None)
    if not init_weights and without is not None:
        build, context = without, contextlib.nullcontext()
    else:
        build, context = factory, (contextlib.nullcontext() if init_weights else no_weight_init())
    if not partitioned(ds_config):
        with context:
            return call(build, seed=seed, **kwargs)
    import deepspeed

    from airay.worker.deepspeed_compat import preload_for_zero_init, zero_init_without_broadcast

    preload_for_zero_init()
    # A factory that builds through transformers partitions itself (hf_zero3); a second zero.Init
    # around it would be a no-op (DeepSpeed counts nested contexts), but keep the one owner clear.
    marked = getattr(build, "builds_partitioned", False)
    zero_init = contextlib.nullcontext() if marked else deepspeed.zero.Init(config_dict_or_path=ds_config)
    # Weights a checkpoint overwrites need not agree between ranks: no broadcast of rank 0's.
    unsynced = contextlib.nullcontext() if init_weights else zero_init_without_broadcast()
    with context, unsynced, trimming_heap(TRIM_EVERY_BYTES), zero_init:
        model = call(build, seed=seed, **kwargs)
    if not marked and _from_transformers(model):
        # A transformers model class first imported inside zero.Init loses, when the context
        # exits, what decorators did to its __init__ after DeepSpeed wrapped it (deepspeed 0.19
        # restores the class body's __init__; transformers' kernel hooks then fail in forward at
        # the next build). transformers builds partitioned itself, with its own zero.Init.
        raise TypeError(f"model.factory {getattr(factory, '__qualname__', factory)} returns a transformers model "
                        f"({type(model).__name__}): under ZeRO-3 transformers builds it partitioned itself. Mark the "
                        "factory with `builds_partitioned = True` (an attribute of the function), or use "
                        "airay.models.hf:build")
    return model


def _from_transformers(model) -> bool:
    import sys

    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def is_partitioned(model) -> bool:
    """Whether `model`'s parameters are ZeRO-3 partitions (built under zero.Init)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())

"""Private DeepSpeed details airay depends on, each with the version it was written for (0.19).

Pinned in pyproject.toml (deepspeed>=0.19,<0.20): a DeepSpeed upgrade re-checks this file.
"""

from __future__ import annotations

import contextlib


def import_deepspeed():
    """Import DeepSpeed without the work its import and first engine do for features airay does
    not use, in every rank's process (one process to its first step of benchmarks.startup's job
    here: 4.7 CPU-s with a plain import, 3.0 this way: benchmarks/startup.py's floor):

    - deepspeed.runtime.config imports deepspeed.autotuning, whose autotuner runs `import mlflow`
      whenever MLflow is installed (airay[mlflow] installs it), for a tuner only DeepSpeed's
      launcher runs. While DeepSpeed is imported, `import mlflow` fails (a None in sys.modules),
      so the autotuner records has_mlflow = False; afterwards MLflow imports as usual. A process
      that has MLflow imported already gains nothing and loses nothing.
    - every ZeRO optimizer imports DeepSpeed's Muon module to ask whether its optimizer is Muon,
      and that module's `@compiler.compile()` functions make torch.compile resolve its backend
      when they are defined (importing torch._inductor); see compile_at_first_call.
    - torch.optim's and DeepSpeed's dynamo-disabling wrappers import torch._dynamo at their first
      call (an optimizer's constructor, ZeRO-3's hooks): 2-3 CPU-s a process for a compiler
      nothing here runs; see airay.worker.torch_compat.defer_dynamo.
    """
    import sys

    from airay.worker.torch_compat import defer_dynamo

    defer_dynamo()  # before DeepSpeed's import: the wrappers it makes then are deferred too

    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed
    else:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
        try:
            import deepspeed
        finally:
            if sys.modules.get("mlflow", 0) is None:
                del sys.modules["mlflow"]
    from deepspeed.runtime import compiler

    compiler.compile = compile_at_first_call
    return deepspeed


def compile_at_first_call():
    """deepspeed.runtime.compiler.compile() (deepspeed 0.19: the decorator its Muon kernels are
    defined with), with torch.compile applied at the function's first call instead of at its
    definition: the same compiled function for a run that uses Muon, nothing for one that
    only imports the module. Traced from inside another compiled function, it is inlined, as a
    torch.compile'd function is."""
    import functools

    import torch

    def decorate(fn):
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            if compiled is None:
                compiled = torch.compile(fn)
            return compiled(*args, **kwargs)

        return call

    return decorate


def reset_zero3_globals() -> None:
    # ZeRO-3 numbers parameters and modules from process-wide counters (deepspeed 0.19:
    # zero.Init.param_id, and the mutable default `count=[0]` of
    # DeepSpeedZeRoOffload._register_deepspeed_module) and checks that all ranks agree on the
    # ids of its prefetch trace. A warm worker building its second engine would count on from
    # where its first stopped while a fresh worker starts at 0, so every build starts afresh.
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = 0
    Init.num_persisted_parameters = 0
    Init.num_persisted_elements = 0
    module_count = DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0]
    module_count[0] = 0


def release_zero3_modules() -> None:
    # ZeRO-3's forward hooks push each module on a process-wide stack (deepspeed 0.19:
    # parameter_offload.FWD_MODULE_STACK) and the outermost module stays there after a step; it
    # reaches every parameter and, through them, the optimizer, so a dropped engine's whole state
    # (parameters, master weights, moments) would stay allocated: at every resize, another
    # engine's worth of memory per rank. Cleared when an engine is dropped, before the next build.
    # And PartitionedParameterCoordinator.__params_to_release is a method under an unbounded
    # functools.lru_cache, whose keys hold every coordinator it was called on (each with its
    # module's parameters, so again the whole engine): after two resizes a survivor of a 101M
    # ZeRO-3 run held both engines before its own, 1.1 GiB more than a fresh rank of the same world.
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    parameter_offload.FWD_MODULE_STACK.clear()
    cached = _lru_cache_of(vars(PartitionedParameterCoordinator).get(
        "_PartitionedParameterCoordinator__params_to_release"))
    if cached is None:
        raise RuntimeError("deepspeed_compat: PartitionedParameterCoordinator.__params_to_release is no longer a "
                           "cached method; re-check release_zero3_modules for this DeepSpeed version")
    cached.cache_clear()


def _lru_cache_of(fn, depth: int = 3):
    """The functools.lru_cache wrapper inside `fn`, through decorators that wrap it (by
    __wrapped__ or a closure, as DeepSpeed's instrument_w_nvtx does); None if there is none."""
    if fn is None or depth < 0:
        return None
    if hasattr(fn, "cache_clear"):
        return fn
    inner = [getattr(fn, "__wrapped__", None)] + [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
    return next((found for f in inner if callable(f) and (found := _lru_cache_of(f, depth - 1)) is not None), None)


def disable_cpu_shm_comm() -> None:
    # DeepSpeed (0.19) JIT-compiles a shared-memory all-reduce for CPU worlds on first init
    # (~30 s of C++ build per fresh machine) and keys its buffers by rank, which collides when
    # ranks on one host are re-numbered by a resize. The training path does not use it (ZeRO's
    # collectives go through torch.distributed), so mark the op unavailable.
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def mark_universal_checkpoint_info(model) -> None:
    # DeepSpeed's universal-checkpoint converter (ds_to_universal) asks for this marker on the module.
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY, \
        UNIVERSAL_CHECKPOINT_VERSION_VALUE

    setattr(model, UNIVERSAL_CHECKPOINT_INFO, {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE})


def zero3_consolidation_shapes():
    """deepspeed 0.19's zero_to_fp32 calls `.numel()` on ZeRO-3 parameter shapes, which ZeRO-3
    records as tuples (its ZeRO-1/2 path handles both): a context in which the model states it
    parses carry torch.Size shapes (airay.export)."""
    import torch
    from deepspeed.utils import zero_to_fp32

    original = zero_to_fp32.parse_model_states

    def sized(shapes):
        if isinstance(shapes, dict):
            return {k: torch.Size(v) for k, v in shapes.items()}
        return [sized(s) for s in shapes] if shapes is not None else None

    def parse(files):
        states = original(files)
        for s in states:
            s.param_shapes = sized(s.param_shapes)
            s.frozen_param_shapes = sized(s.frozen_param_shapes)
        return states

    @contextlib.contextmanager
    def patched():
        zero_to_fp32.parse_model_states = parse
        try:
            yield
        finally:
            zero_to_fp32.parse_model_states = original

    return patched()


def preload_for_zero_init() -> None:
    # zero.Init (deepspeed 0.19) replaces torch.Tensor.__new__ while it is active; torch 2.13's
    # dynamo checks, when first imported, that its polyfill of Tensor.__new__ has the original's
    # signature, and fails ("Signature mismatch ... tensor_pynew"). Model code that imports it
    # lazily (transformers' masking utilities, through a model class resolved inside a user's
    # factory) would fail inside zero.Init: import it before.
    import torch._dynamo  # noqa: F401


@contextlib.contextmanager
def after_each_partition(callback):
    """While the block runs, `callback(module)` after zero.Init has partitioned each module's own
    parameters (deepspeed 0.19: Init._post_init_method, which every module's __init__ ends with
    under zero.Init, transformers' own zero.Init included)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._post_init_method

    def post_init(self, module):
        original(self, module)
        callback(module)

    Init._post_init_method = post_init
    try:
        yield
    finally:
        Init._post_init_method = original


@contextlib.contextmanager
def zero_init_without_broadcast():
    """While the block runs, zero.Init keeps each rank's own slice of a parameter as it was built,
    without first broadcasting rank 0's copy of the whole parameter (deepspeed 0.19:
    Init._zero_init_param broadcasts every parameter, then partitions it). For builds whose every
    weight a checkpoint then overwrites (a resize's reload): the broadcast would move the whole
    model to every rank, one parameter at a time, for values nobody reads (140 GB a rank at 70B
    in bf16)."""
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init._zero_init_param

    def partition_only(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        Init._zero_init_param = original


@contextlib.contextmanager
def grad_hooks_without_gathering():
    """While the block runs, ZeRO-3's optimizer registers its gradient hooks without gathering
    each parameter whole and partitioning it again (deepspeed 0.19:
    create_reduce_and_remove_grad_hooks; with torch >= 2.1 the hook is the parameter's
    post-accumulate-grad hook, which needs no data). Every engine build, at start and at each
    resize, gathered the whole model that way, one parameter at a time. A parameter already
    partitioned is left as it is (gathering then partitioning it ends in the same state); one
    available (gathered) is handled as DeepSpeed does. Not with hpZ (ZeRO++'s secondary
    partitions are made when a parameter is partitioned)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.utils.torch import required_torch_version

    original = DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks

    def create_hooks(self):
        if self.zero_hpz_partition_size > 1 or not required_torch_version(min_version=2.1):
            return original(self)
        left = [p for group in self.fp16_groups for p in group
                if p.requires_grad and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        for p in left:  # instance attributes, as DeepSpeed set them (_convert_to_deepspeed_param)
            p.__dict__["_airay_kept"] = (p.all_gather, p.partition)
            p.all_gather = p.partition = _nothing
        try:
            return original(self)
        finally:
            for p in left:
                p.all_gather, p.partition = p.__dict__.pop("_airay_kept")

    DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks = create_hooks
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks = original


@contextlib.contextmanager
def save_keeping_gathered(engine):
    """While the block runs (a save_checkpoint), ZeRO-3's parameters kept gathered between steps
    (the persistent ones, under `param_persistence_threshold`) get their gathered tensors back
    after the save instead of being gathered again (deepspeed 0.19: checkpoint_event_prologue
    partitions every parameter, so the module's state dict holds none whole, and
    checkpoint_event_epilogue all-gathers the persistent ones, one collective each). A save
    changes no parameter, so the tensors it had are the ones a gather would make; the files are
    the same. At 101M parameters on 3 gloo ranks the save call took 0.174 s with that gather (67
    all-gathers) and 0.026 s without (benchmarks/zero3_resize.py). Not with hpZ (its secondary
    partitions are rebuilt then)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    optimizer = getattr(engine, "optimizer", None)
    if getattr(optimizer, "persistent_parameters", None) is None or optimizer.zero_hpz_partition_size > 1:
        yield
        return
    kept: list = []

    def prologue():
        kept.extend((p, p.data) for p in optimizer.persistent_parameters if p.ds_status == ZeroParamStatus.AVAILABLE)
        type(optimizer).checkpoint_event_prologue(optimizer)

    def epilogue():
        for p, data in kept:
            p.data, p.ds_status = data, ZeroParamStatus.AVAILABLE
        kept.clear()
        type(optimizer).checkpoint_event_epilogue(optimizer)  # gathers only those not given back

    optimizer.checkpoint_event_prologue, optimizer.checkpoint_event_epilogue = prologue, epilogue
    try:
        yield
    finally:
        del optimizer.checkpoint_event_prologue, optimizer.checkpoint_event_epilogue
        for p, data in kept:  # the save failed between the two: as the epilogue would
            p.data, p.ds_status = data, ZeroParamStatus.AVAILABLE


def _nothing(*args, **kwargs):
    return None


def tensor_parallel_mpu(ds_config: dict):
    """DeepSpeed's own model-parallel unit for an AutoTP engine (`tensor_parallel.autotp_size` > 1),
    its groups made over the world now (tensor-parallel ranks consecutive, as
    airay.parallel.layout numbers them); None without tensor parallelism. Handed to
    deepspeed.initialize, so its batch check counts data-parallel replicas, not ranks
    (deepspeed 0.19: DeepSpeedConfig counts every rank when no mpu is given)."""
    from airay.parallel.layout import deepspeed_sizes

    tp = int(deepspeed_sizes(ds_config)[0])
    if tp <= 1:
        return None
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    return groups


def release_parallel_groups() -> None:
    """Forget DeepSpeed's process-wide tensor/data-parallel groups of a world this process left:
    deepspeed 0.19 makes them once (`_init_tp_mesh_device` returns early while they are set), so
    a warm worker's next world would reuse the dead world's groups. Its own destroy_process_group
    clears them; torch's, the fallback for a broken world, does not."""
    from deepspeed.utils import groups

    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
    else:  # older DeepSpeed: the globals themselves
        groups._TENSOR_MODEL_PARALLEL_GROUP = groups._MODEL_PARALLEL_GROUP = groups._DATA_PARALLEL_GROUP = None


_CORE_ATTENTION: dict[str, object] = {}  # transformers' own attention functions, before Ulysses wrapped them


def sequence_parallel_mpu(model, ds_config: dict, micro_batch_size: int):
    """DeepSpeed Ulysses for a transformers model (`sequence_parallel_size` > 1): its sequence
    groups made over the world now, the model's attention wrapped to all-to-all over them
    (UlyssesSPAttentionHF); returns the mpu for deepspeed.initialize, None without it.
    deepspeed 0.19 wraps the attention in transformers' process-wide table, taking what is
    there as the core: at a warm worker's next world that would be the last world's wrapper
    (its groups destroyed), so the core is put back first."""
    from airay.parallel.layout import deepspeed_sizes

    sp = int(deepspeed_sizes(ds_config)[1])
    if sp <= 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if core is None:
        raise TypeError(f"deepspeed.sequence_parallel_size {sp} needs a transformers model (Ulysses wraps its "
                        f"attention); model.factory built a {type(model).__name__}")
    if core in _CORE_ATTENTION:
        ALL_ATTENTION_FUNCTIONS[core] = _CORE_ATTENTION[core]
    elif core in ALL_ATTENTION_FUNCTIONS:
        _CORE_ATTENTION[core] = ALL_ATTENTION_FUNCTIONS[core]
    return UlyssesSPAttentionHF.register_with_transformers(model, core, sp, micro_batch_size,
                                                           seq_length_is_variable=True)

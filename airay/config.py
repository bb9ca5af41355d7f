"""The job spec: one typed, documented source of configuration.

Every field a user can get wrong is checked here, before Ray is touched, and the error
names the field (as a dotted path) and what to do about it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from airay import policy
from airay.parallel.layout import deepspeed_sizes


class ConfigError(ValueError):
    """A job spec the user must fix; the message names the field or file."""


class _Spec(BaseModel):
    # Unknown fields are errors: a typo must not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def resolve_callable(dotted: str) -> Callable[..., Any]:
    """Import `package.module:attr` (or `package.module.attr`) and return the attribute."""
    module_name, sep, attr = dotted.partition(":")
    if not sep:
        module_name, _, attr = dotted.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"'{dotted}' is not a dotted path; write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module '{module_name}' of '{dotted}': {exc}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError as exc:
        raise ValueError(f"module '{module_name}' has no attribute '{attr}' (from '{dotted}')") from exc
    if not callable(obj):
        raise ValueError(f"'{dotted}' is not callable")
    return obj


def _importable(value: str) -> str:
    resolve_callable(value)
    return value


# A 'package.module:function' that must import here, so a typo fails before any actor starts.
DottedCallable = Annotated[str, AfterValidator(_importable)]


class CallableSpec(_Spec):
    """A function named by dotted path plus the keyword arguments it is called with. A factory
    whose module defines `check_kwargs(kwargs)` has them checked when the spec loads (e.g.
    airay.models.hf: the pretrained folder exists, the model type is known)."""

    factory: DottedCallable = Field(description="'package.module:function' importable on every node")
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _kwargs_checked(self) -> "CallableSpec":
        module = importlib.import_module(resolve_callable(self.factory).__module__)
        check = getattr(module, "check_kwargs", None)
        if check is not None:
            check(self.kwargs)
        return self


class DataSpec(_Spec):
    """Where each step's samples come from.

    source: synthetic (default) -- sample `i` is `sample_fn(i, seed, **kwargs)`, built on the
    worker; the sample set of global step N is ids [N*B, (N+1)*B) for global batch B.
    source: parquet -- rows of the parquet files under `paths`, streamed to the workers through
    Ray Data; sample ids are global row numbers in sorted file order, shuffled per epoch from
    `seed` (see airay.data.EpochLayout). Either way the samples of step N do not depend on the
    world size or on what happened before step N, so a replayed step sees exactly what it saw
    the first time. (A `ray.data.Dataset` passed to `airay.fit(config, dataset=ds)` is
    source: dataset.)
    """

    source: Literal["synthetic", "parquet", "dataset"] = "synthetic"
    sample_fn: DottedCallable = "airay.models.tiny_gpt:synthetic_sample"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0
    paths: list[str] = Field(default_factory=list, description="parquet files or directories, local or URIs")
    columns: list[str] | None = Field(None, description="columns to read; default all")
    preprocess: DottedCallable | None = Field(
        None, description="'module:function' (batch: dict[str, np.ndarray], **preprocess_kwargs) -> dict of "
        "arrays with the same number of rows; default: the columns as they are")
    preprocess_kwargs: dict[str, Any] = Field(default_factory=dict)
    epochs: int | None = Field(None, ge=1, description="train this many epochs; sets max_steps when it is unset")
    shuffle: bool = True
    chunk_rows: int = Field(1024, ge=1, description="rows read together; chunk order is shuffled per epoch")
    window_steps: int = Field(8, ge=1, description="rows are shuffled within windows of this many steps")
    readers: int = Field(2, ge=1, description="reader actors of the Ray Data pipeline (num_cpus=0 each)")
    reader_cache_mb: int = Field(256, ge=0, description="decoded row groups each reader keeps (MiB): a window "
                                 "takes a few hundred rows out of row groups of thousands")
    prefetch_steps: int = Field(2, ge=0, description="steps each worker fetches ahead of the one it trains")
    fetch_timeout_s: float | None = Field(
        None, gt=0, description="a worker's fetch of a step's blocks that takes longer fails as a data failure: "
        "the round is re-run on the same world from a fresh pipeline (`data_block_lost`); must be < "
        "timeouts.hang_timeout_s, so the waiting rank is not declared hung. Default: hang_timeout_s / 2")
    pipeline_timeout_s: float = Field(
        600, gt=0, description="the driver waits this long for the pipeline to produce a round's steps; then it "
        "restarts the pipeline (twice in a run at most) and then fails the run, rather than wait forever")
    record_sample_ids: bool = Field(False, description="write samples.jsonl: each committed step's sample ids")

    @model_validator(mode="after")
    def _source_fields(self) -> "DataSpec":
        if self.source == "parquet" and not self.paths:
            raise ValueError("data.source is parquet but data.paths is empty; list parquet files or directories")
        if self.source != "parquet" and self.paths:
            raise ValueError(f"data.paths is set but data.source is {self.source}; set data.source: parquet")
        if self.source == "synthetic" and self.epochs is not None:
            raise ValueError("data.epochs needs a finite dataset; synthetic data has none, set max_steps instead")
        return self


class ScalingSpec(_Spec):
    min_workers: int = Field(1, ge=1)
    max_workers: int = Field(1, ge=1)
    resources_per_worker: dict[str, float] | None = Field(
        None, description="Ray resources of one worker's bundle; default {'GPU': 1} where the cluster "
        "has GPUs, else {'CPU': 1}")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK"] = Field(
        "PACK", description="Ray placement strategy of each placement group airay reserves; with STRICT_PACK "
        "each group is one node's bundles, so capacity is counted per node")
    world_size_multiple: int = Field(
        1, ge=1, description="the world only takes sizes that are multiples of this, e.g. 8: it shrinks and "
        "grows by whole 8-GPU nodes (a lost GPU idles the rest of its node until it is replaced)")

    @model_validator(mode="after")
    def _ordered(self) -> "ScalingSpec":
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers ({self.min_workers}) > max_workers ({self.max_workers}); "
                "set scaling.min_workers <= scaling.max_workers")
        if not self.world_sizes:
            raise ValueError(
                f"no multiple of world_size_multiple ({self.world_size_multiple}) lies in min_workers..max_workers "
                f"({self.min_workers}..{self.max_workers}); widen the range or change scaling.world_size_multiple")
        return self

    @property
    def world_sizes(self) -> list[int]:
        """The world sizes the run may take, smallest first."""
        return policy.allowed_world_sizes(self.min_workers, self.max_workers, self.world_size_multiple)

    @field_validator("resources_per_worker")
    @classmethod
    def _positive(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None:
            if not value:
                raise ValueError("must name at least one resource, e.g. {CPU: 1}")
            bad = {k: v for k, v in value.items() if v <= 0}
            if bad:
                raise ValueError(f"resource amounts must be > 0, got {bad}")
        return value


# pyarrow.fs schemes a checkpoint path may use (besides a local or NFS directory).
STORAGE_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "file")


class CheckpointSpec(_Spec):
    """Two tiers: every save goes to the memory of the nodes that train (each rank its own files,
    each node's copied to the next node), loaded first; every `every_n_steps` (and at the end) it
    is uploaded to durable storage on `path` too. `fast_every_n_steps` adds saves in between
    that stay in memory."""

    path: str | None = Field(
        None, description="durable tier: a directory shared by all nodes, or a pyarrow filesystem URI "
        "(s3://bucket/prefix, gs://..., hdfs://...); default RUN_DIR/checkpoints. Re-running a job on the "
        "same path resumes from its newest good checkpoint")
    every_n_steps: int = Field(10, ge=1, description="durable checkpoint interval")
    keep_last: int = Field(3, ge=1, description="durable checkpoints kept (and any marked KEEP); older ones "
                           "are deleted")
    fast_every_n_steps: int | None = Field(
        None, ge=1, description="interval of saves to the memory tier only; must divide every_n_steps. Default: "
        "only the durable saves (which go through the memory tier too)")
    memory_path: str | None = Field(
        None, description="the memory tier's base directory on every node (private to you, mode 0700); "
        "default /dev/shm/airay")
    memory_keep_last: int = Field(2, ge=1, description="memory-tier checkpoints kept on each node (fewer when "
                                  "they would exceed the tier's budget)")
    memory_budget_fraction: float = Field(
        0.25, gt=0, le=0.9, description="the memory tier's budget on a node: this fraction of the node's memory "
        "(split between raylets that share a machine), never more than 80% of /dev/shm's room; checked at start "
        "and before each save. A save that would exceed it drops the oldest kept steps first, then the copy to "
        "the next node, then is skipped (checkpoint_budget events). The tier lives in RAM: the rest is the "
        "training processes'")
    memory_budget_gb: float | None = Field(
        None, gt=0, description="the memory tier's budget per node in GB, instead of memory_budget_fraction "
        "(still capped by /dev/shm's room)")
    chunk_mib: float = Field(
        1, gt=0, description="the largest chunk of a checkpoint file with a CRC-32 of its own (in the file's CRC "
        "sidecar, FILE.crc32; a file has at least 4096 chunks, each a power of two of at least 4 KiB and at most "
        "this many MiB): a rank loading at another world size reads and verifies only the chunks that hold its new "
        "partition (and each old file's ends, its structure)")
    preemption_grace_s: float = Field(
        30, gt=0, description="after SIGTERM (spot reclaim), the run checkpoints and exits within this long")
    export_hf: bool = Field(
        False, description="when the run finishes, also write its final checkpoint as a Hugging Face model folder, "
        "PATH/hf (model.factory must build a transformers PreTrainedModel: airay.models.hf:build or your own; "
        "a checkpoint directory, not a URI), in a task on a training node")
    upload_retries: int = Field(
        2, ge=0, description="a durable upload that fails is tried again this many times (its files wait in "
        "the memory tier) before the checkpoint counts as failed (health.max_checkpoint_failures)")

    @field_validator("path")
    @classmethod
    def _storage_uri(cls, value: str | None) -> str | None:
        if value is not None and "://" in value:
            scheme = value.split("://", 1)[0].lower()
            if scheme not in STORAGE_SCHEMES:
                raise ValueError(f"'{scheme}://' is not a pyarrow filesystem; use a directory or one of "
                                 + ", ".join(f"{s}://" for s in STORAGE_SCHEMES))
        return value

    @model_validator(mode="after")
    def _fast_divides(self) -> "CheckpointSpec":
        fast = self.fast_every_n_steps
        if fast is not None and (fast > self.every_n_steps or self.every_n_steps % fast):
            raise ValueError(f"fast_every_n_steps ({fast}) must divide every_n_steps ({self.every_n_steps}), "
                             "so every durable checkpoint is also a memory one; e.g. set it to "
                             + ", ".join(str(d) for d in range(1, self.every_n_steps + 1)
                                         if self.every_n_steps % d == 0))
        return self

    @property
    def interval(self) -> int:
        """Steps between checkpoints of either tier."""
        return self.fast_every_n_steps or self.every_n_steps


ChaosKind = Literal["kill_worker", "remove_node", "add_node", "hang_worker", "raise_in_user_code", "oom_worker",
                    "corrupt_checkpoint", "corrupt_memory_copy", "lose_node_memory", "slow_worker",
                    "lose_data_block", "stall_data_block", "kill_driver", "break_storage", "raise_in_airay",
                    "device_error", "stall_collective"]
# Faults the driver strikes on the data it hands a round (airay.chaos.spoil_rows), not at a round's start.
DATA_FAULTS = ("lose_data_block", "stall_data_block")
# Where a kill_worker or hang_worker strikes: inside a training step, or inside the next world
# formation (join), checkpoint save or checkpoint load once the run has reached at_step.
ChaosPoint = Literal["step", "form", "save", "load"]


class ChaosSpec(_Spec):
    """A fault injected at a named point: the start of global step `at_step`, on `rank`.

    kill_worker: SIGKILL the rank's process. remove_node: kill the rank's node (local cluster).
    add_node: add a node (local cluster). hang_worker: the rank blocks inside the step
    (`hang_mode` sleep: a blocking call in the training thread; sigstop: the whole process
    stops, heartbeat included). raise_in_user_code: the rank's loss function raises.
    raise_in_airay: airay's own code raises on the rank inside the step (an IndexError, as a bug
    in its loader would). device_error: the rank's device fails inside the step: on a CUDA device
    a real device-side assert (an out-of-range index in a device tensor, reported wherever CUDA
    reports it next); without one, torch.AcceleratorError with CUDA's message. oom_worker: the rank's address space is capped just above its use, then it allocates until
    MemoryError. corrupt_checkpoint: flip bytes in every copy of a file of the newest committed
    checkpoint, then kill the rank so the run must load one (it falls back to the step before).
    corrupt_memory_copy: flip bytes in one copy, the one on the rank's node, of a file the rank
    wrote to the newest memory checkpoint, then kill the next rank: the rank's own load finds its
    node's copy bad and reads the peer copy.
    lose_node_memory: the rank's node loses its memory-tier copies of the newest memory
    checkpoint, then the rank is killed (its files come from the peer copies). slow_worker: the rank sleeps `delay_s` in each of
    `steps` steps (a straggler). lose_data_block / stall_data_block (streamed data): the rows of
    step `at_step` that `rank` trains on come from a block whose owner is gone (ObjectLostError)
    or that never arrives (a data.fetch_timeout_s timeout); the step need not start a round.
    kill_worker and hang_worker take `during`: step (default), or form / save / load: the rank
    is killed (hangs) inside the first world formation, checkpoint save or checkpoint load at or
    after step `at_step`. kill_driver: the driver process SIGKILLs itself at the start of
    `at_step` (a supervised driver, `airay run`, is restarted and resumes). break_storage: from
    `at_step` on, every write to the durable checkpoint directory fails (the directory is moved
    aside and a file put in its place; restored when the run ends). stall_collective: the rank
    blocks just before its `collective`-th collective call of step `at_step` (counted from the
    step's first forward; a step with fewer calls: after its last), so its peers enter that
    collective and wait inside it: every rank stands still at one point, as under NCCL when one
    GPU or link stops. The hang watch names the rank by its collective count (airay.health.position).
    """

    fault: ChaosKind
    at_step: int = Field(ge=0)
    rank: int = Field(0, ge=0, description="the rank the fault strikes; remove_node: the node of this rank")
    hang_mode: Literal["sleep", "sigstop"] = Field("sleep", description="hang_worker only")
    during: ChaosPoint = Field("step", description="kill_worker and hang_worker only: where the fault strikes")
    delay_s: float = Field(0.5, gt=0, description="slow_worker only: extra seconds per step")
    steps: int = Field(5, ge=1, description="slow_worker only: how many steps the rank is slow")
    collective: int = Field(1, ge=1, description="stall_collective only: the rank blocks just before its "
                            "collective call of this number in the step (1: the first)")


class LocalClusterSpec(_Spec):
    """Start real raylets on this machine (ray.cluster_utils.Cluster) instead of connecting."""

    local_nodes: int = Field(ge=1)
    cpus_per_node: float = Field(1, gt=0)
    gpus_per_node: float = Field(0, ge=0, description="logical GPUs, to try the GPU scheduling path")
    object_store_memory: int = Field(100 * 1024**2, ge=75 * 1024**2)


class TimeoutSpec(_Spec):
    capacity_wait_s: float = Field(
        600, gt=0, description="how long to wait for min_workers to fit, at start and after a loss leaves fewer: "
        "long enough for the autoscaler to launch a node (a GPU cloud node takes minutes to boot and start Ray), "
        "so a run on a cluster that starts small or loses a node waits for it instead of failing")
    collective_timeout_s: float = Field(120, gt=0, description="no rank blocks longer in a collective")
    survivor_drain_s: float = Field(30, gt=0, description="after a loss, wait this long for survivors to stop")
    grow_check_every_n_steps: int = Field(1, ge=1, description="how often to look for new capacity")
    grow_settle_s: float = Field(
        5, ge=0, description="once a worker stands by to grow the world, wait up to this long for workers still "
        "starting that would grow it further: one checkpoint and re-formed world for replacements seconds apart")
    phase_timeout_s: float = Field(
        600, gt=0, description="a rank that makes no progress this long inside a world formation (process "
        "group and engine build), a checkpoint save or a checkpoint load is hung: killed and replaced. Every "
        "driver wait on the ranks is bounded by it or by hang_timeout_s")
    hang_timeout_s: float = Field(
        60, gt=0, description="a rank whose step progress (micro-batch and phase, read by a heartbeat from "
        "another thread) stands still this long is hung: killed and replaced like a crash. Must be longer "
        "than the slowest phase of a step (one micro-batch's forward, backward or optimizer step) and "
        "shorter than collective_timeout_s")
    first_step_timeout_s: float | None = Field(
        None, gt=0, description="hang_timeout_s for a rank's first step in a new world (after it joins: the "
        "run's first world, a recovery, a grow), which also creates NCCL's communicators lazily and runs a first "
        "compile. At least hang_timeout_s and below collective_timeout_s. Default: halfway between the two "
        "(90 s with their defaults)")

    @model_validator(mode="after")
    def _hang_before_collective(self) -> "TimeoutSpec":
        if self.hang_timeout_s >= self.collective_timeout_s:
            raise ValueError(
                f"hang_timeout_s ({self.hang_timeout_s}) must be < collective_timeout_s "
                f"({self.collective_timeout_s}): otherwise the peers' collectives time out first and the "
                "hung rank is not the one named; lower timeouts.hang_timeout_s or raise collective_timeout_s")
        first = self.first_step_timeout_s
        if first is not None and not self.hang_timeout_s <= first < self.collective_timeout_s:
            raise ValueError(
                f"first_step_timeout_s ({first:g}) must be >= hang_timeout_s ({self.hang_timeout_s:g}) and < "
                f"collective_timeout_s ({self.collective_timeout_s:g}): a first step gets more time than any other, "
                "and its rank must be named before its peers' collectives time out; set timeouts.first_step_timeout_s "
                "between them (or leave it unset)")
        return self

    @property
    def first_step_s(self) -> float:
        """first_step_timeout_s, or its default: halfway between hang_timeout_s and collective_timeout_s."""
        if self.first_step_timeout_s is not None:
            return self.first_step_timeout_s
        return (self.hang_timeout_s + self.collective_timeout_s) / 2


class HealthSpec(_Spec):
    """How failures are counted and when the run gives up (see docs/FAULTS.md)."""

    failure_window_s: float = Field(
        3600, gt=0, description="max_failures counts failures within this sliding window")
    restart_backoff_s: float = Field(
        0, ge=0, description="wait this long before the 2nd recovery in the window, doubling per further one")
    max_backoff_s: float = Field(60, ge=0, description="cap on restart_backoff_s's doubling")
    retry_user_errors: int = Field(
        0, ge=0, description="recoveries allowed after an exception in user code; 0: fail fast")
    exclude_node_after_failures: int = Field(
        3, ge=0, description="a node that caused this many failures is kept out of placement; 0: never")
    straggler_factor: float = Field(
        2.0, gt=1, description="a rank whose local step time exceeds the other ranks' median by this factor "
        "(and by straggler_min_excess_s) is reported as a straggler")
    straggler_min_excess_s: float = Field(0.1, ge=0)
    straggler_window_steps: int = Field(
        5, ge=1, description="a rank is judged on its median local step time over its last this many steps in "
        "the world: one slow step (a GC pause, a checkpoint's background writes) is not a straggler")
    max_checkpoint_failures: int = Field(
        3, ge=1, description="consecutive checkpoints that fail (after their retries) before the run ends "
        "failed: a run that cannot checkpoint would lose everything it trains from then on")
    max_driver_restarts: int = Field(
        3, ge=0, description="a driver process that dies (killed, out of memory, a crash) is restarted this many "
        "times by `airay run` (also under `airay submit` and `ray job submit`); the new driver resumes from the "
        "newest checkpoint in the run directory. 0: no supervision")


class MlflowSpec(_Spec):
    """An MLflow run for this airay run (airay.observe.mlflow_tracking). Also on when
    MLFLOW_TRACKING_URI is set, with MLflow's own environment variables for what is not given."""

    tracking_uri: str | None = Field(None, description="e.g. sqlite:///mlflow.db, ./mlruns, http://host:5000; "
                                     "default MLFLOW_TRACKING_URI")
    experiment: str | None = Field(None, description="default MLFLOW_EXPERIMENT_NAME, else the job's name")
    run_name: str | None = Field(None, description="default the run directory's name")

    @model_validator(mode="after")
    def _installed(self) -> "MlflowSpec":
        import importlib.util

        if importlib.util.find_spec("mlflow") is None:
            raise ValueError("tracking.mlflow: MLflow is not installed; pip install 'airay[mlflow]'")
        return self


class TrackingSpec(_Spec):
    mlflow: MlflowSpec | None = None


class QueueSpec(_Spec):
    """Run under the cluster's scheduler (airay.sched.actor): wait in its queue until admitted,
    train at the size it gives, shrink (a planned shrink at a step boundary, no replayed step)
    when it lowers the size for a job of higher priority, and grow back when it raises it."""

    priority: int = Field(0, description="higher runs first, and may shrink or preempt jobs of lower priority")
    team: str = Field("default", min_length=1, description="whose quota the job counts against "
                      "(`airay queue --quota TEAM=N` sets a team's guaranteed workers)")
    max_wait_s: float = Field(86400, gt=0, description="how long to wait in the queue for admission before failing")


class JobConfig(_Spec):
    """A training job: model, data, DeepSpeed, batch, scaling, checkpoints and faults."""

    name: str = "airay-job"
    model: CallableSpec
    loss_fn: DottedCallable = Field(description="'module:function' with signature (model, batch) -> scalar mean loss")
    data: DataSpec = Field(default_factory=DataSpec)
    deepspeed: dict[str, Any] | str = Field(
        default_factory=lambda: {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        description="DeepSpeed config, inline or a JSON file path; airay sets the batch fields")
    global_batch_size: int = Field(ge=1, description="samples per step at every world size: ranks take "
                                   "global_batch_size // world or one more (any world size works), and "
                                   "the update is the exact mean over the global batch")
    micro_batch_size: int = Field(ge=1, description="largest micro-batch one worker may take")
    max_steps: int | None = Field(None, ge=1, description="steps to train; with a dataset, default "
                                  "data.epochs x steps per epoch")
    seed: int = 0
    max_failures: int = Field(20, ge=0, description="failures tolerated within health.failure_window_s")
    steps_per_round: int = Field(5, ge=1, description="steps a worker runs per driver call")
    pipeline_rounds: bool = Field(
        True, description="queue the next round on the workers while one runs, when the driver has nothing to do "
        "between them (no checkpoint, resize, growth or chaos): a rank goes on without waiting for the driver")
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    chaos: list[ChaosSpec] = Field(default_factory=list)
    ray_address: str | None = Field(None, description="default: RAY_ADDRESS, else a new local Ray")
    cluster: LocalClusterSpec | None = None
    timeouts: TimeoutSpec = Field(default_factory=TimeoutSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    queue: QueueSpec | None = Field(None, description="run under the cluster's scheduler (see QueueSpec)")
    run_dir: str | None = Field(None, description="default: ./runs/NAME-TIMESTAMP")

    @field_validator("deepspeed")
    @classmethod
    def _deepspeed_config(cls, value: dict[str, Any] | str) -> dict[str, Any]:
        if isinstance(value, str):
            path = Path(value)
            if not path.is_file():
                raise ValueError(f"DeepSpeed config file '{value}' does not exist; give a JSON file or an inline mapping")
            try:
                value = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"DeepSpeed config file '{value}' is not valid JSON: {exc}") from exc
        owned = sorted(k for k in policy.DEEPSPEED_BATCH_KEYS if k in value)
        if owned:
            raise ValueError(
                f"remove {owned}: airay sets them from global_batch_size and micro_batch_size "
                "for each world size")
        tp, sp = deepspeed_sizes(value)
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel.autotp_size must be a whole number >= 1, got {tp!r}")
        if not isinstance(sp, int) or sp < 1:
            raise ValueError(f"sequence_parallel_size must be a whole number >= 1, got {sp!r}")
        if tp > 1 and sp > 1:
            raise ValueError(f"tensor_parallel.autotp_size ({tp}) and sequence_parallel_size ({sp}) together: airay "
                             "runs one model-parallel dimension at a time; keep one of them")
        mp_key = "tensor_parallel.autotp_size" if tp > 1 else "sequence_parallel_size"
        if max(tp, sp) > 1 and value.get("zero_optimization", {}).get("stage", 0) == 3:
            raise ValueError(f"{mp_key} ({max(tp, sp)}) with zero_optimization.stage 3: airay runs model "
                             "parallelism at ZeRO stages 0-2; use stage 1 or 2 (the optimizer state is still "
                             "partitioned over the data-parallel ranks)")
        stage = value.get("zero_optimization", {}).get("stage", 0)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
        return value

    @model_validator(mode="after")
    def _plans_and_chaos(self) -> "JobConfig":
        mp, sc = self.model_parallel_size, self.scaling
        if mp > 1:
            for name in ("min_workers", "max_workers"):
                if getattr(sc, name) % mp:
                    raise ValueError(f"scaling.{name} ({getattr(sc, name)}) must be a multiple of the model-parallel "
                                     f"size {mp} (deepspeed.tensor_parallel.autotp_size x sequence_parallel_size): "
                                     "the world is whole "
                                     "replicas of the model; it counts ranks")
            if self.sequence_parallel_size > 1 and self.loss_fn != "airay.models.hf:loss":
                raise ValueError(f"loss_fn {self.loss_fn} with deepspeed.sequence_parallel_size "
                                 f"{self.sequence_parallel_size}: each rank holds a share of a sequence, so the loss is "
                                 "airay's over the whole sequences (use loss_fn: airay.models.hf:loss, with a "
                                 "transformers causal LM)")
            if sc.placement_strategy == "SPREAD":
                raise ValueError("scaling.placement_strategy SPREAD: a model-parallel group's ranks must share a node "
                                 "(tensor parallelism needs its fast links); use PACK or STRICT_PACK")
        try:
            self.batch_plans()
        except policy.PolicyError as exc:
            raise ValueError(str(exc)) from exc
        if self.max_steps is None and self.data.epochs is None:
            raise ValueError("set max_steps (or data.epochs for a parquet or Ray dataset)")
        for i, fault in enumerate(self.chaos):
            if fault.during != "step" and fault.fault not in ("kill_worker", "hang_worker"):
                raise ValueError(f"chaos[{i}].during is for kill_worker and hang_worker; remove it from {fault.fault}")
            if self.max_steps is not None and fault.at_step >= self.max_steps:
                raise ValueError(f"chaos[{i}].at_step ({fault.at_step}) must be < max_steps ({self.max_steps})")
            if fault.rank >= self.scaling.max_workers:
                raise ValueError(f"chaos[{i}].rank ({fault.rank}) must be < scaling.max_workers")
            if fault.fault == "corrupt_checkpoint" and fault.at_step <= self.checkpoint.every_n_steps:
                raise ValueError(
                    f"chaos[{i}]: corrupt_checkpoint at_step {fault.at_step} needs a committed checkpoint "
                    f"to corrupt and an older one to fall back to; set at_step > "
                    f"checkpoint.every_n_steps ({self.checkpoint.every_n_steps})")
            if fault.fault == "corrupt_checkpoint" and self.checkpoint.keep_last < 2:
                raise ValueError(f"chaos[{i}]: corrupt_checkpoint needs checkpoint.keep_last >= 2 "
                                 "(an older checkpoint to fall back to)")
            if fault.fault == "corrupt_memory_copy" and self.scaling.max_workers < 2:
                raise ValueError(f"chaos[{i}]: corrupt_memory_copy kills the rank after `rank`; it needs "
                                 "scaling.max_workers >= 2")
            if fault.fault in ("corrupt_memory_copy", "lose_node_memory") and fault.at_step <= self.checkpoint.interval:
                raise ValueError(f"chaos[{i}]: {fault.fault} needs a committed memory checkpoint: set at_step > "
                                 f"{self.checkpoint.interval} (checkpoint.fast_every_n_steps or every_n_steps)")
            if fault.fault == "slow_worker" and fault.at_step + fault.steps > self.max_steps:
                raise ValueError(f"chaos[{i}]: slow_worker steps ({fault.steps}) run past max_steps "
                                 f"({self.max_steps}); lower chaos[{i}].steps or at_step")
            if fault.fault == "break_storage" and self.checkpoint.path and "://" in self.checkpoint.path:
                raise ValueError(f"chaos[{i}]: break_storage acts on a checkpoint directory; checkpoint.path is "
                                 f"the URI {self.checkpoint.path}: leave it unset or give a directory")
            if fault.fault in DATA_FAULTS and self.data.source == "synthetic":
                raise ValueError(f"chaos[{i}]: {fault.fault} spoils a block of streamed data; it needs "
                                 "data.source parquet or dataset")
        if self.checkpoint.export_hf and self.checkpoint.path and "://" in self.checkpoint.path:
            raise ValueError(f"checkpoint.export_hf reads and writes a directory; checkpoint.path is the URI "
                             f"{self.checkpoint.path}: export afterwards with `airay export` from a local copy")
        unreshardable = unreshardable_layout(self.deepspeed, self.zero_stage)
        if unreshardable and len(self.world_sizes) > 1:
            raise ValueError(f"{unreshardable}, or a fixed world (scaling.min_workers = max_workers)")
        fetch, hang = self.data.fetch_timeout_s, self.timeouts.hang_timeout_s
        if fetch is not None and fetch >= hang:
            raise ValueError(f"data.fetch_timeout_s ({fetch:g}) must be < timeouts.hang_timeout_s ({hang:g}): a rank "
                             "waiting that long for its data would be declared hung and killed, though the data is "
                             "at fault; lower data.fetch_timeout_s or raise timeouts.hang_timeout_s")
        if self.queue is not None and self.cluster is not None:
            raise ValueError("queue: a queued job runs on a shared cluster, and `cluster:` starts one of its own for "
                             "this run only; remove `cluster:` and give ray_address (or RAY_ADDRESS)")
        steps = [(c.at_step, c.rank, c.during) for c in self.chaos
                 if c.fault not in ("add_node", "slow_worker", "kill_driver", "break_storage")]
        dup = sorted({s[:2] for s in steps if steps.count(s) > 1})
        if dup:
            raise ValueError(f"chaos: more than one fault at (at_step, rank) {dup}; give each its own step or rank")
        return self

    # ---- loading -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "job spec") -> "JobConfig":
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source)) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> "JobConfig":
        return cls.from_dict(spec_mapping(path, overrides), source=str(path))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @property
    def tensor_parallel_size(self) -> int:
        """deepspeed.tensor_parallel.autotp_size: ranks a replica's model is sliced over (its
        checkpoint's slices)."""
        return int(deepspeed_sizes(self.deepspeed)[0])

    @property
    def sequence_parallel_size(self) -> int:
        """deepspeed.sequence_parallel_size: ranks a replica's sequences are split over (Ulysses)."""
        return int(deepspeed_sizes(self.deepspeed)[1])

    @property
    def model_parallel_size(self) -> int:
        """Ranks per model replica (1: pure data parallelism)."""
        return self.tensor_parallel_size * self.sequence_parallel_size

    @property
    def world_sizes(self) -> list[int]:
        """The world sizes the run may take, smallest first: scaling's, whole replicas only."""
        sc = self.scaling
        return policy.allowed_world_sizes(sc.min_workers, sc.max_workers,
                                          math.lcm(sc.world_size_multiple, self.model_parallel_size))

    def batch_plans(self) -> dict[int, "policy.BatchPlan"]:
        """The batch plan of each allowed world size: over its data-parallel replicas."""
        return policy.batch_plans(self.global_batch_size, self.micro_batch_size, self.world_sizes,
                                  self.model_parallel_size)

    @property
    def needs_local_cluster(self) -> bool:
        """remove_node / add_node faults act on raylets airay started itself."""
        return any(c.fault in ("remove_node", "add_node") for c in self.chaos)

    @property
    def data_fetch_timeout_s(self) -> float:
        """data.fetch_timeout_s, or its default: half of timeouts.hang_timeout_s."""
        return self.data.fetch_timeout_s or self.timeouts.hang_timeout_s / 2

    @property
    def zero_stage(self) -> int:
        return int(self.deepspeed.get("zero_optimization", {}).get("stage", 0))


def unreshardable_layout(ds: dict[str, Any], stage: int) -> str | None:
    """Why DeepSpeed config `ds` at ZeRO `stage` writes checkpoints that airay cannot reshard to
    another world size, naming the key and what to use instead (None: it can). Every other
    layout is checked bit for bit against DeepSpeed's universal checkpoint (tests/test_reshard.py:
    fp32 and bf16, ZeRO-1/2/3, BF16_Optimizer, CPU offload, small ZeRO-3 sub-groups); these were
    found wrong or unreadable there (deepspeed 0.19)."""
    zero = ds.get("zero_optimization") or {}
    # DeepSpeed reads "bf16" and, when it is absent, the older "bfloat16".
    bf16 = bool((ds["bf16"] if "bf16" in ds else ds.get("bfloat16") or {}).get("enabled"))
    if bf16 and stage == 0:
        return ("deepspeed bf16 with zero_optimization.stage 0 keeps DeepSpeed's bf16 optimizer, whose checkpoints "
                "cannot be resharded to another world size; use zero_optimization.stage 1-3")
    if stage in (1, 2) and zero.get("round_robin_gradients"):
        # ZeRO-1/2 flatten the parameters in an order that depends on the world size (i % world
        # first), so the old world's partitions hold other parameters than the new world's
        # (DeepSpeed's own universal checkpoint gets this layout wrong as well).
        return ("deepspeed zero_optimization.round_robin_gradients orders each rank's partition by the world size, "
                "so its checkpoints cannot be resharded to another world size; remove it (or set it false)")
    if stage in (1, 2) and zero.get("elastic_checkpoint"):
        return ("deepspeed zero_optimization.elastic_checkpoint saves ZeRO-1/2 optimizer state merged across ranks, "
                "which airay cannot reshard (nor can DeepSpeed's universal checkpoint); remove it (or set it "
                "false): airay reshards DeepSpeed's default per-rank checkpoints itself")
    return None


def spec_mapping(path: str | os.PathLike, overrides: list[str] | None = None) -> dict[str, Any]:
    """A spec file's mapping with the overrides applied, not yet checked (JobConfig.from_dict checks)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"job spec file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"job spec file '{path}' is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"job spec file '{path}' must hold a mapping at the top level")
    # A relative DeepSpeed JSON path is relative to the spec file, so jobs run from anywhere.
    ds = data.get("deepspeed")
    if isinstance(ds, str) and not Path(ds).is_absolute():
        data["deepspeed"] = str(path.parent / ds)
    for item in overrides or []:
        apply_override(data, item)
    return data


def resolve_run_dir(config: JobConfig) -> Path:
    """The run directory: the spec's, else runs/NAME-TIMESTAMP (fixed once, by whoever starts the run)."""
    return run_dir_for(config.name, config.run_dir)


def run_dir_for(name: str, run_dir: str | None) -> Path:
    return Path(run_dir) if run_dir else Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def supervision(data: dict[str, Any], source: str) -> tuple[Path, int]:
    """What `airay run`'s supervisor needs of a spec mapping: the run directory and
    health.max_driver_restarts. Checks only those fields: the full checks import the model's
    code (torch, seconds of CPU), which the driver does anyway, and the driver reports bad input
    (exit 2) before Ray starts. A field here that is wrong gets JobConfig's own error."""
    try:
        health = HealthSpec.model_validate(data.get("health") or {})
        name, run_dir = data.get("name", JobConfig.model_fields["name"].default), data.get("run_dir")
        if not isinstance(name, str) or not isinstance(run_dir, (str, type(None))):
            raise TypeError
    except (ValidationError, TypeError, AttributeError):
        JobConfig.from_dict(data, source)  # raises the error naming the field
        raise
    return run_dir_for(name, run_dir), health.max_driver_restarts


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one `--set a.b.c=value` (value parsed as YAML) to a raw spec mapping."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set '{item}' must look like key.path=value")
    value = yaml.safe_load(raw) if raw != "" else None
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set '{item}': '{part}' is not a mapping")
        node = child
    node[parts[-1]] = value


def format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid {source}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling against airay.JobConfig"
        elif err["type"] == "missing":
            msg = "required field is missing"
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)

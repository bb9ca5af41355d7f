"""The worker's pure decisions: which errors are the user's, device choice, engine config."""

import pytest
import torch
import torch.distributed as tdist

from airay.policy import BatchPlan
from airay.worker.device import DeviceError, assign_device, cuda_ordinal
from airay.worker.failures import failure_kind
from airay.worker.engine import engine_config, zero3_memory_defaults


def _is_comm_error(exc):
    return failure_kind(exc) == "comm"

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:387: Connection reset by peer")


def test_collective_failures_are_not_user_errors():
    assert _is_comm_error(RuntimeError(GLOO_RESET))
    assert _is_comm_error(tdist.DistBackendError("NCCL communicator was aborted"))


def test_user_errors_are_not_mistaken_for_collective_failures():
    # "unexpected" contains "peer": a substring match once turned this into a retry loop.
    assert not _is_comm_error(TypeError("TinyGPT.__init__() got an unexpected keyword argument 'n_layerz'"))
    assert not _is_comm_error(RuntimeError("shape mismatch: unexpected peer tensor"))
    assert not _is_comm_error(ValueError("gloo"))
    # Bare words gloo's messages also use are not enough: the text must be gloo's or NCCL's own.
    assert not _is_comm_error(RuntimeError("request timed out after 30s"))
    assert not _is_comm_error(RuntimeError("connection reset while reading my dataset from gloo.example.com"))
    assert _is_comm_error(RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                                       "waiting 30000ms for recv operation to complete"))
    # NCCL's own failure: named as such, not the user's (airay.health decides whose it is).
    assert failure_kind(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")) == "nccl"


def test_gpu_failures_are_infrastructure_not_user_errors():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 3; 79.3 GiB total)")
    assert failure_kind(oom) == "infra"
    assert failure_kind(torch.cuda.OutOfMemoryError("CUDA out of memory")) == "infra"
    assert failure_kind(MemoryError()) == "infra"
    assert failure_kind(tdist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited")) \
        == "comm"
    # A CUDA error is the device's, wherever it surfaces (tests/test_failures.py has every class).
    assert failure_kind(RuntimeError("CUDA error: device-side assert triggered")) == "gpu"
    # The driver's verdict on a rank whose step raised CUDA OOM: replace the worker, as a crash.
    from airay.health import RankOutcome, classify_round

    outcome = RankOutcome(3, "errored", error=str(oom), cause=type(oom).__name__)
    assert outcome.infra and outcome.fault == "oom"
    assert classify_round([RankOutcome(0, "ok"), outcome]).kind == "lost"


@pytest.mark.parametrize("gpu_id,visible,ordinal", [
    ("3", "3", 0),            # Ray masked CUDA_VISIBLE_DEVICES to the worker's own GPU
    ("5", None, 5),           # not masked (airay's default), raylet sees every GPU
    ("5", "0,1,2,3,4,5,6,7", 5),
    ("6", "4,5,6,7", 2),      # raylet under a subset (SLURM, Kubernetes): position, not the id
    ("GPU-b2c", "GPU-a1f,GPU-b2c", 1),  # UUIDs
])
def test_cuda_ordinal_is_the_position_in_the_visible_devices(gpu_id, visible, ordinal):
    assert cuda_ordinal(gpu_id, visible) == ordinal
    a = assign_device([gpu_id], visible, cuda_available=True)
    assert (a.local_rank, a.device, a.backend, a.cuda_device) == (ordinal, f"cuda:{ordinal}", "nccl", f"cuda:{ordinal}")


def test_ranks_of_an_8_gpu_node_get_8_devices():
    for visible in (None, "0,1,2,3,4,5,6,7"):
        devices = [assign_device([str(g)], visible, True).device for g in range(8)]
        assert devices == [f"cuda:{g}" for g in range(8)]
    subset = [assign_device([g], "8,9,10,11", True).device for g in ("8", "9", "10", "11")]
    assert subset == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_device_without_cuda_or_gpu():
    logical = assign_device(["1"], None, cuda_available=False)  # logical GPUs on a CPU machine
    assert (logical.device, logical.backend, logical.local_rank, logical.cuda_device) == ("cpu", "gloo", 1, "cuda:1")
    none = assign_device([], "0,1", cuda_available=True)
    assert (none.device, none.backend, none.local_rank, none.cuda_device) == ("cpu", "gloo", 0, None)


def test_a_gpu_the_process_cannot_see_is_a_clear_error():
    with pytest.raises(DeviceError, match="Ray assigned GPU '3' but this process sees CUDA_VISIBLE_DEVICES='0,1'"):
        cuda_ordinal("3", "0,1")


def test_engine_config_sets_batch_fields_without_touching_the_spec():
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    cfg = engine_config(base, BatchPlan(3, 24, 4, 2), on_cpu=True, load_universal=True)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (24, 4, 2)
    assert cfg["optimizer"]["params"]["torch_adam"] is True and cfg["checkpoint"]["load_universal"] is True
    assert "torch_adam" not in base["optimizer"]["params"] and "train_batch_size" not in base
    assert "torch_adam" not in engine_config(base, BatchPlan(1, 1, 1, 1), on_cpu=False,
                                             load_universal=False)["optimizer"]["params"]


def test_memory_errors_in_user_code_stay_memory_errors():
    # Running out of memory inside the loss is the machine's limit: it must reach the driver as
    # MemoryError (replace the worker), not as UserCodeError (fail the run).
    import pytest

    from airay.worker import TrainWorker, UserCodeError

    w = TrainWorker.__new__(TrainWorker)
    w.rank = 3

    def oom():
        raise MemoryError()

    def bug():
        raise TypeError("bad arg")

    with pytest.raises(MemoryError):
        w._user(oom)
    with pytest.raises(UserCodeError, match="rank 3: TypeError: bad arg"):
        w._user(bug)


def _worker_in_a_world(loss_fn, data=None):
    """A TrainWorker as a world leaves it after join (no Ray, no process group), its engine a stand-in."""
    from airay.data.source import SyntheticSource
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker import TrainWorker

    w = TrainWorker.__new__(TrainWorker)
    w.rank, w.device, w.engine, w.loss_fn = 1, "cpu", object(), loss_fn
    w.tp = w.sp = w.mp = 1  # no model parallelism: rank 1 is replica 1
    w.replica, w.sp_rank, w.world = 1, 0, 2
    w.plan = plan_batch(8, 2, 2)
    w.data = data or SyntheticSource(tiny_gpt.synthetic_sample, 0, {})
    w._world_sockets, w._preempted_at, w._progress = {}, None, {}
    w.left = 0

    def leave():
        w.left += 1

    w.leave = leave
    return w


def test_a_cuda_error_raised_in_user_code_is_the_devices_not_the_users():
    # Through the worker's own path (train -> _step -> _user -> the loss): the driver gets a
    # GPUError (infrastructure: the rank is replaced), never a UserCodeError (the run would fail).
    from airay.worker import UserCodeError
    from airay.worker.failures import GPUError, InternalError

    def assert_in_loss(engine, batch):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered\nCUDA kernel errors might be "
                                     "asynchronously reported at some other API call")

    w = _worker_in_a_world(assert_in_loss)
    with pytest.raises(GPUError, match="rank 1: AcceleratorError: CUDA error: device-side assert triggered") as err:
        w.train(0, 1)
    assert "assert_in_loss" in str(err.value)  # the traceback, down to the raising frame
    assert w.left == 0  # its CUDA context is not touched again: the driver replaces the process
    # As a RuntimeError (torch before 2.8), raised in the backward or the optimizer step: the same.
    w = _worker_in_a_world(lambda engine, batch: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered")))
    with pytest.raises(GPUError):
        w.train(0, 1)
    # A bug in the user's loss is still the user's; the worker leaves its world as before.
    w = _worker_in_a_world(lambda engine, batch: {}["labels"])
    with pytest.raises(UserCodeError, match="rank 1: KeyError: 'labels'"):
        w.train(0, 1)
    assert w.left == 1

    class BrokenLoader:  # airay's own data source failing: airay's error, not the user's
        def micro_batches(self, step, rank, plan):
            from airay.data.source import collate

            return [collate([])]

    w = _worker_in_a_world(lambda engine, batch: None, data=BrokenLoader())
    with pytest.raises(InternalError, match="rank 1: IndexError: list index out of range"):
        w.train(0, 1)
    assert w.left == 1


def test_zero3_memory_limits_follow_the_largest_parameter_and_never_override_the_spec():
    # A 300M-parameter GPT's largest matrix (4 x 1792^2): a bucket of it, not DeepSpeed's 5e8.
    got = zero3_memory_defaults({"stage": 3}, 12_845_056)
    assert got == {"reduce_bucket_size": 12_845_056, "stage3_prefetch_bucket_size": 11_560_550,
                   "stage3_max_live_parameters": 38_535_168, "stage3_max_reuse_distance": 38_535_168}
    assert zero3_memory_defaults({}, 10)["reduce_bucket_size"] == 1_000_000  # a floor for tiny models
    huge = zero3_memory_defaults({}, 2_000_000_000)  # a 70B model's embedding: DeepSpeed's own caps
    assert huge["reduce_bucket_size"] == 500_000_000 and huge["stage3_max_live_parameters"] == 1_000_000_000
    # What the spec sets stays, under either of DeepSpeed's names.
    assert set(zero3_memory_defaults({"reduce_bucket_size": 5, "max_live_parameters": 7}, 10**7)) == \
        {"stage3_prefetch_bucket_size", "stage3_max_reuse_distance"}


def test_a_rank_imports_deepspeed_without_mlflow_or_compiling_muon_and_both_still_work_after():
    # In a fresh interpreter, as a rank's process is. DeepSpeed's autotuner imports MLflow when it
    # is installed, and its Muon module (which every ZeRO optimizer imports) applies torch.compile
    # when its functions are defined, importing torch._inductor: through airay neither happens,
    # MLflow still imports, and a Muon function is still the one compiled (at its first call).
    import subprocess
    import sys

    code = ("import sys; from airay.worker.deepspeed_compat import import_deepspeed; import_deepspeed(); "
            "import deepspeed.autotuning.autotuner as a; from deepspeed.runtime.zero.muon import original_muon as m; "
            "print('mlflow' in sys.modules, a.has_mlflow, 'torch._inductor.compile_fx' in sys.modules, "
            "m.zeropower_via_newtonschulz5.__wrapped__.__code__.co_name); import mlflow; print(mlflow.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # (after DeepSpeed's notice on stdout)
    assert out.stdout.split()[-5:] == ["False", "False", "False", "zeropower_via_newtonschulz5", "mlflow"], \
        out.stdout + out.stderr
    # A plain import pays both: the checks above can fail.
    plain = subprocess.run([sys.executable, "-c", "import sys, deepspeed; from deepspeed.runtime.zero.muon import "
                            "original_muon; print('mlflow' in sys.modules, 'torch._inductor.compile_fx' in sys.modules)"],
                           capture_output=True, text=True, timeout=120, check=True)
    assert plain.stdout.split()[-2:] == ["True", "True"]


def test_forget_locals_frees_what_a_failed_steps_frames_held_and_keeps_the_traceback_text():
    import gc
    import traceback
    import weakref

    from airay.worker.memory import forget_locals

    class Engine:  # stands for the engine a step's frames reach
        pass

    def step(engine):
        batch = [engine]  # noqa: F841 - a local the traceback's frame holds
        raise RuntimeError("peer gone")

    def train(engine):
        try:
            step(engine)
        except RuntimeError as exc:
            raise ConnectionError("collective failed") from exc  # a chain: the cause's frames too

    engine = Engine()
    alive = weakref.ref(engine)
    try:
        train(engine)
    except ConnectionError as exc:
        del engine
        gc.collect()
        assert alive() is not None  # held by the failed call's frames, whatever the collection
        forget_locals(exc)
        gc.collect()
        assert alive() is None
        text = "".join(traceback.format_exception(exc))
        assert "in step" in text and "peer gone" in text and "collective failed" in text

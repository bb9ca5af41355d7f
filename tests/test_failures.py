"""What an exception raised on a rank says failed (airay.worker.failures), by type and by message,
with the messages PyTorch, NCCL and Ray really print (cited in airay/worker/failures.py and
airay/health.py), and what the driver makes of each class (airay.health)."""

import pickle

import pytest
import torch
import torch.distributed as tdist

from airay.health import RankOutcome, actor_died, classify_round
from airay.worker.failures import GPUError, InternalError, NCCLError, failure_kind, named, raised_in_airay

# CUDA's own errors, as torch raises them (a RuntimeError before torch 2.8) and as NCCL reports them.
GPU_TEXTS = [
    "CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported at some other API "
    "call, so the stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "CUDA error: an illegal memory access was encountered",
    "CUDA error: uncorrectable ECC error encountered",
    "CUDA error: unspecified launch failure",
    "CUDA error: misaligned address",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, m, n, k, &falpha, a, "
    "CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &fbeta, c, CUDA_R_16BF, ldc, CUDA_R_32F, CUBLAS_GEMM_DFALT_TENSOR_OP)`",
    "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    "CUDA driver error: unknown error",
    "[Rank 0] NCCL watchdog thread terminated with exception: CUDA error: an illegal memory access was encountered",
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, unhandled cuda error (run with NCCL_DEBUG=INFO "
    "for details), NCCL version 2.20.5\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
    "Cuda failure 999 'unknown error'",
    "GPU 3 reported Xid 79: GPU has fallen off the bus",
]

# A peer's failure as the survivors' NCCL reports it: collateral, never the survivor's own.
COLLATERAL_NCCL_TEXTS = [
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:268, remote process exited or there was a network "
    "error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote process "
    "exiting prematurely.\nLast error:\nsocketProgressOpt: Call to recv from 172.17.0.3<33759> failed : Connection "
    "reset by peer",
    "NCCL communicator was aborted on rank 1.",
    "NCCL communicator was aborted on rank 1. Original reason for failure was: Work: WorkNCCL(OpType=ALLREDUCE, "
    "TensorShape=[1], Timeout(ms)=2000) timed out in call to wait().",
    "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, "
    "NumelOut=1, Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
    # NCCL 2.18 words a network error as an internal error; its last error says what it was.
    "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1333, internal error - please report this "
    "issue to the NCCL developers, NCCL version 2.18.1\nncclInternalError: Internal check failed.\nLast error:\n"
    "Socket recv failed while polling for opId=0x7f22ff731e10",
    "NCCL error: remote process exited or there was a network error, NCCL version 2.20.5 ncclRemoteError: A call "
    "failed possibly due to a network error or a remote process exiting prematurely. Last error: NET/IB : Got completion "
    "from peer 172.21.17.89<38536> with error 5, opcode 48, len 32710, vendor err 249",
]

# NCCL failing in this process, with nothing saying a peer caused it.
OWN_NCCL_TEXTS = [
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, internal error - please report this issue to "
    "the NCCL developers, NCCL version 2.21.5\nncclInternalError: Internal check failed.\nLast error:\n"
    "Attribute busid of node nic not found",
    "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1269, unhandled system error (run with "
    "NCCL_DEBUG=INFO for details), NCCL version 2.14.3\nncclSystemError: System call (e.g. socket, malloc) or "
    "external library call failed or device error.",
    "NCCL error in: ../torch/lib/c10d/ProcessGroupNCCL.cpp:825, internal error, NCCL version 2.7.8",
]


@pytest.mark.parametrize("text", GPU_TEXTS)
def test_cuda_errors_are_the_gpus_by_message(text):
    assert failure_kind(RuntimeError(text)) == "gpu"
    assert failure_kind(tdist.DistBackendError(text)) == "gpu"  # raised by a collective: still this GPU's


def test_cuda_errors_are_the_gpus_by_type():
    assert failure_kind(torch.AcceleratorError("CUDA error: device-side assert triggered")) == "gpu"
    assert failure_kind(torch.AcceleratorError("HIP error: unspecified launch failure")) == "gpu"
    # CUDA's allocator running out stays what it was: the machine's memory, raised as is (outcome oom).
    assert failure_kind(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == "infra"
    assert failure_kind(torch.cuda.OutOfMemoryError("CUDA out of memory")) == "infra"
    assert failure_kind(MemoryError()) == "infra"
    # Only RuntimeErrors are read: a TypeError or ValueError is code's, whatever its message says.
    assert failure_kind(ValueError("CUDA error: device-side assert triggered")) == "user"


@pytest.mark.parametrize("text", COLLATERAL_NCCL_TEXTS)
def test_a_peers_failure_seen_through_nccl_stays_a_communication_error(text):
    assert failure_kind(tdist.DistBackendError(text)) == "comm"
    assert failure_kind(RuntimeError(text)) == "comm"


@pytest.mark.parametrize("text", OWN_NCCL_TEXTS)
def test_nccls_own_failures_are_named(text):
    assert failure_kind(tdist.DistBackendError(text)) == "nccl"


def test_other_collective_failures_and_plain_user_errors_keep_their_kind():
    assert failure_kind(tdist.DistNetworkError("Connection reset by peer")) == "comm"
    assert failure_kind(tdist.DistStoreError("Socket Timeout")) == "comm"
    assert failure_kind(ConnectionAbortedError("the rendezvous on 10.0.0.1:29500 was aborted")) == "comm"
    assert failure_kind(RuntimeError("Broken pipe while reading my dataset over HTTP")) == "user"  # not NCCL's
    assert failure_kind(RuntimeError("shape mismatch: illegal value")) == "user"


def _user_code():
    return {}["missing"]


def _in_a_collective(fn):
    """Run `fn` from a frame whose file is torch.distributed's (as a hook a collective calls)."""
    ns = {}
    source = "def collective(fn):\n    return fn()\n"
    exec(compile(source, "/x/site-packages/torch/distributed/fake_c10d.py", "exec"), ns)
    return ns["collective"](fn)


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        return exc
    raise AssertionError("did not raise")


def test_an_exception_raised_in_airays_code_is_airays_own():
    from airay.data.source import StreamedSource, collate

    loader = _raised(collate, [])  # a loader's IndexError, raised in airay/data/source.py
    assert isinstance(loader, IndexError) and raised_in_airay(loader) and failure_kind(loader) == "internal"
    unfed = _raised(StreamedSource.micro_batches, StreamedSource.__new__(StreamedSource), 3, 0, None)
    assert failure_kind(unfed) == "internal"  # "no data was fed for step 3": a driver/worker bug


def test_exceptions_of_user_code_collectives_and_airays_named_outcomes_are_not_airays_own():
    from airay.checkpoint.loading import CheckpointUnavailable
    from airay.data.source import collate
    from airay.models import tiny_gpt

    assert failure_kind(_raised(_user_code)) == "user"  # innermost frame: this file
    assert failure_kind(_raised(tiny_gpt.loss, None, {})) == "user"  # the example models are the user's side
    # torch.distributed raised it (no process group): a collective's, not airay's.
    dist = _raised(tdist.all_reduce, torch.zeros(1))
    assert "torch/distributed" in dist.__traceback__.tb_next.tb_frame.f_code.co_filename.replace("\\", "/")
    assert not raised_in_airay(dist)
    # airay's code, called back from inside a collective: the collective's failure.
    assert not raised_in_airay(_raised(_in_a_collective, lambda: collate([])))

    def unavailable():
        raise CheckpointUnavailable("no good copy of rank 1's file", 5)

    assert not raised_in_airay(_raised(unavailable))
    assert not raised_in_airay(_raised(open, "/nonexistent/airay-file"))  # OSError: the machine's


def test_a_named_failure_carries_rank_exception_and_traceback_and_survives_pickling():
    from airay.data.source import collate

    err = named(_raised(collate, []), 3)
    assert isinstance(err, InternalError)
    text = str(err)
    assert text.startswith("rank 3: IndexError: list index out of range") and "airay/data/source.py" in text
    assert "Traceback (most recent call last)" in text
    gpu = named(torch.AcceleratorError("CUDA error: device-side assert triggered"), 0)
    assert isinstance(gpu, GPUError) and "device-side assert" in str(gpu)
    assert isinstance(named(tdist.DistBackendError(OWN_NCCL_TEXTS[0]), 1), NCCLError)
    for exc in (err, gpu):  # Ray pickles a task's exception back to the driver
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
    assert named(ValueError("a user's bug"), 0) is None and named(err, 0) is None  # not renamed twice


# ---- what the driver makes of them (airay.health) ------------------------------------------


def _errored(rank, cause, error="x"):
    return RankOutcome(rank, "errored", error, cause=cause)


def test_a_gpu_error_loses_its_rank_and_leaves_the_survivors_collateral():
    v = classify_round([_errored(0, "DistBackendError", "NCCL communicator was aborted"), _errored(1, "GPUError"),
                        RankOutcome(2, "ok")])
    assert v.kind == "lost" and v.lost_ranks == (1,) and v.outcomes[1].fault == "gpu_error" and v.outcomes[1].infra
    # A GPU error on one rank wins over a user error on another (the device fault came first).
    v = classify_round([RankOutcome(0, "errored", "ValueError", user_error=True, cause="UserCodeError"),
                        _errored(1, "GPUError")])
    assert v.kind == "lost" and v.lost_ranks == (1,)


def test_an_nccl_error_is_its_ranks_own_only_when_it_stands_out():
    # One rank's NCCL failed, the others' collectives were aborted behind it: that rank is replaced.
    v = classify_round([_errored(0, "NCCLError"), _errored(1, "DistBackendError"), _errored(2, "DistBackendError")])
    assert v.kind == "lost" and v.lost_ranks == (0,) and v.outcomes[0].fault == "nccl_error"
    # Every rank reports one: the network's (or a peer's), not any rank's own: the world re-forms.
    v = classify_round([_errored(0, "NCCLError"), _errored(1, "NCCLError")])
    assert v.kind == "comm_error" and v.lost_ranks == ()
    # A peer died: the survivors' NCCL errors are its echo.
    v = classify_round([_errored(0, "NCCLError"), RankOutcome(1, "died"), _errored(2, "NCCLError")])
    assert v.kind == "lost" and v.lost_ranks == (1,)
    assert classify_round([_errored(0, "NCCLError")]).lost_ranks == (0,)  # a world of one: no peer to blame
    assert not _errored(0, "NCCLError").infra  # alone it says nothing: the round decides


def test_airays_own_error_comes_after_losses_user_errors_and_data_but_before_comm():
    internal = _errored(1, "InternalError", "rank 1: IndexError: list index out of range\nTraceback ...")
    comm = _errored(0, "DistBackendError", "NCCL communicator was aborted")
    v = classify_round([comm, internal, RankOutcome(2, "ok")])
    assert v.kind == "internal_error" and v.rank == 1 and v.lost_ranks == ()
    assert "rank 1" in v.message and "Traceback" in v.message and v.outcomes[1].fault == "internal_error"
    assert classify_round([internal, RankOutcome(0, "died")]).kind == "lost"
    user = RankOutcome(0, "errored", "ValueError", True, "UserCodeError")
    assert classify_round([internal, user]).kind == "user_error"
    assert classify_round([internal, _errored(0, "DataFetchError")]).kind == "data_lost"


def test_a_rank_killed_by_rays_memory_monitor_is_recorded_as_oom():
    # Ray 2.55 and later (this machine's Ray 2.60), as an ActorDiedError's text for a dead actor.
    new = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainWorker\n\tactor_id: 8e0f\n"
           "\tpid: 4242\n\tip: 192.0.2.2\n2 worker(s) were killed due to the node running low on memory. Memory on the "
           "node (IP: 192.0.2.2, ID: 5944bc) was 21.84GB used / 23.54GB limit (0.927782)\nRefer to the documentation "
           "on how to address the out of memory issue")
    o = actor_died(1, "ActorDiedError", new)
    assert (o.kind, o.fault, o.infra) == ("died", "oom", True)
    assert o.error.startswith("2 worker(s) were killed due to the node running low on memory") and "21.84GB" in o.error
    # Before Ray 2.55: "Task was killed ...", the node's memory on the next line.
    old = ("Task was killed due to the node running low on memory.\nMemory on the node (IP: 10.0.62.231, ID: e5d9) "
           "where the task (actor ID: 43534c, name=TrainWorker.train, pid=11362, memory used=1.25GB) was running was "
           "27.71GB / 28.80GB (0.962273), which exceeds the memory usage threshold of 0.95.\nRay killed this worker")
    o = actor_died(2, "OutOfMemoryError", old)
    assert o.fault == "oom" and "27.71GB / 28.80GB" in o.error and "\n" not in o.error
    # Any other death stays a death, with its first line.
    o = actor_died(3, "ActorDiedError", "The actor died unexpectedly before finishing this task.\n\tpid: 7")
    assert (o.fault, o.error, o.cause) == ("died", "The actor died unexpectedly before finishing this task.",
                                           "ActorDiedError")
    assert actor_died(0, "ActorUnavailableError", "").error == "ActorUnavailableError"

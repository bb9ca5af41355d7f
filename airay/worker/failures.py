"""What an exception raised on a rank says failed, decided where it was raised: the traceback is
here, the driver only sees what comes back. The answer travels as the class of the exception the
rank raises (RankError's subclasses below; airay.health reads their names):

- infra: the machine's host or GPU memory ran out (MemoryError, CUDA out of memory): raised as is.
- gpu: a CUDA error on this rank's device (GPUError): the process's CUDA context is unusable
  (CUDA's errors are sticky), so the rank is replaced, never reused.
- nccl: NCCL failed in this process (NCCLError): the rank's own fault unless the round says
  otherwise (airay.health.classify_round).
- comm: a collective failed because a peer died, the network broke or the driver aborted the
  world: raised as is; the world re-forms without replacing anyone.
- data: a block of the step could not be fetched (airay.data.source.DataFetchError): as is.
- internal: airay's own code raised it (InternalError): retried once, then the run fails.
- user: the user's model, loss or data code raised it (UserCodeError, made by the worker
  around those calls); elsewhere an exception nothing here names stays as it was.

Pure: no Ray; torch is imported only to check a type.
"""

from __future__ import annotations

import os
import re
import traceback

_AIRAY_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The example models (airay.models) are the user's side of the line: a bug there is a model's.
_USER_SIDE_DIRS = (os.path.join(_AIRAY_DIR, "models") + os.sep,)
# Frames of the collectives: an exception raised while inside one is the collective's failure.
_COMM_FRAMES = re.compile(r"[/\\](torch[/\\]distributed|deepspeed[/\\]comm)[/\\]")


class RankError(RuntimeError):
    """An exception on a rank, named by what failed; its message holds the rank, the original
    exception and its traceback (Ray pickles it back to the driver as a message only)."""


class UserCodeError(RankError):
    """An exception raised by the user's model, loss or data code: retrying will not fix it."""


class GPUError(RankError):
    """A CUDA error on this rank's device (a device-side assert after an Xid, an ECC error, an
    illegal address, a failed launch): infrastructure. The process is replaced: a CUDA context
    that saw such an error fails every later call."""


class NCCLError(RankError):
    """NCCL's own failure in this process (a system or internal error), not a peer's death."""


class InternalError(RankError):
    """An exception raised in airay's own code on this rank: neither a collective's failure nor
    the user's. A bug of airay's: retried once (a transient state), then the run fails with it."""


# CUDA's errors as torch and NCCL word them. torch's C10_CUDA_CHECK raises "CUDA error: " + CUDA's
# own string (a RuntimeError; torch.AcceleratorError since torch 2.8), e.g. "CUDA error:
# device-side assert triggered" (pytorch/pytorch#74079, karpathy/nanoGPT#470), "CUDA error: an
# illegal memory access was encountered" (vllm-project/vllm#4108, also as "NCCL watchdog thread
# terminated with exception: CUDA error: ..."), "uncorrectable ECC error encountered",
# "unspecified launch failure" (in torch's own tests as "AcceleratorError: HIP error: unspecified
# launch failure", torch/testing/_internal/common_methods_invocations.py), "CUDA error:
# CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"; the driver API's "CUDA
# driver error: ..."; cuDNN's "cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"; NCCL's "unhandled
# cuda error ... ncclUnhandledCudaError: Call to CUDA function failed. Last error: Cuda failure
# 999 'unknown error'" (NVIDIA/nccl#1410, #1935). "Xid" is the kernel driver's name for a GPU
# fault, as health checks report it. Only RuntimeErrors: a TypeError or ValueError is code's.
_GPU_TEXT = re.compile(
    r"\bCUDA (driver )?error\b|\bunhandled cuda error\b|ncclUnhandledCudaError|\bCuda failure\b"
    r"|device-side assert|illegal memory access|an illegal instruction was encountered|misaligned address"
    r"|uncorrectable ECC error|unspecified launch failure"
    r"|CUBLAS_STATUS_(EXECUTION_FAILED|INTERNAL_ERROR|ALLOC_FAILED)"
    r"|CUDNN_STATUS_(EXECUTION_FAILED|INTERNAL_ERROR|MAPPING_ERROR|ALLOC_FAILED)|\bXid\b",
    re.IGNORECASE)

# A peer's failure as this rank's collective reports it, on every rank that waited for the peer:
# NCCL's ncclRemoteError ("remote process exited or there was a network error ... ncclRemoteError:
# A call failed possibly due to a network error or a remote process exiting prematurely. Last
# error: socketProgressOpt: Call to recv from ... failed : Connection reset by peer",
# NVIDIA/nccl#2076, #934), its socket transport's "Connection closed by remote peer", "Broken
# pipe" and "Socket recv failed while polling" (NVIDIA/nccl#795, #1546), InfiniBand's "Got
# completion from peer ... with error" (deepseek-ai/DeepEP#106), a communicator aborted by torch
# or by the driver's abort_world ("NCCL communicator was aborted on rank 1.", pytorch/pytorch#64241),
# the watchdog's timeout ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5,
# OpType=ALLREDUCE, ...) ran for 600013 milliseconds before timing out", NVIDIA/Megatron-LM#1207).
_COLLATERAL_TEXT = re.compile(
    r"remote process exited|ncclRemoteError|Connection closed by|reset by peer|Broken pipe|Socket recv failed"
    r"|completion from peer|communicator was aborted|Watchdog caught collective operation timeout"
    r"|timed out in call to wait", re.IGNORECASE)

# NCCL's failures in this process: ncclSystemError ("unhandled system error": a system call or
# library on this host failed) and ncclInternalError ("internal error - please report this issue
# to the NCCL developers", NVIDIA/nccl#1092, #1247). Neither is surely this rank's fault: NCCL 2.18
# reports every network error as an internal error (NVIDIA/nccl#1092), and torch once reported
# aborted communicators as system errors (pytorch/pytorch#64241): the driver decides with the
# whole round in view.
_NCCL_OWN_TEXT = re.compile(
    r"ncclSystemError|ncclInternalError|NCCL error[^\n]*\b(unhandled system error|internal error)\b")

# gloo's and NCCL's own messages, by where they come from: gloo prefixes its errors with its
# source path ("[.../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error ..."), NCCL's
# name the library. Not bare words like "timed out": a user's RuntimeError says those too.
_COMM_ERROR_TEXT = re.compile(r"\[[^\]]*gloo/(transport|common)/[^\]]*\]|\bProcessGroup(Gloo|NCCL)\b|\bNCCL error\b")


def failure_kind(exc: BaseException) -> str:
    """What an exception raised on a rank says failed: "infra", "gpu", "nccl", "comm", "data",
    "internal" or "user" (see the module's doc), by its type where it has one, else by its text
    (CUDA's, NCCL's and gloo's errors are RuntimeErrors told apart by their messages), else by
    whose code raised it. "user" for whatever nothing else names: around user code that is the
    user's; elsewhere the driver takes an unnamed exception for a collective's failure."""
    import torch
    import torch.distributed as tdist

    from airay.data.source import DataFetchError

    if isinstance(exc, RankError):  # named already (its message quotes a traceback: not read again)
        return _KINDS[type(exc)]
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return "infra"
    text = str(exc) if isinstance(exc, RuntimeError) else ""
    accelerator = getattr(torch, "AcceleratorError", ())  # torch 2.8+
    if isinstance(exc, accelerator) or _GPU_TEXT.search(text):
        return "gpu"  # before the collateral texts: a CUDA error in a message is always this process's
    if isinstance(exc, DataFetchError):
        return "data"
    nccl = "NCCL" in text  # NCCL's messages name it (a user's "Broken pipe" is not a collective's)
    if nccl and _COLLATERAL_TEXT.search(text):
        return "comm"
    if nccl and _NCCL_OWN_TEXT.search(text):
        return "nccl"
    if isinstance(exc, (tdist.DistError, ConnectionError)):
        return "comm"
    if type(exc) is RuntimeError and _COMM_ERROR_TEXT.search(text):
        return "comm"
    if raised_in_airay(exc):
        return "internal"
    return "user"


def raised_in_airay(exc: BaseException) -> bool:
    """Whether airay's own code raised `exc`: its innermost frame is in the airay package (its
    example models aside), no frame of a collective (torch.distributed, deepspeed.comm) is on the
    way, and it is not one of airay's own exception types (those name an outcome the driver
    handles: CheckpointUnavailable, DataFetchError, ...) nor an OSError (the machine's: a full
    disk, a lost file system)."""
    if isinstance(exc, OSError) or type(exc).__module__.split(".")[0] == "airay":
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or any(_COMM_FRAMES.search(f.filename) for f in frames):
        return False
    path = os.path.abspath(frames[-1].filename)
    return path.startswith(_AIRAY_DIR) and not path.startswith(_USER_SIDE_DIRS)


def describe(exc: BaseException, rank: int | None) -> str:
    """`exc` for the driver: the rank, the exception and its traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{'' if rank is None else f'rank {rank}: '}{type(exc).__name__}: {exc}\n{tb}"


_NAMED = {"gpu": GPUError, "nccl": NCCLError, "internal": InternalError}
_KINDS = {UserCodeError: "user", **{cls: kind for kind, cls in _NAMED.items()}}


def named(exc: BaseException, rank: int | None) -> RankError | None:
    """The exception a rank raises in place of `exc` (a GPUError, NCCLError or InternalError),
    or None: `exc` is raised as it is."""
    if isinstance(exc, RankError):
        return None
    cls = _NAMED.get(failure_kind(exc))
    return cls(describe(exc, rank)) if cls is not None else None

"""What this process does in torch.distributed collectives: how long it is blocked in them (the
"communication" part of a step's time), and how many it has entered and left (its place inside a
step, for the driver's hang watch: airay.health.position).

What is measured: wall time inside the collective calls of torch.distributed (and inside
`Work.wait()` for ones issued with async_op=True), outermost call only. With gloo (CPU) the
calls are synchronous, so this is the whole collective — transfer plus waiting for the slowest
peer to arrive. With NCCL the calls return once the kernel is queued, so this counts the host
time blocked (waits, barriers, CPU-side syncs) and not communication that overlaps compute on
the GPU's streams; it is a lower bound there. Collectives queued under a coalescing manager
(ZeRO-3's parameter gathers) run at the manager's exit and are not counted.

Counts are of the same outermost calls: a rank that has entered k collectives of a step while its
peers have entered k + 1 is the one they wait for. (With NCCL the calls return once queued, so the
host's counts tell only where a host thread stopped; airay.worker.dist.collective_counts reads
torch's per-group counters for the device's view.) `before_collective` lets chaos stop a rank
just before one of them (stall_collective).

DeepSpeed binds some of these functions when its backend is created, so `install` must run
before `deepspeed.init_distributed` (the worker calls it at start).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable

COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "_all_gather_base", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
    "broadcast_object_list", "all_gather_object", "send", "recv",
)

_total = 0.0
_entered = 0  # outermost collective calls begun
_left = 0  # ... and returned (or raised)
_before: tuple[int, Callable[[], None]] | None = None  # (the call number, what to do just before it)
_local = threading.local()
_installed = False


def seconds() -> float:
    """Seconds blocked in collectives by this process since `install` (monotonic; take deltas)."""
    return _total


def calls() -> tuple[int, int]:
    """(entered, left): outermost collective calls begun and ended since `install` (take deltas)."""
    return _entered, _left


def before_collective(n: int, action: Callable[[], None]) -> None:
    """Run `action` in the calling thread just before the n-th collective call from now (n >= 1)."""
    global _before
    _before = (_entered + n, action)


def disarm() -> bool:
    """Forget before_collective's action; whether it was still waiting (its call never came)."""
    global _before
    waiting, _before = _before is not None, None
    return waiting


def _timed(fn, counted: bool = True):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _total, _entered, _left, _before
        depth = getattr(_local, "depth", 0)
        if depth:  # a collective built from others: time the outermost call only
            return fn(*args, **kwargs)
        if counted and _before is not None and _entered + 1 >= _before[0]:
            action, _before = _before[1], None
            action()
        _local.depth = 1
        if counted:
            _entered += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _total += time.perf_counter() - t0
            if counted:
                _left += 1
            _local.depth = 0

    wrapper.__airay_timed__ = True
    return wrapper


def install() -> None:
    """Wrap torch.distributed's collectives (both of its namespaces) once per process."""
    global _installed
    if _installed:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    wrapped: dict[int, object] = {}
    for module in (c10d, dist):
        for name in COLLECTIVES:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "__airay_timed__", False):
                continue
            # torch.distributed re-exports c10d's functions: wrap each function object once.
            new = wrapped.setdefault(id(fn), _timed(fn))
            setattr(module, name, new)
    work = getattr(dist, "Work", None)
    if work is not None and not getattr(work.wait, "__airay_timed__", False):
        work.wait = _timed(work.wait, counted=False)  # waits on a call already counted
    _installed = True

"""How long this process is blocked in torch.distributed collectives: the "communication" part
of a step's time.

What is measured: wall time inside the collective calls of torch.distributed (and inside
`Work.wait()` for ones issued with async_op=True), outermost call only. With gloo (CPU) the
calls are synchronous, so this is the whole collective — transfer plus waiting for the slowest
peer to arrive. With NCCL the calls return once the kernel is queued, so this counts the host
time blocked (waits, barriers, CPU-side syncs) and not communication that overlaps compute on
the GPU's streams; it is a lower bound there. Collectives queued under a coalescing manager
(ZeRO-3's parameter gathers) run at the manager's exit and are not counted.

DeepSpeed binds some of these functions when its backend is created, so `install` must run
before `deepspeed.init_distributed` (the worker calls it at start).
"""

from __future__ import annotations

import functools
import threading
import time

COLLECTIVES = (
    "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
    "_all_gather_base", "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "barrier", "gather", "scatter",
    "broadcast_object_list", "all_gather_object", "send", "recv",
)

_total = 0.0
_local = threading.local()
_installed = False


def seconds() -> float:
    """Seconds blocked in collectives by this process since `install` (monotonic; take deltas)."""
    return _total


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        global _total
        depth = getattr(_local, "depth", 0)
        if depth:  # a collective built from others: time the outermost call only
            return fn(*args, **kwargs)
        _local.depth = 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _total += time.perf_counter() - t0
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
        work.wait = _timed(work.wait)
    _installed = True

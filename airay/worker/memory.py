"""A process's peak host memory over a stretch of work (Linux: /proc/self), e.g. what building a
rank's model and engine cost it, which ZeRO-3 must keep to the rank's partition plus a layer;
and handing the C heap's free pages back (glibc), so freed tensors stop counting."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


def _status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key)), None)
    except OSError:
        return None


def start_peak() -> int | None:
    """Reset the process's peak RSS (the kernel's high-water mark) and return the RSS now; None
    where /proc does not offer it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status("VmRSS")


def peak_since(start: int | None) -> int | None:
    """Bytes the peak RSS rose above `start` (start_peak's) since then."""
    peak = _status("VmHWM")
    return None if start is None or peak is None else max(0, peak - start)


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def trim_heap() -> bool:
    """Give the C heap's free pages back to the OS: glibc's malloc_trim(0), which releases whole
    free pages anywhere in the heap, not only at its top. glibc keeps freed blocks below its
    (dynamic, up to 32 MiB) mmap threshold in the heap, so tensors a process has freed (a
    layer's full parameters once partitioned, the engine of the world before) stay in its RSS
    until then. False where the C library has no malloc_trim."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def release_heap() -> None:
    """Collect Python's garbage (reference cycles hold engines and state dicts), then trim_heap:
    what a dropped engine or a finished load held leaves the RSS now."""
    import gc

    gc.collect()
    trim_heap()


def forget_locals(exc: BaseException) -> None:
    """Clear the local variables of the finished frames `exc`'s traceback holds, and those of
    the exceptions it was raised from. A failed step's frames reach the engine (its module, its
    optimizer, the step's activations): while the exception lives (the rest of the failed call,
    Ray's report of it) no collection can free them. The line numbers stay for the traceback's
    text; frames still running are left as they are."""
    import traceback

    pending, seen = [exc], set()
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        pending += [e.__cause__, e.__context__]

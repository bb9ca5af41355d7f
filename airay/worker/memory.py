"""A process's peak host memory over a stretch of work (Linux: /proc/self), e.g. what building a
rank's model and engine cost it, which ZeRO-3 must keep to the rank's partition plus a layer."""

from __future__ import annotations


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

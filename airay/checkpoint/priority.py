"""The CPU priority of a checkpoint's background work: below the training step's.

A save returns to the step loop once its tensors are staged; its files' peer copies, their
receipt on the peer node and its durable upload run beside the next steps, on the same host cores
as the step loop, the data pipeline's workers and the collectives' threads. Where those cores are
all busy the background work takes them from the step: on a 2-CPU machine a save every 2 steps
made the step beside it 2-3x as long (benchmarks/checkpoint.py, `step_after_save_s`). The threads
doing that work run at `checkpoint.background_priority`:

- "idle": Linux's SCHED_IDLE, the CPU time no other thread wants (idle cores, a node of 8 GPUs
  has many, serve the work as before);
- "low": the lowest nice value, 19 (Ray starts its workers, step loop included, at nice 15:
  RAY_worker_niceness; a nice value only counts against the others');
- "normal": the step loop's own.

The writes of the save itself keep the step loop's priority: the next save waits for them.
"""

from __future__ import annotations

import os
import threading

PRIORITIES = ("idle", "low", "normal")
LOWEST_NICE = 19


def lower_this_thread(priority: str) -> bool:
    """Put the calling thread at `priority` (PRIORITIES; Linux schedules threads as tasks: this
    thread only; elsewhere nothing). Never raises it back: an unprivileged process cannot, so
    each thread this is called on must serve background work alone. Returns whether the thread
    now runs at `priority`."""
    if priority not in PRIORITIES:
        raise ValueError(f"background priority {priority!r}: use one of {', '.join(PRIORITIES)}")
    if priority == "normal" or not hasattr(os, "sched_setscheduler"):
        return False
    tid = threading.get_native_id()
    try:
        if priority == "idle":
            if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        elif os.getpriority(os.PRIO_PROCESS, tid) < LOWEST_NICE:
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST_NICE)
        return True
    except OSError:  # not permitted (a sandbox): the work runs at the step's priority
        return False

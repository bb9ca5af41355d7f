"""A save's background threads run below the step loop's priority (airay.checkpoint.priority)."""

import os
import threading

import pytest

from airay.checkpoint.priority import LOWEST_NICE, lower_this_thread


def _in_thread(*priorities):
    """In a new thread: lower_this_thread of each priority in turn, then (the last one's result,
    the thread's scheduling policy, its nice value)."""
    out = {}

    def run():
        for priority in priorities:
            out["result"] = lower_this_thread(priority)
        tid = threading.get_native_id()
        out["policy"], out["nice"] = os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["result"], out["policy"], out["nice"]


def test_only_the_calling_thread_is_lowered_and_never_raised_back():
    tid = threading.get_native_id()
    policy, nice = os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)
    assert policy == os.SCHED_OTHER and nice < LOWEST_NICE, "run the tests at normal priority"
    assert _in_thread("idle") == (True, os.SCHED_IDLE, nice)
    assert _in_thread("low") == (True, os.SCHED_OTHER, LOWEST_NICE)
    assert (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)) == (policy, nice)  # not this thread
    # "normal" leaves a thread as it is (an unprivileged process could not take a lowering back).
    assert _in_thread("normal") == (False, policy, nice)
    assert _in_thread("low", "normal") == (False, os.SCHED_OTHER, LOWEST_NICE)
    with pytest.raises(ValueError, match="use one of idle, low, normal"):
        lower_this_thread("high")

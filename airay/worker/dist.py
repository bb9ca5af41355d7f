"""A worker's process groups: rendezvous port, leaving a broken world fast, and telling a
collective's failure (or the machine's) from a bug in user code.
"""

from __future__ import annotations

import os
import re
import socket
import stat

# NCCL's watchdog, on a collective error or timeout (a peer died): 2 = abort the communicators
# and raise in the waiting thread, keep the process. torch's default (3) tears the process down,
# which would take every survivor with the dead peer and turn a one-rank loss into a restart.
NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def free_port() -> int:
    # Bind to port 0 and release it: the rendezvous port rank 0 will listen on. The tiny race
    # (another process taking it) fails the join, which is retried like any other fault.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def tcp_socket_fds() -> dict[int, int]:
    """{fd: inode} of this process's connected TCP sockets (listeners are left out: gloo's
    listener thread aborts the process if its socket is shut down under it)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode):
            continue
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                    s.getpeername()  # raises for a listening or unconnected socket
                    out[fd] = st.st_ino
        except OSError:
            continue
    return out


def shutdown_sockets(fds: dict[int, int]) -> int:
    """shutdown() the given sockets (if still the same inode); returns how many.

    shutdown acts on the socket, not the descriptor, so doing it through a dup wakes any thread
    blocked on it, and the peer sees EOF at once, while the owner (gloo) still owns and later
    closes the original descriptor: no descriptor is closed under it or reused.
    """
    n = 0
    for fd, inode in fds.items():
        try:
            if os.fstat(fd).st_ino != inode:
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
        except OSError:
            continue
    return n


def abort_nccl_groups() -> None:
    """Abort every NCCL communicator of this process (DeepSpeed makes groups besides the default
    one, e.g. ZeRO's data-parallel group): `_abort_process_group()` without a group aborts them
    all, inside one ncclGroupStart/End so their aborts cannot deadlock each other (torch 2.4+)."""
    from torch.distributed import distributed_c10d as c10d

    if c10d.is_initialized():
        c10d._abort_process_group()


_COMM_ERROR_TEXT = re.compile(r"\bgloo\b|\bnccl\b|connection (reset|closed|refused)|timed out", re.IGNORECASE)


def failure_kind(exc: BaseException) -> str:
    """What an exception raised in a training step says failed, by its type where it has one:
    "infra" (the machine: host or GPU memory; replace the worker), "comm" (a collective: a
    peer died or the network broke; re-form the world), "data" (a block could not be fetched:
    re-run the round) or "user" (the user's model, loss or data code: retrying will not help).
    gloo's transport errors are plain RuntimeErrors naming gloo's source, so those are told by
    their text (only RuntimeErrors: a TypeError from a model factory is the user's, whatever
    its message says)."""
    import torch
    import torch.distributed as tdist

    from airay.data.source import DataFetchError

    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return "infra"
    if isinstance(exc, DataFetchError):
        return "data"
    if isinstance(exc, tdist.DistError):
        return "comm"
    if type(exc) is RuntimeError and _COMM_ERROR_TEXT.search(str(exc)):
        return "comm"
    return "user"

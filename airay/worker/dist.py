"""A worker's process groups: rendezvous port, leaving a broken world fast, NCCL's error
handling. What an exception says failed is airay.worker.failures' to decide.
"""

from __future__ import annotations

import os
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


def listen_socket(host: str) -> socket.socket:
    """A listening socket on `host` (the node's address), port chosen by the kernel: rank 0's
    rendezvous store serves on it (`rendezvous_store`). Held from the moment the port is handed
    out, so no other process can take the port first, and bound to the node's address only:
    torch's TCPStore on its own listens on every interface."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    return sock


def rendezvous_store(master_addr: str, master_port: int, world_size: int, timeout, listening=None,
                     aborted=lambda: False):
    """The world's TCPStore: served by rank 0 on its `listening` socket (listen_socket), which
    the store takes over; a client on the other ranks. A client first waits for the server to
    accept connections itself, asking `aborted()` between tries: torch's client retries a
    refused connection until its timeout, and a socket not yet connected cannot be shut down
    (a world whose rank 0 already gave up would hold this rank for the whole timeout)."""
    import time

    import torch.distributed as tdist

    if listening is not None:
        return tdist.TCPStore(master_addr, master_port, world_size, True, timeout, master_listen_fd=listening.detach())
    deadline = time.time() + timeout.total_seconds()
    while True:
        if aborted():
            raise ConnectionAbortedError(f"the rendezvous on {master_addr}:{master_port} was aborted")
        try:
            socket.create_connection((master_addr, master_port), timeout=1.0).close()
            break
        except OSError:
            if time.time() >= deadline:
                raise
            time.sleep(0.05)
    return tdist.TCPStore(master_addr, master_port, world_size, False, timeout)


def reset_group_count() -> None:
    """torch (2.13) names the default process group from a counter, `_world.group_count`, the
    prefix of its keys in the store; destroy_process_group sets it back to 0. A world that fails
    to form leaves it advanced on the ranks that got far enough, and not on the others: their
    next world would wait for each other's keys under different names until the timeout. Every
    join starts from 0, as after a clean destroy."""
    from torch.distributed import distributed_c10d as c10d

    if not c10d.is_initialized():
        c10d._world.group_count = 0


def group_status(backend: str) -> dict[str, dict] | None:
    """torch's collective counters of every process group this process has made, by group id:
    {"last_enqueued_collective", "last_started_collective", "last_completed_collective"}, from
    the flight recorder's dump without its entries (it needs no TORCH_FR_BUFFER_SIZE; about 5 us
    on gloo, torch 2.13). None where this torch has no such dump.

    NCCL's come from the CUDA build's own recorder, read only with TORCH_NCCL_ENABLE_TIMING=1:
    only then does NCCL record when a collective started on the device, which tells a rank
    whose GPU never reached collective k from its peers waiting inside it (its "completed" is
    what NCCL's watchdog saw finish; the host's calls, airay.commtime, return once queued).
    NOT VERIFIED ON A GPU (none was at hand): that the dump answers promptly from the heartbeat
    thread while a device is stuck, and what it reports then, are for the first GPU check."""
    import pickle

    from torch._C import _distributed_c10d as c10d

    if backend == "nccl" and os.environ.get("TORCH_NCCL_ENABLE_TIMING") != "1":
        return None
    dump = getattr(c10d, "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace", None)
    if dump is None:
        return None
    try:
        return pickle.loads(dump(includeCollectives=False, includeStackTraces=False))["pg_status"]
    except Exception:  # a debug interface: its absence or change must never fail a heartbeat
        return None


def collective_counts(status: dict[str, dict] | None, old: frozenset[str]) -> list[int] | None:
    """[completed, started, enqueued] collectives summed over the groups of `status` not in
    `old` (the groups that existed before this world: torch keeps destroyed groups' counters).
    Every group of a data-parallel world holds every rank, so the sums of two ranks of one
    world compare: the rank with fewer is behind. None without a status."""
    if status is None:
        return None
    keys = ("last_completed_collective", "last_started_collective", "last_enqueued_collective")
    groups = [g for pg, g in status.items() if pg not in old]
    return [sum(int(g.get(k, -1)) for g in groups) for k in keys]


def tcp_socket_fds(port: int | None = None) -> dict[int, int]:
    """{fd: inode} of this process's connected TCP sockets (listeners are left out: gloo's
    listener thread aborts the process if its socket is shut down under it); with `port`, only
    those with that port at either end (a rendezvous store's connections)."""
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
                    peer = s.getpeername()  # raises for a listening or unconnected socket
                    if port is None or port in (peer[1], s.getsockname()[1]):
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

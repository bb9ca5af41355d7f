"""Fault injection at named points (the spec's `chaos:` list), so tests and demos use one path.

The driver decides which rank gets which fault at which step (`round_faults`, pure); the worker
strikes it inside the step (`strike`), where a real fault of that kind would happen. Faults that
act on checkpoints or nodes (CHECKPOINT_FAULTS, remove_node, add_node) are carried out by the
driver, and so are the data faults (lose_data_block, stall_data_block): the driver
hands the round a step whose rows for one rank come from a bad block (`spoil_rows`, `bad_block`).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

# Faults a worker strikes inside its step; the rest act on the cluster or on files.
STEP_FAULTS = ("kill_worker", "hang_worker", "raise_in_user_code", "oom_worker", "slow_worker", "raise_in_airay",
               "device_error", "stall_collective")

# How far above its current address space a worker told to run out of memory may grow: small,
# so the fault never takes memory from the rest of a shared machine.
OOM_HEADROOM_BYTES = 128 * 1024**2


class ChaosError(ValueError):
    """What raise_in_user_code raises, as the user's code would."""


def round_faults(chaos: list, fired: set[int], start: int, end: int, world: int) -> dict[int, dict[int, dict]]:
    """{rank: {step: fault}} for the round [start, end): one-shot faults whose step is `start`
    and not yet fired, and slow_worker's slow steps. Ranks outside the world are left out
    (the controller records those faults as skipped)."""
    out: dict[int, dict[int, dict]] = {}
    for i, c in enumerate(chaos):
        if c.fault not in STEP_FAULTS or c.rank >= world or c.during != "step":
            continue
        if c.fault == "slow_worker":
            steps = range(max(start, c.at_step), min(end, c.at_step + c.steps))
        else:
            steps = range(start, start + 1) if c.at_step == start and i not in fired else range(0)
        for step in steps:
            out.setdefault(c.rank, {})[step] = {"fault": c.fault, "hang_mode": c.hang_mode, "delay_s": c.delay_s,
                                                "collective": c.collective}
    return out


def quiet(chaos: list, fired: set[int], start: int, end: int) -> bool:
    """True when no fault can act on the steps [start, end): none still to fire at or before
    them (at any point: step, data, form, save, load), and no slow_worker's slow steps among
    them. The driver launches a round ahead of the one running only through quiet steps, so a
    fault always finds the round boundary it was scheduled at."""
    for i, c in enumerate(chaos):
        if i not in fired and c.at_step < end:
            return False
        if c.fault == "slow_worker" and c.at_step < end and start < c.at_step + c.steps:
            return False
    return True


def strike(fault: dict[str, Any], step: int, rank: int) -> None:
    """Carry out a step fault in this worker process, inside the step."""
    kind = fault["fault"]
    if kind == "kill_worker":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang_worker":
        if fault["hang_mode"] == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops, the heartbeat too
        else:
            block_forever()
    elif kind == "stall_collective":
        # The rank stops just before its k-th collective call of the step (airay.commtime): its
        # peers enter that collective and wait inside it, as every rank's host thread does when
        # one GPU or link stops under NCCL. The heartbeat thread runs on.
        from airay import commtime

        commtime.before_collective(fault["collective"], block_forever)
    elif kind == "raise_in_user_code":
        raise ChaosError(f"chaos raise_in_user_code at step {step} on rank {rank}")
    elif kind == "raise_in_airay":
        # A plain IndexError raised by airay's code, as an off-by-one in its loader would: not a
        # ChaosError, which stands for the user's code (airay.worker.failures.raised_in_airay).
        raise IndexError(f"chaos raise_in_airay at step {step} on rank {rank}: list index out of range")
    elif kind == "device_error":
        device_side_assert()
    elif kind == "oom_worker":
        exhaust_memory()
    elif kind == "slow_worker":
        time.sleep(fault["delay_s"])


def device_side_assert() -> None:
    """Trip a device-side assert on this process's CUDA device: an index past the end of a device
    tensor fails the kernel's bounds check. Launched, not waited for: CUDA reports it at a later
    call (the loss, the backward, the optimizer step or the step's synchronize), as it reports a
    real fault, and every call on this context fails from then on. Without CUDA, the error torch
    would raise is raised here."""
    import torch

    # A rank on a GPU set its device when it started (TrainWorker); a CPU rank never touches CUDA.
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        raise torch.AcceleratorError("CUDA error: device-side assert triggered (chaos device_error, simulated: this "
                                     "process has no CUDA device)")
    torch.zeros(4, device="cuda")[torch.full((1,), 1 << 20, device="cuda")]


def step_done(fault: dict[str, Any]) -> None:
    """The step a fault struck in has run its micro-batches: a stall_collective whose collective
    never came (the step makes fewer calls) stalls the rank here instead, after its last one."""
    from airay import commtime

    if fault["fault"] == "stall_collective" and commtime.disarm():
        block_forever()


def block_forever() -> None:
    """A blocking call that never returns (the heartbeat thread runs on); the driver's hang
    watch kills the process."""
    while True:
        time.sleep(3600)


def exhaust_memory(headroom: int = OOM_HEADROOM_BYTES) -> None:
    """Allocate until MemoryError, inside an address-space cap just above the current use.

    The cap (RLIMIT_AS) bounds what this can take from the machine to `headroom`. It is lifted
    again before the MemoryError propagates, so the worker can still tear down its world.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size_bytes() + headroom, hard))
    held = []
    try:
        while True:
            held.append(bytearray(16 * 1024**2))
    finally:
        held.clear()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _vm_size_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


CHECKPOINT_FAULTS = ("corrupt_checkpoint", "corrupt_memory_copy", "lose_node_memory")


def damage_checkpoint(kind: str, candidates: list, group, rank: int, storage) -> dict[str, Any]:
    """Damage the checkpoint a recovery would load; returns what was done (for the event).

    corrupt_checkpoint: flip bytes in every copy (each node's memory tier, the durable tier) of the
    largest optimizer-state file of the newest complete step (a load at any world size reads every
    byte of the partitions, while a ZeRO-1/2 model-states file's trained weights are never read:
    loading.trained_keys): no good copy is left, so the run rejects the step and loads the one
    before. corrupt_memory_copy: flip bytes in the memory copy, on `rank`'s node, of the largest
    optimizer-state file `rank` wrote to the newest memory step: its load (on that node) reads the
    next copy, a peer's. lose_node_memory: the memory copies of the newest memory step on `rank`'s node are
    lost, as with that node's memory: the files its ranks wrote come from the peer copies."""
    memory = [c for c in candidates if c.tier == "memory"]
    info = candidates[0] if kind == "corrupt_checkpoint" else memory[0]
    node = group.member(rank).node_id
    files = info.manifest.files
    if kind == "lose_node_memory":
        return {"checkpoint_step": info.step, "node_id": node, "removed": group.drop_memory(info.step, node)}
    if kind == "corrupt_memory_copy":
        name = _largest_read([n for n, f in files.items() if f.rank == rank], files)
        return {"checkpoint_step": info.step, "file": name, "node_id": node,
                "copies": group.damage_memory(info.step, name, nodes=[node])}
    name = _largest_read(list(files), files)
    damaged = group.damage_memory(info.step, name)
    rel = f"step_{info.step:08d}/{name}"
    if storage.size(rel) is not None:
        data = bytearray(storage.read_bytes(rel))
        mid = len(data) // 2
        data[mid:mid + 16] = bytes(b ^ 0xFF for b in data[mid:mid + 16])  # same size: only checksums tell
        storage.write_bytes(rel, bytes(data))
        damaged.append(storage.uri(rel))
    return {"checkpoint_step": info.step, "file": name, "copies": damaged}


def _largest_read(names: list[str], files: dict) -> str:
    """The largest optimizer-state file of `names` (every load reads all of it), else the largest
    (stage 0: the model-states file holds everything)."""
    optim = [n for n in names if "optim_states" in n]
    return max(optim or names, key=lambda n: files[n].size)


def spoil_rows(pieces: list, lo: int, hi: int, bad) -> list:
    """A step's pieces [(block ref, first row, end row), ...] with its rows [lo, hi) (positions
    in the step) taken from the block `bad` instead: pieces are split at lo and hi, so only the
    rank whose rows those are fetches it."""
    out, pos = [], 0
    for ref, a, b in pieces:
        s, e = max(pos, lo) - pos, min(pos + b - a, hi) - pos  # the overlap, relative to this piece
        if s >= e:
            out.append((ref, a, b))
        else:
            out += [(ref, a, a + s)] if s > 0 else []
            out.append((bad, a + s, a + e))
            out += [(ref, a + e, b)] if a + e < b else []
        pos += b - a
    return out


def bad_block(kind: str) -> tuple[Any, Any]:
    """(ref, cleanup) of a block that cannot be fetched. lose_data_block: an object whose owner
    is dead (fetching it raises OwnerDiedError, an ObjectLostError), as when the process that
    made a block goes away. stall_data_block: the result of a task that is never scheduled (it
    asks for a resource no node has), so a fetch without a timeout would wait forever."""
    import ray

    if kind == "lose_data_block":
        owner = ray.remote(_BlockOwner).options(num_cpus=0).remote()
        (ref,) = ray.get(owner.block.remote())
        ray.kill(owner, no_restart=True)
        # ray.kill returns before the process is gone, and the object stays fetchable until its
        # owner's death has reached the cluster: wait until a fetch of it fails here, so it fails
        # for the rank too (else the fault would not strike).
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                ray.get(ref, timeout=2)
            except ray.exceptions.ObjectLostError:
                break
            except ray.exceptions.GetTimeoutError:
                pass
            time.sleep(0.1)
        return ref, lambda: None
    ref = ray.remote(_never_scheduled).options(num_cpus=0, resources={"airay_chaos_never": 1}).remote()
    return ref, lambda: ray.cancel(ref, force=True)


class _BlockOwner:
    def block(self) -> list:
        import ray

        # In a list: the object stays owned by this actor. Large (1 MiB, in the object store): a
        # small one would travel inlined in this call's reply and stay fetchable without its owner.
        return [ray.put({"sample_id": [0], "pad": b"x" * (1 << 20)})]


def _never_scheduled() -> None:
    pass

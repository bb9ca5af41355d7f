"""Which accelerator a rank uses: a pure function of what Ray assigned and what the process sees.

Ray gives each GPU worker the id of its GPU (`ray.get_gpu_ids()`): an entry of the raylet's own
CUDA_VISIBLE_DEVICES when the raylet was started under one (SLURM, Kubernetes hand a node a
subset, e.g. "4,5,6,7"), else a physical index. Ray then sets the worker's CUDA_VISIBLE_DEVICES
to its ids (masking), unless RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES is set, as airay sets
it: then every rank of a node sees the node's GPUs, so NCCL can use NVLink/P2P between them, and
a warm process keeps one CUDA context across world changes. Either way the CUDA ordinal torch
and DeepSpeed need is the position of the assigned id in the process's CUDA_VISIBLE_DEVICES (or
the id itself when that is unset). DeepSpeed takes its device, and NCCL's, from LOCAL_RANK
(deepspeed 0.19: engine._set_distributed_vars, comm/torch.py init_process_group), so LOCAL_RANK
is that ordinal: with the default LOCAL_RANK=0 every rank of a node would land on cuda:0.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceAssignment:
    """What a rank hands torch and DeepSpeed."""

    gpu_id: str | None  # Ray's id of the rank's GPU; None without one
    local_rank: int  # LOCAL_RANK: the CUDA ordinal of that GPU in this process (0 without one)
    device: str  # what the rank trains on: "cuda:N", or "cpu" (no GPU, or logical GPUs only)
    backend: str  # "nccl" or "gloo"
    visible_devices: str | None  # the process's CUDA_VISIBLE_DEVICES as it stands

    @property
    def cuda_device(self) -> str | None:
        """The CUDA device of the rank's GPU, also where CUDA is not usable (a CPU machine with
        logical GPUs, whose tests check the mapping by it)."""
        return None if self.gpu_id is None else f"cuda:{self.local_rank}"


class DeviceError(RuntimeError):
    """The GPU Ray assigned is not visible to the process: a node's CUDA setup is inconsistent."""


def cuda_ordinal(gpu_id: str, visible_devices: str | None) -> int:
    """The CUDA ordinal of Ray's GPU id `gpu_id` in a process whose CUDA_VISIBLE_DEVICES is
    `visible_devices` (None: unset, every GPU visible in physical order)."""
    if visible_devices is None:
        try:
            return int(gpu_id)
        except ValueError:
            raise DeviceError(f"Ray assigned GPU '{gpu_id}' (not an index) but CUDA_VISIBLE_DEVICES is unset; "
                              "start the raylet with CUDA_VISIBLE_DEVICES naming its GPUs") from None
    visible = [v.strip() for v in visible_devices.split(",") if v.strip()]
    if gpu_id not in visible:
        raise DeviceError(f"Ray assigned GPU '{gpu_id}' but this process sees CUDA_VISIBLE_DEVICES="
                          f"'{visible_devices}'; check the node's CUDA_VISIBLE_DEVICES and Ray's num_gpus")
    return visible.index(gpu_id)


def assign_device(gpu_ids: list[str], visible_devices: str | None, cuda_available: bool) -> DeviceAssignment:
    """The device of a worker that Ray gave `gpu_ids` (one per worker bundle: the first is used)."""
    if not gpu_ids:
        return DeviceAssignment(None, 0, "cpu", "gloo", visible_devices)
    gpu_id = str(gpu_ids[0])
    ordinal = cuda_ordinal(gpu_id, visible_devices)
    if not cuda_available:  # logical GPUs (a CPU machine trying the GPU path): train on CPU
        return DeviceAssignment(gpu_id, ordinal, "cpu", "gloo", visible_devices)
    return DeviceAssignment(gpu_id, ordinal, f"cuda:{ordinal}", "nccl", visible_devices)

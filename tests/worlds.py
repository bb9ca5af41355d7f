"""gloo worlds of real DeepSpeed processes for tests, started from a server that imported DeepSpeed once.

torch's `mp.spawn` starts every rank as a fresh interpreter that imports torch, DeepSpeed and airay
again: about 3.5 s of CPU each, so a world of 4 on this 2-core machine spends some 7 s importing
before its first collective, twice per reshard case. A forkserver that has imported them forks each
rank ready: same processes, same code, none of the repeated imports. Nothing is initialised in the
server beyond imports (no process group, no engine), so every rank starts clean.
"""

import multiprocessing

import torch.multiprocessing as mp

# DeepSpeed's Muon module too: every ZeRO optimizer imports it, and its import compiles (torch._inductor).
PRELOAD = ["torch", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "airay.worker.engine",
           "airay.checkpoint.reshard", "airay.models.tiny_gpt"]
multiprocessing.set_forkserver_preload(PRELOAD)


def spawn(fn, args, nprocs: int) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`, each rank forked from the preloaded server."""
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


def join(rank: int, world: int, port: int) -> None:
    """Make this process rank `rank` of a gloo world of `world` on 127.0.0.1:`port`, as a worker
    joins one (one torch thread, DeepSpeed's shared-memory all-reduce off), ready to build a
    ZeRO-3 model (deepspeed_compat.preload_for_zero_init)."""
    import os

    import deepspeed
    import torch

    from airay.worker.deepspeed_compat import disable_cpu_shm_comm, preload_for_zero_init

    torch.set_num_threads(1)
    disable_cpu_shm_comm()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    preload_for_zero_init()

"""Plain DeepSpeed, as a user writes it without airay: the one bootstrap every baseline uses.

A baseline process joins a torch.distributed world (gloo on CPU, NCCL on CUDA) and builds its
engine with the same `build_engine` and batch plan airay's workers use, so the two sides differ
only in what airay adds around them (the engine build's own savings, such as ZeRO-3's gradient
hooks registered without gathering each parameter, are in build_engine: baselines have them too). DeepSpeed's CPU shared-memory op is disabled as airay does:
otherwise a 30 s JIT build of an op neither side uses. DeepSpeed is imported as airay's workers
import it (deepspeed_compat.import_deepspeed: without the MLflow import of its autotuner, nor
torch.compile resolving its backend for the Muon kernels at import; 1.1-1.4 CPU-s a process here),
and without importing torch._dynamo at the optimizer's first call (airay.worker.torch_compat).
"""

from __future__ import annotations

import os
from typing import Any


def join_world(rank: int, world: int, port: int | None, device: str = "cpu") -> None:
    """This process becomes `rank` of a `world`-rank process group at 127.0.0.1:`port`; with
    `port` None the group exists already (Ray Train made it) and DeepSpeed adopts it."""
    import torch

    from airay.worker.deepspeed_compat import disable_cpu_shm_comm, import_deepspeed

    deepspeed = import_deepspeed()

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
    else:
        disable_cpu_shm_comm()
    backend = "nccl" if cuda else "gloo"
    if port is None:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        return
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def plain_engine(model, deepspeed_config: dict[str, Any], plan, *, rank: int, world: int, port: int | None,
                 device: str = "cpu", threads: int | None = 1, load_universal: bool = False):
    """Join the world, then a DeepSpeed engine of `model` for `plan` on `device`. `threads`: torch's
    intra-op threads (1, as airay's one-CPU workers run; None leaves torch's default)."""
    import torch

    from airay.worker.engine import build_engine

    if threads is not None:
        torch.set_num_threads(threads)
    join_world(rank, world, port, device)
    return build_engine(model, deepspeed_config, plan, device, load_universal=load_universal)


def train_step(engine, loss_fn, data, step: int, rank: int, plan) -> float:
    """One step of this rank's micro-batches of `step` (airay's weighting of an uneven share, so
    the update equals airay's); returns the sum of micro-batch losses weighted by their samples."""
    from airay.worker.engine import backward_micro_batch

    total = 0.0
    for batch, samples in zip(data.micro_batches(step, rank, plan), plan.micro_sizes(rank)):
        loss = loss_fn(engine, batch)
        backward_micro_batch(engine, loss, samples, plan)
        total += loss.detach() * samples
    return float(total)


def plain_job(cfg, *, rank: int, world: int, port: int | None, device: str = "cpu"):
    """The engine, batch plan, loss and samples of the job spec `cfg` for `rank` of `world`, built
    as a plain DeepSpeed user would (no airay in the path): (engine, plan, loss_fn, data)."""
    from airay.config import resolve_callable
    from airay.data.source import SyntheticSource
    from airay.policy import plan_batch

    plan = plan_batch(cfg.global_batch_size, cfg.micro_batch_size, world)
    model = resolve_callable(cfg.model.factory)(seed=cfg.seed, **cfg.model.kwargs)
    engine = plain_engine(model, cfg.deepspeed, plan, rank=rank, world=world, port=port, device=device)
    data = SyntheticSource(resolve_callable(cfg.data.sample_fn), cfg.data.seed, cfg.data.kwargs)
    return engine, plan, resolve_callable(cfg.loss_fn), data


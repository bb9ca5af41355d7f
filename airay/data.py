"""Which samples each rank trains on at each step, and building their micro-batches.

The sample ids of global step N are fixed by N and the global batch alone, then split
contiguously by rank and micro-batch. A step replayed after a resize therefore trains on the
same set of samples, whatever the world size.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from airay.policy import BatchPlan


def step_sample_ids(step: int, global_batch_size: int) -> range:
    return range(step * global_batch_size, (step + 1) * global_batch_size)


def rank_micro_batch_ids(step: int, rank: int, plan: BatchPlan) -> list[range]:
    """The sample ids of each of `rank`'s micro-batches at `step`, in order."""
    start = step * plan.global_batch_size + rank * plan.per_worker
    m = plan.micro_batch_size
    return [range(start + i * m, start + (i + 1) * m) for i in range(plan.grad_accum_steps)]


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class SyntheticSource:
    """Builds micro-batches from a per-sample function `fn(sample_id, seed, **kwargs)`."""

    def __init__(self, fn: Callable[..., dict[str, torch.Tensor]], seed: int, kwargs: dict[str, Any]):
        self.fn, self.seed, self.kwargs = fn, seed, kwargs

    def micro_batches(self, step: int, rank: int, plan: BatchPlan) -> list[dict[str, torch.Tensor]]:
        return [collate([self.fn(i, self.seed, **self.kwargs) for i in ids])
                for ids in rank_micro_batch_ids(step, rank, plan)]

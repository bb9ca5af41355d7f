"""Pure decisions: batch plan per world size, world size from capacity, what to do after a loss.

Nothing here touches Ray or torch, so every decision is unit-tested without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

# DeepSpeed config keys airay owns: they change with the world size.
DEEPSPEED_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class BatchPlan:
    """How one world size reaches the fixed global batch: world × micro × accumulation."""

    world_size: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def per_worker(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.per_worker

    def deepspeed_fields(self) -> dict[str, int]:
        return {
            "train_batch_size": self.global_batch_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum_steps,
        }


def plan_batch(global_batch_size: int, max_micro_batch: int, world_size: int) -> BatchPlan | None:
    """The plan with the largest micro-batch <= max_micro_batch, or None if none is exact.

    Every worker takes the same number of samples and every micro-batch has the same size, so
    DeepSpeed's mean of per-rank mean gradients is exactly the global-batch mean gradient.
    """
    if world_size < 1 or global_batch_size % world_size:
        return None
    per_worker = global_batch_size // world_size
    for micro in range(min(max_micro_batch, per_worker), 0, -1):
        if per_worker % micro == 0:
            return BatchPlan(world_size, micro, per_worker // micro)
    return None


def batch_plans(global_batch_size: int, max_micro_batch: int, min_workers: int,
                max_workers: int) -> dict[int, BatchPlan]:
    """Plans for every world size in [min_workers, max_workers]; refuses if any size has none."""
    plans = {w: plan_batch(global_batch_size, max_micro_batch, w) for w in range(min_workers, max_workers + 1)}
    missing = [w for w, p in plans.items() if p is None]
    if missing:
        raise PolicyError(
            f"global_batch_size {global_batch_size} cannot be split evenly over world sizes {missing} "
            f"(allowed by scaling.min_workers..max_workers = {min_workers}..{max_workers}); choose a "
            f"global_batch_size divisible by every size in that range (e.g. "
            f"{_lcm_range(min_workers, max_workers)} or a multiple), or narrow the range")
    return plans  # type: ignore[return-value]


def _lcm_range(lo: int, hi: int) -> int:
    from math import lcm

    out = 1
    for w in range(lo, hi + 1):
        out = lcm(out, w)
    return out


def choose_world_size(capacity: int, min_workers: int, max_workers: int) -> int | None:
    """Largest world size that fits `capacity` workers, or None below min_workers."""
    size = min(capacity, max_workers)
    return size if size >= min_workers else None


@dataclass(frozen=True)
class RecoveryDecision:
    """What the controller does after losing workers."""

    action: str  # "resize": re-form at new_world_size; "wait": wait for capacity
    new_world_size: int | None = None


def decide_recovery(survivors: int, free_slots: int, min_workers: int, max_workers: int) -> RecoveryDecision:
    """Shrink to the survivors (plus any placed, idle capacity) or wait for min_workers to fit."""
    size = choose_world_size(survivors + free_slots, min_workers, max_workers)
    if size is None:
        return RecoveryDecision("wait")
    return RecoveryDecision("resize", size)


def should_grow(world_size: int, free_slots: int, max_workers: int) -> int | None:
    """New world size when idle capacity can add workers, else None."""
    if world_size >= max_workers or free_slots <= 0:
        return None
    return min(max_workers, world_size + free_slots)


def next_round_end(step: int, max_steps: int, steps_per_round: int, every_n_steps: int,
                   fault_steps: list[int]) -> int:
    """Exclusive end of the next round of steps starting at `step`.

    A round stops at the next checkpoint boundary and just before any fault step, so faults
    fire at their named point and checkpoints land exactly every `every_n_steps`.
    """
    end = min(max_steps, step + steps_per_round)
    next_ckpt = (step // every_n_steps + 1) * every_n_steps
    end = min(end, next_ckpt)
    for f in fault_steps:
        if step < f < end:
            end = f
    return end


# ---- failure budget and bad nodes -------------------------------------------------------------


def failures_in_window(failure_ts: list[float], now: float, window_s: float) -> int:
    """Failures within the sliding window (now - window_s, now]."""
    return sum(1 for t in failure_ts if now - t < window_s)


def budget_exceeded(failure_ts: list[float], now: float, window_s: float, max_failures: int) -> bool:
    """True when more than `max_failures` failures fall in the window: the run gives up."""
    return failures_in_window(failure_ts, now, window_s) > max_failures


def restart_backoff_s(failures_in_window_: int, base_s: float, cap_s: float) -> float:
    """Wait before a recovery: none for the first failure in the window, then base_s doubling per
    further one, capped. A fault that keeps recurring slows down instead of spinning."""
    if base_s <= 0 or failures_in_window_ <= 1:
        return 0.0
    return min(cap_s, base_s * 2 ** (failures_in_window_ - 2))


def nodes_to_exclude(failures_per_node: dict[str, int], threshold: int, excluded: set[str]) -> list[str]:
    """Nodes that reached `threshold` failures and are not excluded yet (threshold 0: never)."""
    if threshold <= 0:
        return []
    return sorted(n for n, c in failures_per_node.items() if c >= threshold and n not in excluded)

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
    """How a world of `world_size` ranks trains on exactly `global_batch_size` samples a step.

    Rank r takes a contiguous share of the step's samples: global // world of them, one more for
    each of the first global % world ranks, so any world size works, not only divisors. Every
    rank runs `grad_accum_steps` micro-batches (DeepSpeed's collectives must pair up across ranks)
    of at most `micro_batch_size` samples; a rank with fewer samples has smaller micro-batches,
    or a padded one (a copy of one of its samples whose loss weight is 0). Each micro-batch's mean
    loss is scaled by `loss_scale(samples)` before backward, which makes DeepSpeed's mean over
    ranks and micro-batches the exact mean over the global batch (the scale is 1.0 when every
    micro-batch is full-size, as with a world size that divides the batch).
    """

    world_size: int
    global_batch_size: int
    micro_batch_size: int  # the largest micro-batch of any rank
    grad_accum_steps: int

    def rank_rows(self, rank: int) -> tuple[int, int]:
        """[start, stop) of `rank`'s samples within a step's global batch."""
        base, extra = divmod(self.global_batch_size, self.world_size)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def micro_sizes(self, rank: int) -> list[int]:
        """Samples in each of `rank`'s micro-batches, in order; 0 marks a padded micro-batch."""
        lo, hi = self.rank_rows(rank)
        base, extra = divmod(hi - lo, self.grad_accum_steps)
        return [base + (i < extra) for i in range(self.grad_accum_steps)]

    def loss_scale(self, samples: int) -> float:
        """Factor for a micro-batch's mean loss: DeepSpeed divides the summed gradients by
        world_size x grad_accum_steps, the global mean needs samples / global_batch_size."""
        return samples * self.world_size * self.grad_accum_steps / self.global_batch_size

    def deepspeed_fields(self) -> dict[str, int]:
        # DeepSpeed checks train_batch_size == micro x accumulation x world: that is the plan's
        # slots (padded ones included), not the global batch, which airay keeps itself.
        return {
            "train_batch_size": self.micro_batch_size * self.grad_accum_steps * self.world_size,
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum_steps,
        }


def plan_batch(global_batch_size: int, max_micro_batch: int, world_size: int) -> BatchPlan | None:
    """The plan with the fewest micro-batches of at most `max_micro_batch` samples (the largest
    rank's share split evenly), or None when the world has more ranks than the batch has samples."""
    if world_size < 1 or max_micro_batch < 1 or world_size > global_batch_size:
        return None
    largest_share = -(-global_batch_size // world_size)
    accum = -(-largest_share // max_micro_batch)
    return BatchPlan(world_size, global_batch_size, -(-largest_share // accum), accum)


def allowed_world_sizes(min_workers: int, max_workers: int, multiple: int = 1) -> list[int]:
    """World sizes a run may take: [min_workers, max_workers], multiples of `multiple` only
    (e.g. 8: the world changes by whole 8-GPU nodes)."""
    return [w for w in range(min_workers, max_workers + 1) if w % multiple == 0]


def batch_plans(global_batch_size: int, max_micro_batch: int, sizes: list[int], model_parallel: int = 1) -> dict[int, BatchPlan]:
    """Plans for every allowed world size; refuses what cannot work, naming the field and a fix.
    With `model_parallel` ranks per replica, a world of w ranks is w / model_parallel
    data-parallel replicas, and its plan splits the batch over the replicas: every rank of a
    replica trains on the replica's samples (BatchPlan.world_size counts replicas)."""
    if not sizes:
        raise PolicyError("no world size is allowed: scaling.min_workers..max_workers holds no multiple of "
                          "scaling.world_size_multiple (and of the model-parallel size); widen the range or change "
                          "the multiple")
    replicas = max(sizes) // model_parallel
    if replicas > global_batch_size:
        what = f"world size {max(sizes)}" if model_parallel == 1 else \
            f"{replicas} data-parallel replicas (world size {max(sizes)} / model-parallel size {model_parallel})"
        raise PolicyError(
            f"global_batch_size {global_batch_size} is smaller than {what} (scaling.max_workers): "
            f"ranks would train on no sample; raise global_batch_size to at least {replicas} or lower "
            "scaling.max_workers")
    return {w: plan_batch(global_batch_size, max_micro_batch, w // model_parallel) for w in sizes}  # type: ignore[misc]


def choose_world_size(capacity: int, sizes: list[int]) -> int | None:
    """Largest allowed world size that fits `capacity` workers, or None below the smallest."""
    fits = [w for w in sizes if w <= capacity]
    return max(fits) if fits else None


@dataclass(frozen=True)
class RecoveryDecision:
    """What the controller does after losing workers."""

    action: str  # "resize": re-form at new_world_size; "wait": wait for capacity
    new_world_size: int | None = None


def decide_recovery(survivors: int, free_slots: int, sizes: list[int]) -> RecoveryDecision:
    """Shrink to the largest allowed size the survivors (plus any placed, idle capacity) fill,
    or wait for the smallest allowed size to fit."""
    size = choose_world_size(survivors + free_slots, sizes)
    if size is None:
        return RecoveryDecision("wait")
    return RecoveryDecision("resize", size)


def should_grow(world_size: int, free_slots: int, sizes: list[int]) -> int | None:
    """New world size when idle capacity makes a larger allowed size, else None."""
    size = choose_world_size(world_size + free_slots, sizes)
    return size if size is not None and size > world_size else None


def grow_now(world_size: int, standby: int, pending: int, ready_for_s: float, settle_s: float,
             sizes: list[int]) -> bool:
    """Grow at this step? Only if the standby workers make a larger allowed size; and while more
    workers are still starting (`pending`) that would make it larger yet, wait for them up to
    `settle_s` after the first standby one was ready (`ready_for_s` ago): replacements that come
    up seconds apart then cost one checkpoint and one re-formed world, not one each."""
    target = should_grow(world_size, standby, sizes)
    if target is None:
        return False
    more = should_grow(world_size, standby + pending, sizes)
    return more is None or more == target or ready_for_s >= settle_s


def ranks_to_idle(rank_nodes: list[str | None], keep: int) -> list[int]:
    """Which of the current ranks step out (to stand by) when only `keep` of them fit an allowed
    world size: those on the nodes with the fewest ranks first (a node that lost a GPU, not a
    whole one), the highest ranks of a node first. Returns them sorted."""
    per_node: dict[str | None, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        per_node.setdefault(node, []).append(rank)
    order = sorted(per_node.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    out: list[int] = []
    for ranks in order:
        for rank in reversed(ranks):
            if len(out) == len(rank_nodes) - keep:
                return sorted(out)
            out.append(rank)
    return sorted(out)


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


def can_pipeline(end: int, max_steps: int, every_n_steps: int) -> bool:
    """Whether the round after one that ends at `end` may be launched before that one is
    gathered: not when the driver has work at `end` (a checkpoint, the run's end)."""
    return end < max_steps and end % every_n_steps != 0


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


def incident_nodes(failed_nodes: set[str | None], world_nodes: set[str | None]) -> tuple[set[str], bool]:
    """The nodes one incident (a failed round, save, join or load) counts a failure against
    toward exclusion: each node once, however many of its ranks it lost (an 8-GPU node loses 8
    to one fault). (set(), True) when it struck most of the world's nodes at once (two or more,
    over half): the cause is the cluster's or the job's (memory pressure, a storage outage, a
    bad driver), and excluding those nodes would only take the run's capacity away."""
    failed = {n for n in failed_nodes if n}
    world = {n for n in world_nodes if n} | failed
    if len(failed) >= 2 and 2 * len(failed) > len(world):
        return set(), True
    return failed, False


def nodes_to_exclude(failures_per_node: dict[str, int], threshold: int, excluded: set[str]) -> list[str]:
    """Nodes that reached `threshold` failures and are not excluded yet (threshold 0: never)."""
    if threshold <= 0:
        return []
    return sorted(n for n, c in failures_per_node.items() if c >= threshold and n not in excluded)

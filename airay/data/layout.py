"""Which samples each global step trains on, and which of them each rank and micro-batch takes.

Pure (numpy only, no torch): the data pipeline's reader actors import it, and every import there
costs start-up time of the pipeline.

A step's samples depend on the step alone; their split over ranks and micro-batches is the
world's BatchPlan (airay.policy): contiguous rank shares, consecutive micro-batches inside them.
Synthetic data numbers the samples of step N [N*B, (N+1)*B) for global batch B.

Sample ids of a streamed dataset are global row indices in a fixed file order. Each epoch is
a pure function (seed, epoch) -> order of rows, built in two levels so it can be read in
large sequential pieces: the rows are cut into chunks of `chunk_rows` consecutive rows whose
order is permuted, and then rows are shuffled inside windows of `window_steps` consecutive
steps. Step N of the run is step N % steps_per_epoch of epoch N // steps_per_epoch, so the
rows of a step depend on nothing but N: not the world size, not what happened before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from airay.policy import BatchPlan


def step_sample_ids(step: int, global_batch_size: int) -> range:
    """The synthetic source's sample ids of a step."""
    return range(step * global_batch_size, (step + 1) * global_batch_size)


def micro_batch_rows(plan: BatchPlan, rank: int) -> list[range]:
    """Positions (within the step's global batch) of each of `rank`'s micro-batches, in order.
    A padded micro-batch (plan.micro_sizes 0) holds the rank's first sample once: it runs like
    the others and its loss weight is 0 (BatchPlan.loss_scale(0))."""
    lo, _ = plan.rank_rows(rank)
    out, pos = [], lo
    for n in plan.micro_sizes(rank):
        out.append(range(pos, pos + n) if n else range(lo, lo + 1))
        pos += n
    return out


@dataclass(frozen=True)
class EpochLayout:
    rows: int               # rows in the dataset
    global_batch_size: int
    seed: int
    chunk_rows: int = 1024
    window_steps: int = 8
    shuffle: bool = True

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch; the last rows % global_batch_size rows of each epoch's
        order are dropped (which ones differs per epoch when shuffling)."""
        return self.rows // self.global_batch_size

    @property
    def windows_per_epoch(self) -> int:
        return -(-self.steps_per_epoch // self.window_steps)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within the epoch) of global step `step`."""
        return divmod(step, self.steps_per_epoch)

    def window_of(self, step: int) -> tuple[int, int]:
        """(epoch, window) holding global step `step`."""
        epoch, s = self.position(step)
        return epoch, s // self.window_steps

    def window_first_step(self, epoch: int, window: int) -> int:
        return epoch * self.steps_per_epoch + window * self.window_steps

    def window_num_steps(self, window: int) -> int:
        return min(self.window_steps, self.steps_per_epoch - window * self.window_steps)

    def window_rows(self, epoch: int, window: int) -> np.ndarray:
        """Row ids of the window's steps, in training order (step after step)."""
        b, c = self.global_batch_size, self.chunk_rows
        n_chunks = -(-self.rows // c)
        order = np.random.default_rng([self.seed, epoch]).permutation(n_chunks) if self.shuffle \
            else np.arange(n_chunks)
        starts = order * c
        lens = np.minimum(c, self.rows - starts)
        ends = np.cumsum(lens)  # position (in this epoch's order) where each chunk ends
        pos0 = window * self.window_steps * b
        pos1 = pos0 + self.window_num_steps(window) * b
        first = int(np.searchsorted(ends, pos0, side="right"))
        pieces = []
        for k in range(first, n_chunks):
            begin = ends[k] - lens[k]
            if begin >= pos1:
                break
            lo, hi = max(pos0, begin), min(pos1, ends[k])
            pieces.append(np.arange(starts[k] + lo - begin, starts[k] + hi - begin, dtype=np.int64))
        ids = np.concatenate(pieces)
        if self.shuffle:
            ids = ids[np.random.default_rng([self.seed, epoch, window]).permutation(len(ids))]
        return ids

    def step_rows(self, step: int) -> np.ndarray:
        epoch, s = self.position(step)
        w = s // self.window_steps
        k = s - w * self.window_steps
        b = self.global_batch_size
        return self.window_rows(epoch, w)[k * b:(k + 1) * b]

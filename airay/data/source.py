"""The worker's side of the data: its rank's micro-batches of each step it trains.

SyntheticSource builds samples from the spec's per-sample function; StreamedSource fetches the
rank's rows of a streamed dataset's blocks (which the driver's pipeline produced) in a
background thread. Either way the rank and micro-batch split is airay.data.layout's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from airay.data.layout import micro_batch_rows
from airay.policy import BatchPlan

if TYPE_CHECKING:  # torch is imported where a batch is made: the driver never needs it
    import torch


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    import torch

    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}


class SyntheticSource:
    """Builds micro-batches from a per-sample function `fn(sample_id, seed, **kwargs)`."""

    def __init__(self, fn: Callable[..., dict[str, torch.Tensor]], seed: int, kwargs: dict[str, Any]):
        self.fn, self.seed, self.kwargs = fn, seed, kwargs

    def micro_batches(self, step: int, rank: int, plan: BatchPlan) -> list[dict[str, torch.Tensor]]:
        first = step * plan.global_batch_size
        return [collate([self.fn(first + i, self.seed, **self.kwargs) for i in rows])
                for rows in micro_batch_rows(plan, rank)]


class DataFetchError(RuntimeError):
    """A block of a step could not be fetched: it did not arrive within data.fetch_timeout_s, or
    its object was lost. A data failure, not the worker's: the driver re-runs the round on the
    same world from a fresh pipeline (airay.controller), it does not replace the rank."""

    def __init__(self, message: str, step: int | None = None, rank: int | None = None):
        super().__init__(message)
        self.step, self.rank = step, rank

    def __reduce__(self):  # Ray pickles it back to the driver with its step and rank
        return type(self), (str(self), self.step, self.rank)


class StreamedSource:
    """A worker's side of a streamed dataset: fetch its rank's rows of each step it is given,
    in a background thread, while the step before trains.

    The driver hands each round the pieces (block ref, first row, end row) of the round's steps
    and of a few steps after it; fetching those early keeps the first step of the next round
    from waiting too. `micro_batches` blocks only when the fetch is not done yet: that wait is
    the step's data_wait_s, at most about `fetch_timeout_s` (each fetch's deadline).
    """

    def __init__(self, fetch_timeout_s: float | None = None) -> None:
        import ray.data.block  # noqa: F401  (seconds of imports: paid while standing by, not in step 0)

        self.fetch_timeout_s = fetch_timeout_s
        self._futures: dict[int, tuple[tuple, Any]] = {}  # step -> (its pieces' identity, future)
        self._key: tuple | None = None
        self._pool = None
        self._reset()

    def _reset(self) -> None:
        """A fresh prefetch thread and cache: a fetch still waiting on a bad block keeps the old
        thread busy until its deadline, and must not hold up the fetches of the re-run round."""
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="airay-prefetch")
        self._blocks = BlockCache(timeout_s=self.fetch_timeout_s)  # only the prefetch thread uses it
        self._futures.clear()

    def feed(self, steps: dict[int, list], rank: int, plan: BatchPlan) -> None:
        if self._key != (rank, plan):  # another world: the rank's rows of a step differ
            self._futures.clear()
            self._key = (rank, plan)
        for step in sorted(steps):
            ident = pieces_identity(steps[step])
            held = self._futures.get(step)
            # Same step, other blocks: the driver restarted its pipeline (a lost block); the
            # rows are the same, but the old blocks may be the lost ones.
            if held is None or held[0] != ident:
                if held is not None:
                    held[1].cancel()
                self._futures[step] = (ident, self._pool.submit(fetch_rank_batches, steps[step], rank, plan,
                                                                self._blocks))

    def micro_batches(self, step: int, rank: int, plan: BatchPlan) -> list[dict[str, torch.Tensor]]:
        for s in [s for s in self._futures if s < step]:
            del self._futures[s]
        if self._key != (rank, plan) or step not in self._futures:
            raise RuntimeError(f"no data was fed for step {step} (rank {rank})")
        try:
            return self._futures.pop(step)[1].result()
        except DataFetchError as exc:
            self._reset()
            raise DataFetchError(f"rank {rank}, step {step}: {exc}", step, rank) from None


def pieces_identity(pieces: list) -> tuple:
    return tuple((ref.binary(), lo, hi) for ref, lo, hi in pieces)


class BlockCache:
    """The last few blocks a worker fetched, as arrow tables: a block holds the rows of several
    consecutive steps (a window), so each is fetched and converted once, not once per step."""

    def __init__(self, size: int = 2, timeout_s: float | None = None):
        self.size, self.timeout_s, self._tables = size, timeout_s, {}

    def table(self, ref, deadline: float | None = None):
        """The block as an arrow table; DataFetchError when it is not there by `deadline`
        (time.monotonic()) or was lost. Without a bound the fetch could wait forever: a block
        whose object is gone but not known lost never arrives."""
        import ray
        from ray.data.block import BlockAccessor

        key = ref.binary()
        if key not in self._tables:
            if len(self._tables) >= self.size:
                del self._tables[next(iter(self._tables))]  # the oldest: windows come in order
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                block = ray.get(ref, timeout=wait)
            except ray.exceptions.GetTimeoutError:
                raise DataFetchError(f"block {ref.hex()} did not arrive within data.fetch_timeout_s="
                                     f"{self.timeout_s:g}s") from None
            except ray.exceptions.ObjectLostError as exc:
                raise DataFetchError(f"block {ref.hex()} was lost: {type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0]}") from None
            self._tables[key] = BlockAccessor.for_block(block).to_arrow()  # Ray Data blocks may be pandas too
        return self._tables[key]


def fetch_rank_batches(pieces: list, rank: int, plan: BatchPlan,
                       blocks: BlockCache | None = None) -> list[dict[str, torch.Tensor]]:
    """`rank`'s micro-batches of a step whose rows are `pieces` [(block ref, lo, hi), ...];
    all of its blocks must arrive within the cache's timeout_s of the call."""
    import pyarrow as pa
    from ray.data.block import BlockAccessor

    blocks = blocks or BlockCache()
    deadline = time.monotonic() + blocks.timeout_s if blocks.timeout_s is not None else None
    want_lo, want_hi = plan.rank_rows(rank)
    parts, pos = [], 0
    for ref, lo, hi in pieces:
        a, b = max(want_lo, pos), min(want_hi, pos + hi - lo)
        if a < b:
            parts.append(blocks.table(ref, deadline).slice(lo + a - pos, b - a))
        pos += hi - lo
    table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
    columns = BlockAccessor.for_block(table).to_batch_format("numpy")
    # Copy: arrays read from the object store are read-only, and the step may run in-place ops.
    import torch

    full = {k: torch.from_numpy(np.array(v)) for k, v in columns.items()}
    return [{k: v[rows.start - want_lo:rows.stop - want_lo] for k, v in full.items()}
            for rows in micro_batch_rows(plan, rank)]

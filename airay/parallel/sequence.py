"""Sequence parallelism (DeepSpeed Ulysses): each rank of a replica trains on its share of every
sample's sequence, and the replica's loss is the mean over the whole sequences' tokens.

Every rank of a replica receives the replica's micro-batch whole (the batch plan is over
replicas); `shard` cuts it here, after the labels are shifted, so the token at a shard's end
still predicts the first token of the next shard. Each rank's loss is the sum of its tokens'
losses over the replica's tokens x sp: DeepSpeed averages gradients over the data x sequence
ranks (sp times as many as the replicas), and Ulysses' all-to-all carries each token's gradient
back to the rank that holds it, so the update is the exact mean over the global batch's tokens,
as without sequence parallelism.
"""

from __future__ import annotations

import torch


def shard(batch: dict[str, torch.Tensor], labels: torch.Tensor, sp_rank: int, sp: int) -> dict[str, torch.Tensor]:
    """Rank `sp_rank`'s share of a micro-batch whose labels (ignored tokens -100) are `labels`:
    input ids, global positions, shifted labels of its slice of the sequence, and
    `num_items_in_batch`, the micro-batch's predicted tokens / sp (its loss's divisor)."""
    ids = batch["input_ids"]
    rows, length = ids.shape[0], ids.shape[1]
    if length % sp:
        raise ValueError(f"sequences of {length} tokens do not split over sequence_parallel_size {sp}: make the "
                         "data's sequence length a multiple of it")
    chunk = length // sp
    cut = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=ids.device).expand(rows, length)
    return {"input_ids": ids[:, cut].contiguous(), "position_ids": positions[:, cut].contiguous(),
            "shift_labels": shifted[:, cut].contiguous(), "num_items_in_batch": (shifted != -100).sum().float() / sp}

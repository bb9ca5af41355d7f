"""Resharding DeepSpeed's native ZeRO checkpoints to another world size, one new rank at a time.

Each new rank builds its own optimizer partition from the slices of the old ranks' files that
overlap it (typically one or two old files, read through mmap so only the overlapping bytes are
touched), and hands it to DeepSpeed's own same-size loader. No rank reads the whole state, no
process merges it: the plan-at-load idea of torch.distributed.checkpoint, on DeepSpeed's files
(deepspeed 0.19: runtime/zero/stage_1_and_2.py state_dict, stage3.py _rigid_state_dict).

The layouts (the same whether the model is fp32 or bf16, the optimizer state offloaded to the CPU
or not: the files hold fp32 masters and optimizer state either way; bf16 engines name them bf16_...):
- ZeRO-1/2: per parameter group, the parameters are flattened into one vector of `total`
  elements, padded at its end to `partition x world` and cut into equal partitions; a rank's file
  holds its partition of the fp32 master weights (unpadded: the last rank's is shorter) and of
  each optimizer state (padded). DeepSpeed's BF16_Optimizer (bf16, ZeRO-1, fp32 gradient
  accumulation) cuts the same way and saves its masters padded.
- ZeRO-3: each parameter of n elements is cut into partitions of ceil(n / world) (the last
  padded); the parameters are grouped into sub-groups by their partitions' sizes (so the
  sub-groups themselves change with the world size), and a rank's flat vector per sub-group is
  its partition of each of the sub-group's parameters, in order.
Stage 0 keeps the optimizer whole in the model-states file: nothing is partitioned.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"
GROUP_PADDINGS = "group_paddings"
PARTITION_COUNT = "partition_count"
FP32_FLAT_GROUPS = "fp32_flat_groups"
PARAM_SLICE_MAPPINGS = "param_slice_mappings"
ROUND_ROBIN = "round_robin_gradients"  # a layout_of key, only when DeepSpeed's option is on


def unreshardable(old_layout: dict, new_layout: dict) -> str | None:
    """Why a ZeRO-1/2 checkpoint of `old_layout` cannot be resharded into `new_layout` (None: it
    can). With round_robin_gradients, DeepSpeed flattens each group's parameters in an order that
    depends on the world size (parameter i % world first), so partitions cut at one size hold other
    parameters than at another (DeepSpeed 0.19's universal checkpoint misplaces them too).
    airay.config refuses the key for a world that can change size; this catches a resumed run whose
    config changed."""
    if old_layout.get(ROUND_ROBIN) or new_layout.get(ROUND_ROBIN):
        return ("a ZeRO-1/2 checkpoint cannot be resharded to another world size with "
                "zero_optimization.round_robin_gradients (at saving or loading); load it at its own world size, "
                "or train without round_robin_gradients")
    return None


def optim_file(rank: int, bf16: bool = False, mp: int = 0) -> str:
    """DeepSpeed's name of a data-parallel rank's optimizer partition of model-parallel slice `mp`
    (a tensor-parallel rank's slice of the model; 0 without model parallelism)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"


def zero3_model_file(rank: int, mp: int = 0) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_model_states.pt"


def model_file(mp: int = 0) -> str:
    """ZeRO 0-2: the model-states file of slice `mp`, written by its data-parallel rank 0 and
    read by every rank of the slice."""
    return f"mp_rank_{mp:02d}_model_states.pt"


MODEL_FILE = model_file(0)


def overlapping(lo: int, hi: int, part: int, world: int) -> range:
    """Old ranks whose partition [r*part, (r+1)*part) meets [lo, hi)."""
    if hi <= lo or part <= 0:
        return range(0)
    return range(lo // part, min(world, -(-hi // part)))


def ranks_needed(zero_stage: int, old_world: int, new_rank: int, new_world: int, *,
                 partitions: list[int] | None = None, new_partitions: list[int] | None = None,
                 totals: list[int] | None = None, param_numels: list[list[int]] | None = None) -> list[int]:
    """The old ranks whose files new rank `new_rank` reads. ZeRO-1/2: `partitions` (old) and
    `new_partitions` per group, `totals` (unpadded elements per group). ZeRO-3: `param_numels`
    per sub-group."""
    need: set[int] = set()
    if zero_stage in (1, 2):
        for part, new_part, total in zip(partitions, new_partitions, totals):
            lo, hi = new_rank * new_part, min((new_rank + 1) * new_part, total)
            need.update(overlapping(lo, hi, part, old_world))
    elif zero_stage == 3:  # per parameter: where sub-groups end does not matter here
        for numels in param_numels:
            for n in numels:
                c, c_new = math.ceil(n / old_world), math.ceil(n / new_world)
                lo, hi = new_rank * c_new, min((new_rank + 1) * c_new, n)
                need.update(overlapping(lo, hi, c, old_world))
    return sorted(need)


def gather(pieces: Callable[[int], object], part: int, old_world: int, lo: int, hi: int, total: int,
           size: int | None = None, touch: Callable[[int, object], None] | None = None, into=None):
    """Elements [lo, hi) of a flat vector of `total` elements kept as partitions of `part`
    elements (`pieces(r)`: old rank r's tensor, 1-D), zero-padded to `size` (default hi - lo),
    in a new tensor or in `into` (a tensor of `size` elements). Only the overlapping elements
    are read; `touch(r, slice)` is told of each slice read (a dry run on meta tensors finds the
    bytes a load needs: airay.checkpoint.ranges)."""
    import torch

    end = min(hi, total)
    found = []
    for r in overlapping(lo, end, part, old_world):
        a, b = max(lo, r * part), min(end, (r + 1) * part)
        found.append(pieces(r)[a - r * part:b - r * part])
        if touch is not None:
            touch(r, found[-1])
    size = hi - lo if size is None else size
    have = sum(t.numel() for t in found)
    # One tensor of the result's size, each piece copied into its place (a concatenation and a
    # copy of it would hold the result twice: at 70B, GBs a rank), zeros past the end (optimizer
    # state is fp32 whatever the model's dtype).
    like = {"dtype": found[0].dtype, "device": found[0].device} if found else {"dtype": torch.float32}
    out = into if into is not None else torch.empty(size, **like)
    if have < size:
        out[have:].zero_()
    at = 0
    for t in found:
        out[at:at + t.numel()].copy_(t)
        at += t.numel()
    return out


def reshard_zero12(old: dict[int, dict], old_world: int, new_rank: int, new_world: int,
                   partitions: list[int], new_partitions: list[int], totals: list[int], touch=None,
                   into: dict | None = None) -> dict:
    """New rank's ZeRO-1/2 optimizer file (the dict DeepSpeed's rigid loader reads) from the old
    ranks' files `old` (at least those ranks_needed names). `touch`: as gather's. `into`: the
    engine's own buffers to gather into (engine_buffers)."""
    first = old[min(old)]
    out = dict(first)
    osd = dict(first[OPTIMIZER_STATE_DICT])
    base = osd[BASE_OPTIMIZER_STATE]
    if not isinstance(base, dict):  # a list of per-group states merged across the ranks
        raise ValueError("this ZeRO-1/2 checkpoint was saved with zero_optimization.elastic_checkpoint, whose "
                         "optimizer state airay cannot reshard; load it at its own world size "
                         f"({old_world}), or save without elastic_checkpoint")
    new_state, fp32 = {}, []
    for g, (part, new_part, total) in enumerate(zip(partitions, new_partitions, totals)):
        lo = new_rank * new_part
        if g in base["state"]:  # no state before the optimizer's first step (a save at step 0)
            new_state[g] = {}
        for key, value in base["state"].get(g, {}).items():
            if hasattr(value, "numel") and value.dim() == 1 and value.numel() == part:
                new_state[g][key] = gather(lambda r: old[r][OPTIMIZER_STATE_DICT][BASE_OPTIMIZER_STATE]["state"][g][key],
                                           part, old_world, lo, lo + new_part, total, touch=touch,
                                           into=_buffer(into, "state", g, key, new_part, value.dtype))
            else:  # per-group scalars (the step count) are the same on every rank
                new_state[g][key] = copy.deepcopy(value)
        # Saved without padding: the last rank's partition ends at `total` (gathered into the
        # engine's partition, it keeps the partition's zero padding: the loader takes it as is).
        hi = min(lo + new_part, total)
        master = _buffer(into, "fp32", g, None, new_part, first[OPTIMIZER_STATE_DICT][SINGLE_PARTITION_OF_FP32_GROUPS][g].dtype)
        fp32.append(gather(lambda r: old[r][OPTIMIZER_STATE_DICT][SINGLE_PARTITION_OF_FP32_GROUPS][g],
                           part, old_world, lo, hi, total, size=None if master is None else new_part, touch=touch,
                           into=master))
    osd[BASE_OPTIMIZER_STATE] = {"state": new_state, "param_groups": copy.deepcopy(base["param_groups"])}
    osd[SINGLE_PARTITION_OF_FP32_GROUPS] = fp32
    osd[GROUP_PADDINGS] = [new_part * new_world - total if new_rank == new_world - 1 else 0
                           for new_part, total in zip(new_partitions, totals)]
    osd[PARTITION_COUNT] = [new_world] * len(partitions)
    osd.pop(PARAM_SLICE_MAPPINGS, None)  # the old ranks' fragment map; the loader rebuilds its own
    out[OPTIMIZER_STATE_DICT] = osd
    return out


def reshard_zero3(old: dict[int, dict], old_world: int, new_rank: int, new_world: int,
                  old_layout: dict, new_layout: dict, touch=None, into: dict | None = None) -> dict:
    """New rank's ZeRO-3 optimizer file from the old ranks' files `old` (at least ranks_needed's).

    DeepSpeed cuts each parameter group's parameters into sub-groups of about `sub_group_size`
    elements of *partition* (stage3.py _create_fp16_sub_groups), so where a sub-group ends moves
    with the world size: the old and new worlds may group the same parameters differently. Each
    parameter is therefore found in the old layout by its place in the global order (parameter
    groups in order, each group's parameters in order: the concatenation of the sub-groups at
    any world size) and resliced into the new sub-group that holds it. The inner optimizer's
    state is keyed by sub-group (its parameters are the fp32 flat sub-groups), so its
    param_groups are rebuilt with the new sub-groups' indices. `into`: the engine's own buffers
    to gather into (engine_buffers)."""
    import torch

    first = old[min(old)]
    out = dict(first)
    osd = dict(first[OPTIMIZER_STATE_DICT])
    torch_sd = osd[OPTIMIZER_STATE_DICT]
    where = _zero3_param_places(old_layout["param_numels"], old_world)  # global param -> (old sub-group, offset)

    def reslice(g: int, params: range, numels: list[int], flat_of: Callable[[int, int], object],
                key: str | None = None):
        """New sub-group g's flat vector (its fp32 masters, or optimizer state `key`): the engine's
        own when `into` has it, each parameter's partition gathered into its place."""
        sizes = [math.ceil(n / new_world) for n in numels]
        if not numels:
            return torch.zeros(0)
        like = flat_of(min(old), where[params.start][0])
        flat = _buffer(into, "fp32" if key is None else "state", g, key, sum(sizes), like.dtype)
        if flat is None:
            flat = torch.empty(sum(sizes), dtype=like.dtype, device=like.device)
        pos = 0
        for k, n, c_new in zip(params, numels, sizes):
            g_old, at = where[k]
            c = math.ceil(n / old_world)
            gather(lambda r: flat_of(r, g_old)[at:at + c], c, old_world, new_rank * c_new, (new_rank + 1) * c_new, n,
                   touch=touch, into=flat[pos:pos + c_new])
            pos += c_new
        return flat

    def old_state(r: int, g: int) -> dict:
        return old[r][OPTIMIZER_STATE_DICT][OPTIMIZER_STATE_DICT]["state"][g]

    flats, new_state, start = [], {}, 0
    for g, numels in enumerate(new_layout["param_numels"]):
        params = range(start, start + len(numels))
        start += len(numels)
        flats.append(reslice(g, params, numels, lambda r, go: old[r][OPTIMIZER_STATE_DICT][FP32_FLAT_GROUPS][go]))
        g_first = where[params.start][0] if numels else 0
        if g_first not in torch_sd["state"]:  # no state before the optimizer's first step
            continue
        new_state[g] = {}
        for key, value in torch_sd["state"][g_first].items():
            if hasattr(value, "numel") and value.dim() == 1 and value.numel() > 1:
                new_state[g][key] = reslice(g, params, numels, lambda r, go: old_state(r, go)[key], key)
            else:  # per-sub-group scalars (the step count) are the same for every sub-group
                new_state[g][key] = copy.deepcopy(value)
    groups_of = new_layout.get("param_groups") or [0] * len(new_layout["param_numels"])
    param_groups = copy.deepcopy(torch_sd["param_groups"])
    for pg, group in enumerate(param_groups):
        group["params"] = [g for g, owner in enumerate(groups_of) if owner == pg]
    osd[OPTIMIZER_STATE_DICT] = {"state": new_state, "param_groups": param_groups}
    osd[FP32_FLAT_GROUPS] = flats
    osd[PARTITION_COUNT] = new_world
    out[OPTIMIZER_STATE_DICT] = osd
    return out


def engine_buffers(engine) -> dict | None:
    """The engine's own optimizer buffers, for a resharded load to gather into: its fp32 master
    partitions, by group (ZeRO-1/2) or sub-group (ZeRO-3), and whatever per-partition state its
    inner optimizer already holds (none for Adam before its first step: deepspeed 0.19 makes only
    Adagrad's with the engine). DeepSpeed's loader then copies each master onto itself (torch
    returns at once), so a rank never holds its new masters twice, gathered and in the engine
    (at 70B on 64 ranks, 4.4 GB a rank, 8 ranks a node). None where the loader pads, casts or
    swaps them itself (BF16_Optimizer, optimizer state swapped to NVMe)."""
    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    if stage == 1 and hasattr(opt, "fp32_groups_flat_partition"):
        return None
    if stage in (1, 2):
        masters = list(opt.single_partition_of_fp32_groups)
    elif stage == 3 and not getattr(opt, "swap_optimizer", False):
        masters = list(opt.fp32_partitioned_groups_flat)
    else:
        return None
    inner = getattr(opt, "optimizer", None)
    state = getattr(inner, "state", {}) if inner is not None else {}
    return {"fp32": masters, "state": [dict(state.get(p, {})) for p in masters]}


def _buffer(into: dict | None, kind: str, group: int, key: str | None, numel: int, dtype):
    """The engine's buffer for `kind` ("fp32", or "state" and its `key`) of `group`, when there is
    one of `numel` elements of `dtype` (otherwise None: the gather allocates)."""
    if into is None or group >= len(into[kind]):
        return None
    t = into[kind][group] if key is None else into[kind][group].get(key)
    if t is None or not hasattr(t, "numel") or t.dim() != 1 or t.numel() != numel or t.dtype != dtype:
        return None
    return t.detach()  # the masters are the inner optimizer's parameters: leaves that require grad


def _zero3_param_places(param_numels: list[list[int]], world: int) -> list[tuple[int, int]]:
    """For every parameter in the global order: (its sub-group, the offset of its partition in
    that sub-group's flat vector) at `world` ranks."""
    places = []
    for g, numels in enumerate(param_numels):
        offset = 0
        for n in numels:
            places.append((g, offset))
            offset += math.ceil(n / world)
    return places


def layout_of(engine) -> dict:
    """The partition layout of a DeepSpeed engine's optimizer, what resharding needs: ZeRO-1/2,
    each group's partition and unpadded total elements; ZeRO-3, each sub-group's parameter
    sizes. Read from the engine's own optimizer (deepspeed 0.19 attributes)."""
    opt, stage = engine.optimizer, engine.zero_optimization_stage()
    if stage == 1 and hasattr(opt, "fp32_groups_flat_partition"):
        # DeepSpeed's BF16_Optimizer (bf16, ZeRO-1, fp32 gradient accumulation): ZeRO-1's cut
        # under other names; it saves its fp32 partitions padded, which gather reads past.
        return {"partitions": [int(t.numel()) for t in opt.fp32_groups_flat_partition],
                "totals": [sum(int(p.numel()) for p in group) for group in opt.bf16_groups]}
    if stage in (1, 2):
        paddings = getattr(opt, "round_robin_bit16_padding", None) or [[] for _ in opt.bit16_groups]
        layout = {"partitions": [int(t.numel()) for t in opt.single_partition_of_fp32_groups],
                  "totals": [sum(int(p.numel()) for p in group) + sum(pad) for group, pad in zip(opt.bit16_groups, paddings)]}
        if getattr(opt, "round_robin_gradients", False):  # the flat order depends on the world size
            layout[ROUND_ROBIN] = True
        return layout
    if stage == 3:
        return {"param_numels": [[int(p.ds_numel) for p in group] for group in opt.fp16_groups],
                "param_groups": [int(opt.sub_group_to_group_id[g]) for g in range(len(opt.fp16_groups))]}
    return {}

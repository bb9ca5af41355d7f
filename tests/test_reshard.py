"""Resharding DeepSpeed's native checkpoints at load, on real engines (gloo processes, no Ray).

A world saves its native checkpoint; a world of another size loads it through airay's LoadPlan
(each new rank reads only the old partitions that overlap its own) and, in the same processes,
through DeepSpeed's own universal checkpoint (ds_to_universal, then load_universal). The oracle is
DeepSpeed's: every rank's fp32 master partition and Adam moments must be identical both ways, and
so must the loss of the next step."""

import json
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests import worlds

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 8}
GBS = 12


def _port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ds_config(stage, extra):
    """The test's DeepSpeed config: AdamW at ZeRO `stage`, with `extra`'s keys laid over it
    (its zero_optimization and optimizer params merged into the base's, not replacing them)."""
    extra = dict(extra or {})
    zero = {"stage": stage, **extra.pop("zero_optimization", {})}
    params = {"lr": 1e-2, **extra.pop("optimizer_params", {})}
    return {"optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero, **extra}


def _engine(rank, world, stage, port, load_universal=False, first=True, extra=None):
    import deepspeed

    sys.path.insert(0, str(ROOT))
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.deepspeed_compat import disable_cpu_shm_comm, reset_zero3_globals
    from airay.worker.engine import build_engine

    torch.set_num_threads(1)
    if first:
        disable_cpu_shm_comm()
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0"})
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                                   init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    reset_zero3_globals()
    plan = plan_batch(GBS, 4, world)
    model = tiny_gpt.build(seed=0, **MODEL)
    return build_engine(model, _ds_config(stage, extra), plan, "cpu", load_universal), plan


def _train(engine, plan, rank, steps):
    from airay.data.source import SyntheticSource
    from airay.models import tiny_gpt
    from airay.worker.engine import backward_micro_batch

    data = SyntheticSource(tiny_gpt.synthetic_sample, 0, {"seq_len": MODEL["seq_len"]})
    losses = []
    for step in steps:
        total = 0.0
        for batch, n in zip(data.micro_batches(step, rank, plan), plan.micro_sizes(rank)):
            loss = tiny_gpt.loss(engine, batch)
            backward_micro_batch(engine, loss, n, plan)
            total += float(loss) * n
        losses.append(total)
    return losses


def _state(engine, stage):
    """This rank's optimizer state as named tensors: the fp32 master partitions, every state of
    the inner optimizer (moments and step: torch's AdamW or, offloaded, DeepSpeedCPUAdam) and the
    model's own (bf16 or fp32) partition. The same attributes whatever the wrapper: ZeRO-1/2
    keep single_partition_of_fp32_groups, ZeRO-3 fp32_partitioned_groups_flat, offloaded or not."""
    opt = engine.optimizer
    if stage == 3:
        flats = opt.fp32_partitioned_groups_flat
    else:  # BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation) names its own
        flats = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
    out = {f"fp32[{g}]": t.detach().clone() for g, t in enumerate(flats)}
    for g, p in enumerate(flats):
        for key, value in opt.optimizer.state[p].items():
            out[f"{key}[{g}]"] = torch.as_tensor(value).detach().clone()
    for name, p in engine.module.named_parameters():
        out[name] = (p.ds_tensor if stage == 3 else p).detach().clone()
    return out


def _masters(engine) -> dict:
    """Every parameter's whole fp32 master and Adam moments, by name, assembled by DeepSpeed from
    the ranks' partitions through its own parameter-to-fragment map (a collective: every rank
    calls it). World-size independent, so the saved world's values are an oracle of their own,
    beside the universal checkpoint's."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:  # ZeRO-1/2 map the moments into its fragments at the first step, or here
        link()
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"{name}:fp32"] = safe_get_full_fp32_param(p).detach().cpu().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}:{key}"] = safe_get_full_optimizer_state(p, key).detach().cpu().clone()
    return out


def _loss_scaler(engine) -> dict:
    """The loss scaler's state: what a step's overflow check and the next scale depend on
    (DeepSpeed's LossScaler or DynamicLossScaler; bf16 keeps a static scale of 1)."""
    if not hasattr(engine.optimizer, "loss_scaler"):  # BF16_Optimizer scales no loss
        return {}
    s = engine.optimizer.loss_scaler
    keys = ("cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "cur_hysteresis", "scale_window")
    return {"type": type(s).__name__, **{k: float(getattr(s, k)) for k in keys if hasattr(s, k)},
            "dynamic_loss_scale": bool(engine.optimizer.dynamic_loss_scale)}


def _save_world(rank, world, stage, port, out, extra):
    engine, plan = _engine(rank, world, stage, port, extra=extra)
    _train(engine, plan, rank, range(3))
    engine.save_checkpoint(out, tag="ck", save_latest=False)
    masters = _masters(engine)
    if rank == 0:
        torch.save(masters, Path(out, "masters.pt"))
        from airay.checkpoint.reshard import layout_of

        Path(out, "layout.json").write_text(json.dumps(layout_of(engine)))
        Path(out, "scaler.json").write_text(json.dumps(_loss_scaler(engine)))


def _load_world(rank, world, stage, port, out, extra, results):
    import deepspeed.comm as dist

    from airay.checkpoint.layout import Manifest
    from airay.checkpoint.loading import LoadPlan, load_engine, needed_files, trained_keys
    from airay.checkpoint.reshard import layout_of
    from airay.checkpoint.staging import Writer, install

    old = Path(out, "ck")
    names = sorted(p.name for p in old.iterdir() if p.name.endswith(".pt"))
    old_world = len([n for n in names if "optim_states" in n])
    manifest = Manifest(0, old_world, stage, {}, {n: None for n in names},
                        json.loads(Path(out, "layout.json").read_text()))
    engine, plan = _engine(rank, world, stage, port, extra=extra)
    layout = layout_of(engine)
    need = needed_files(manifest, rank, world, layout)
    trained = trained_keys(engine)
    paths = {n: str(old / n) for n in need}
    for n in (n for n in need if trained and n.endswith("_model_states.pt")):
        paths[n] = _garbled(old / n, trained, Path(out, f"garbled-{rank}-{n}"))
    lp = LoadPlan(manifest, rank, world, paths, layout, trained)
    staging = install(engine, Writer())
    staging.plan = lp
    before = _buffers(engine)  # the engine's masters and moments, built with it
    handed = {}
    served = lp.load

    def load(name):  # what DeepSpeed's loader is handed for this rank's optimizer file
        sd = served(name)
        if "optim_states" in name:
            handed.update(_buffers(engine, sd))
        return sd

    lp.load = load
    load_path, _ = load_engine(engine, lp, Path(out) / f"load-{rank}", "ck")
    staging.plan = None
    assert load_path is not None
    ours, ours_scaler = _state(engine, stage), _loss_scaler(engine)
    saved, masters = torch.load(Path(out, "masters.pt")), _masters(engine)
    masters_differ = [k for k in saved if not torch.equal(saved[k], masters[k])]
    ours_loss = _train(engine, plan, rank, [3])
    engine.destroy()
    dist.barrier()
    engine, plan = _engine(rank, world, stage, port, load_universal=True, first=False, extra=extra)
    engine.load_checkpoint(out, tag="ck_universal")
    theirs = _state(engine, stage)
    theirs_loss = _train(engine, plan, rank, [3])
    differ = sorted(set(ours) ^ set(theirs)) + [k for k in ours if k in theirs and not torch.equal(ours[k], theirs[k])]
    results[rank] = {"need": need, "layout": layout, "old_layout": manifest.layout, "compared": sorted(ours),
                     "garbled": sorted(trained),
                     "differ": differ, "masters_differ": masters_differ, "ours_loss": ours_loss, "theirs_loss": theirs_loss,
                     "scaler": ours_scaler, "optimizer": type(engine.optimizer.optimizer).__name__,
                     "wrapper": type(engine.optimizer).__name__,
                     # Of the optimizer file's tensors (fp32 masters, moments), those the reshard
                     # gathered into the engine's own buffers, and those the engine had and it did not.
                     "into_engine": sorted(k for k in handed if handed[k] == before.get(k)),
                     "apart": sorted(k for k in handed if k in before and handed[k] != before[k])}


def _buffers(engine, sd: dict | None = None) -> dict:
    """The storage address of each fp32 master partition and inner-optimizer state tensor, by
    group: the engine's own (`sd` None) or those of the optimizer file `sd` a load is handed."""
    from airay.checkpoint import reshard

    if sd is None:
        bufs = reshard.engine_buffers(engine) or {"fp32": [], "state": []}
        masters, states = bufs["fp32"], bufs["state"]
    else:
        osd = sd[reshard.OPTIMIZER_STATE_DICT]
        masters = osd.get(reshard.FP32_FLAT_GROUPS) or osd.get(reshard.SINGLE_PARTITION_OF_FP32_GROUPS) or []
        inner = osd.get(reshard.OPTIMIZER_STATE_DICT) or osd.get(reshard.BASE_OPTIMIZER_STATE) or {}
        states = [inner.get("state", {}).get(g, {}) for g in range(len(masters))]
    out = {f"fp32[{g}]": t.untyped_storage().data_ptr() for g, t in enumerate(masters)}
    for g, state in enumerate(states):
        out.update({f"{k}[{g}]": v.untyped_storage().data_ptr() for k, v in state.items() if torch.is_tensor(v) and v.dim() == 1})
    return out


def _garbled(path: Path, trained: frozenset, to: Path) -> str:
    """A copy of a model-states file whose trained weights are NaN bytes: a ZeRO-1/2 load must
    never read them (airay.checkpoint.loading.trained_keys), so the load still equals DeepSpeed's."""
    from airay.checkpoint.ranges import load_meta, storage_range, tensors_in

    data = bytearray(path.read_bytes())
    for where, t in tensors_in(load_meta(path)):
        if where.startswith("/module/") and where[len("/module/"):] in trained:
            lo, hi = storage_range(t)
            data[lo:hi] = b"\xff" * (hi - lo)
    to.write_bytes(bytes(data))
    return str(to)


def _universal(out):
    import contextlib
    import io
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(input_folder=f"{out}/ck", output_folder=f"{out}/ck_universal", num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)


# Sub-groups of 1,500 partition elements: the tiny GPT's ~42k parameters make a dozen or more at
# these world sizes, and where they end differs between 3 and 4 ranks (asserted below), as a
# 7B model's default 1e9-element sub-groups do between 8 and 6 ranks.
SMALL_SUB_GROUPS = {"zero_optimization": {"sub_group_size": 1500}}
BF16 = {"bf16": {"enabled": True}}
# Optimizer state in host memory, stepped by DeepSpeedCPUAdam (airay asks for torch's Adam on CPU
# engines; offload needs DeepSpeed's own, JIT-built on first use).
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}, "optimizer_params": {"torch_adam": False}}


def _with(*parts: dict) -> dict:
    """The DeepSpeed overrides of several layouts at once (their zero_optimization merged)."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


CASES = {  # id: (stage, old world, new world, DeepSpeed overrides)
    "zero2-4to3": (2, 4, 3, None),
    "zero3-3to4": (3, 3, 4, None),
    "zero1-2to3": (1, 2, 3, None),
    "zero3-subgroups-4to3": (3, 4, 3, SMALL_SUB_GROUPS),
    # The layouts users run: bf16 names its files bf16_..., keeps bf16 weights and fp32 masters.
    "zero2-bf16-4to3": (2, 4, 3, BF16),
    # bf16 + ZeRO-1 + fp32 gradient accumulation: DeepSpeed's BF16_Optimizer, not the ZeRO one.
    "zero1-bf16-fp32accum-3to2": (1, 3, 2, _with(BF16, {"data_types": {"grad_accum_dtype": "fp32"}})),
    # Sub-groups whose boundaries move: fp32 as the world shrinks, bf16 as it grows.
    "zero3-bf16-subgroups-3to4": (3, 3, 4, _with(BF16, SMALL_SUB_GROUPS)),
    "zero2-bf16-offload-3to4": (2, 3, 4, _with(BF16, OFFLOAD)),
    "zero3-bf16-offload-subgroups-4to3": (3, 4, 3, _with(BF16, OFFLOAD, SMALL_SUB_GROUPS)),
}


@pytest.mark.parametrize("stage,old,new,extra", CASES.values(), ids=CASES.keys())
def test_reshard_at_load_equals_deepspeeds_universal_checkpoint(tmp_path, stage, old, new, extra):
    out = str(tmp_path)
    worlds.spawn(_save_world, args=(old, stage, _port(), out, extra), nprocs=old)
    _universal(out)
    results = mp.Manager().dict()
    worlds.spawn(_load_world, args=(new, stage, _port(), out, extra, results), nprocs=new)
    results = dict(results)
    extra = extra or {}
    if "sub_group_size" in extra.get("zero_optimization", {}):  # sub-groups that end elsewhere at the new size
        old_cut, new_cut = ([len(g) for g in results[0][k]["param_numels"]] for k in ("old_layout", "layout"))
        assert len(old_cut) > 2 and old_cut != new_cut, (old_cut, new_cut)
    saved_scaler = json.loads(Path(out, "scaler.json").read_text())
    names = sorted(p.name for p in Path(out, "ck").iterdir() if "optim_states" in p.name)
    assert all(n.startswith("bf16_") == ("bf16" in extra) for n in names), names
    assert sorted(results) == list(range(new))
    for rank, r in results.items():
        # The same fp32 partition, moments, step and model partition as DeepSpeed's own reshard.
        assert r["differ"] == [], (rank, r["differ"])
        # Every parameter's fp32 master and moments as the old world saved them.
        assert r["masters_differ"] == [], (rank, r["masters_differ"])
        assert any(k.startswith("exp_avg_sq") for k in r["compared"]), r["compared"]
        assert r["ours_loss"] == pytest.approx(r["theirs_loss"], rel=1e-6)
        assert r["scaler"] == saved_scaler, rank  # DeepSpeed's universal load keeps no loss scale: the saved one
        assert r["optimizer"] == ("DeepSpeedCPUAdam" if "offload_optimizer" in extra.get("zero_optimization", {})
                                  else "AdamW")
        assert r["wrapper"] == ("BF16_Optimizer" if "data_types" in extra else
                                "DeepSpeedZeroOptimizer_Stage3" if stage == 3 else "DeepSpeedZeroOptimizer")
        # ZeRO-1/2: every trained weight of the model file was garbage, never read (the weights
        # came from the masters); the model's own partition above still equals DeepSpeed's.
        assert (len(r["garbled"]) > 0) == (stage in (1, 2)), r["garbled"]
        # The new partition's masters went straight into the engine's (and any optimizer state
        # the engine already held into its own; Adam makes its moments at the first step): not
        # held twice while the load ran. Not under BF16_Optimizer, whose loader pads them itself.
        if "data_types" in extra:
            assert r["into_engine"] == [], (rank, r["into_engine"])
        else:
            assert r["apart"] == [] and any(k.startswith("fp32[") for k in r["into_engine"]), \
                (rank, r["into_engine"], r["apart"])
        # Each new rank read at most the old partitions that overlap its own (plus the model file).
        optim = [n for n in r["need"] if "optim_states" in n]
        assert 1 <= len(optim) <= -(-old // new) + 1, (rank, optim)


def test_reshard_zero12_slices_each_partition_and_keeps_empty_state_empty():
    """The slicing itself, on small made-up partitions: 2 old ranks of 5 elements (total 9, one
    of padding) to 3 new ranks of 3; and a save before the optimizer's first step (no state)."""
    from airay.checkpoint import reshard

    flat = torch.arange(9.0)

    def old_file(r, with_state=True):
        part = torch.cat([flat, torch.zeros(1)])[r * 5:(r + 1) * 5]
        base = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": part * 10}} if with_state else {},
                "param_groups": [{"lr": 0.1, "params": [0]}]}
        return {"optimizer_state_dict": {"base_optimizer_state": base,
                                         "single_partition_of_fp32_groups": [flat[r * 5:min((r + 1) * 5, 9)]],
                                         "group_paddings": [1 if r == 1 else 0], "partition_count": [2]}}

    old = {r: old_file(r) for r in (0, 1)}
    for rank, want in enumerate(([0, 1, 2], [3, 4, 5], [6, 7, 8])):
        new = reshard.reshard_zero12(old, 2, rank, 3, [5], [3], [9])["optimizer_state_dict"]
        assert new["single_partition_of_fp32_groups"][0].tolist() == want
        assert new["base_optimizer_state"]["state"][0]["exp_avg"].tolist() == [10 * w for w in want]
        assert new["base_optimizer_state"]["state"][0]["step"].item() == 3.0
        assert new["partition_count"] == [3] and new["group_paddings"] == [0]
    assert reshard.ranks_needed(2, 2, 1, 3, partitions=[5], new_partitions=[3], totals=[9]) == [0, 1]
    empty = {r: old_file(r, with_state=False) for r in (0, 1)}
    new = reshard.reshard_zero12(empty, 2, 2, 3, [5], [3], [9])["optimizer_state_dict"]
    assert new["base_optimizer_state"]["state"] == {} and new["single_partition_of_fp32_groups"][0].tolist() == [6, 7, 8]


def test_reshard_keeps_the_dynamic_loss_scalers_state():
    """fp16's dynamic loss scale (scale, iterations since the last overflow, hysteresis) lives in
    every rank's optimizer file, the same on all: the resharded file keeps the old one's, at
    ZeRO-1/2 and ZeRO-3. (fp16 engines do not run on this CPU accelerator; DeepSpeed's own
    DynamicLossScaler is used here.) 2 old ranks -> 3 new, one parameter of 9 elements."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from airay.checkpoint import reshard

    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 2.0**12, 57, 41, 1
    global_state = {"loss_scaler": scaler, "dynamic_loss_scale": True, "overflow": False}
    flat = torch.arange(10.0)  # 9 elements and one of padding, cut in 2 partitions of 5

    def zero12_file(r):
        return {"optimizer_state_dict": {
            **global_state, "base_optimizer_state": {"state": {0: {"exp_avg": flat[r * 5:(r + 1) * 5]}},
                                                     "param_groups": [{"params": [0]}]},
            "single_partition_of_fp32_groups": [flat[r * 5:min((r + 1) * 5, 9)]]}}

    def zero3_file(r):
        part = flat[r * 5:(r + 1) * 5]
        return {"optimizer_state_dict": {
            **global_state, "optimizer_state_dict": {"state": {0: {"exp_avg": part}}, "param_groups": [{"params": [0]}]},
            "fp32_flat_groups": [part]}}

    for rank in range(3):
        new12 = reshard.reshard_zero12({r: zero12_file(r) for r in (0, 1)}, 2, rank, 3, [5], [3], [9])
        new3 = reshard.reshard_zero3({r: zero3_file(r) for r in (0, 1)}, 2, rank, 3,
                                     {"param_numels": [[9]]}, {"param_numels": [[9]]})
        for new in (new12, new3):
            osd = new["optimizer_state_dict"]
            kept = osd["loss_scaler"]
            assert isinstance(kept, DynamicLossScaler) and osd["dynamic_loss_scale"] is True
            assert (kept.cur_scale, kept.cur_iter, kept.last_overflow_iter, kept.cur_hysteresis) == (2.0**12, 57, 41, 1)
        assert new3["optimizer_state_dict"]["fp32_flat_groups"][0].tolist() == [3.0 * rank, 3.0 * rank + 1, 3.0 * rank + 2]


def test_layouts_airay_cannot_reshard_raise_at_load_naming_the_key():
    """A run resumed with another config can still meet such a checkpoint (airay.config refuses
    the keys only for a world that can change size): the load stops, naming the key, instead of
    handing DeepSpeed misplaced partitions."""
    from airay.checkpoint import reshard
    from airay.checkpoint.layout import Manifest
    from airay.checkpoint.loading import CheckpointIncompatible, LoadPlan

    round_robin = Manifest(0, 4, 2, {}, {}, {"partitions": [5], "totals": [18], "round_robin_gradients": True})
    with pytest.raises(CheckpointIncompatible, match="zero_optimization.round_robin_gradients"):
        LoadPlan(round_robin, 0, 3, {}, {"partitions": [6], "totals": [18]}).load(reshard.optim_file(0))
    assert reshard.unreshardable({"partitions": [5]}, {"partitions": [6]}) is None
    elastic = {r: {"optimizer_state_dict": {"base_optimizer_state": [{"exp_avg": torch.zeros(9)}],
                                            "single_partition_of_fp32_groups": [torch.zeros(5)]}} for r in (0, 1)}
    with pytest.raises(ValueError, match="zero_optimization.elastic_checkpoint"):
        reshard.reshard_zero12(elastic, 2, 0, 3, [5], [3], [9])

"""Building the model partitioned (airay.worker.build) on a real world of 4 gloo processes: under
ZeRO-3 no rank holds the whole model while it is built, the weights are those of the whole
model built as usual, and a build for a checkpoint to fill initialises nothing."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests import worlds
from tests.test_reshard import _port

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
# About 25M parameters (101 MB in fp32); its largest layer (an MLP matrix) is 4 MB.
MODEL = {"d_model": 512, "n_layers": 8, "n_heads": 8, "seq_len": 8}
LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16}


def _peak_rss_during(fn):
    """(fn(), the process's peak RSS while it ran, less its RSS before: airay.worker.memory)."""
    from airay.worker.memory import peak_since, start_peak

    before = start_peak()
    out = fn()
    return out, peak_since(before)


def _world(rank, port, results):
    import deepspeed

    sys.path.insert(0, str(ROOT))
    from airay.models import hf, tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.build import build_model, hf_zero3
    from airay.worker.deepspeed_compat import disable_cpu_shm_comm, preload_for_zero_init, reset_zero3_globals
    from airay.worker.engine import engine_config

    torch.set_num_threads(1)
    disable_cpu_shm_comm()
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0"})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    cfg = engine_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}},
                        plan_batch(8, 2, WORLD), True, False)
    preload_for_zero_init()  # an import of ~70 MB, which the workers make before their first build
    out = {}
    for name, init in (("init", True), ("for_load", False)):
        reset_zero3_globals()
        model, peak = _peak_rss_during(lambda: build_model(tiny_gpt.build, MODEL, 0, cfg, init_weights=init))
        params = dict(model.named_parameters())
        out[name] = {"peak": peak, "model_bytes": sum(p.ds_numel * 4 for p in params.values()),
                     "partitions": {k: (p.ds_tensor.numel(), p.ds_numel, p.numel()) for k, p in params.items()}}
        if init:  # the partitioned build's weights, gathered, against the whole model built as usual
            whole, out["whole_peak"] = _peak_rss_during(lambda: tiny_gpt.build(seed=0, **MODEL))
            with deepspeed.zero.GatheredParameters(list(params.values())):
                out["equal"] = all(torch.equal(p.data, whole.get_parameter(k)) for k, p in params.items())
            del whole
        del model, params
    keep = hf_zero3(cfg)  # transformers' own zero.Init path, random init and for a load
    for name, build in (("hf", hf.build), ("hf_for_load", hf.without_weights)):
        reset_zero3_globals()
        model = build_model(build, {"config": LLAMA}, 0, cfg, init_weights=name == "hf")
        out[name] = {k: (p.ds_tensor.numel(), p.ds_numel, p.numel()) for k, p in model.named_parameters()}
    def unmarked(seed=0, **kwargs):  # a factory of one's own around transformers, not declared
        return hf.build(seed, **kwargs)

    try:
        build_model(unmarked, {"config": LLAMA}, 0, cfg)
        out["unmarked"] = None
    except TypeError as exc:
        out["unmarked"] = str(exc)
    del keep
    results[rank] = out


def test_zero3_builds_each_rank_only_its_partition_with_the_whole_models_weights():
    # glibc as it is (no malloc variables): airay hands the heap's free pages back while it builds
    # (airay.worker.build.trimming_heap). With TRIM_EVERY_BYTES = 0 this fails on every try here
    # (a rank's first build at 0.60-0.72 of the model's bytes: the freed layers kept in the heap);
    # with it, 0.33-0.38 on every rank. Ranks start fresh (spawn), as Ray starts a worker: forked
    # from tests.worlds' server, whose heap they inherit, the same build peaks at 0.47.
    results = mp.Manager().dict()
    mp.spawn(_world, args=(_port(), results), nprocs=WORLD)
    results = dict(results)
    assert sorted(results) == list(range(WORLD))
    for rank, r in results.items():
        for name in ("init", "for_load", "hf", "hf_for_load"):
            parts = r[name]["partitions"] if name in ("init", "for_load") else r[name]
            # Every parameter is a partition of ceil(n / world) elements; its full tensor is gone.
            assert parts and all(local == math.ceil(n / WORLD) and held == 0 for local, n, held in parts.values()), \
                (rank, name)
        model_bytes = r["init"]["model_bytes"]
        assert model_bytes > 90e6
        # Peak RSS while building: the partition (a quarter) plus a layer, not the model; the same
        # process building it whole peaks at the model's bytes (the measurement sees a whole build).
        assert r["init"]["peak"] < 0.45 * model_bytes, (rank, r["init"]["peak"], model_bytes)
        assert r["for_load"]["peak"] < 0.45 * model_bytes, (rank, r["for_load"]["peak"], model_bytes)
        assert r["whole_peak"] > 0.9 * model_bytes, (rank, r["whole_peak"])
        assert r["equal"], rank  # the same initial weights as the whole model from the same seed
        assert "builds_partitioned = True" in r["unmarked"] and "LlamaForCausalLM" in r["unmarked"]


def test_a_build_for_a_checkpoint_leaves_parameters_uninitialised_and_restores_torchs_initialisers():
    from airay.worker.build import no_weight_init

    torch.manual_seed(0)
    expected = torch.nn.Linear(64, 64).weight.detach().clone()
    state = torch.random.get_rng_state()
    with no_weight_init():
        layer = torch.nn.Linear(64, 64)
    assert torch.equal(torch.random.get_rng_state(), state)  # no initialiser drew a random number
    torch.manual_seed(0)
    assert torch.equal(torch.nn.Linear(64, 64).weight, expected)  # initialisers are back
    assert layer.weight.shape == (64, 64)
    with pytest.raises(RuntimeError), no_weight_init():
        raise RuntimeError("a factory's error")
    torch.manual_seed(0)
    assert torch.equal(torch.nn.Linear(64, 64).weight, expected)  # back after an error too


def _rebuild(rank, port, stage, results):
    import gc
    import weakref

    sys.path.insert(0, str(ROOT))
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.build import build_model
    from airay.worker.deepspeed_compat import reset_zero3_globals
    from airay.worker.engine import backward_micro_batch, build_engine, drop_engine, engine_config

    worlds.join(0, 1, port)
    plan = plan_batch(2, 2, 1)
    cfg = engine_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}},
                        plan, True, False)
    reset_zero3_globals()
    engine = build_engine(build_model(tiny_gpt.build, {"d_model": 64, "n_layers": 2}, 0, cfg), cfg, plan, "cpu")
    for _ in range(3):  # ZeRO-3 records its parameter trace in the first step and releases by it after
        backward_micro_batch(engine, tiny_gpt.loss(engine, {"tokens": torch.randint(0, 256, (2, 9))}), 2, plan)
    dropped = [weakref.ref(engine), weakref.ref(engine.optimizer), weakref.ref(engine.module)]
    drop_engine(engine)
    del engine
    gc.collect()
    results[stage] = [ref() is None for ref in dropped]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_dropped_engine_is_freed_so_a_resize_does_not_keep_the_world_befores_state(stage):
    # Each resize builds a new engine in the same process: the one before must go (ZeRO-3 kept
    # it alive through DeepSpeed's module stack, and through a method cache of its parameter
    # coordinator once a step had released by the trace: a whole engine's state more per rank per
    # resize).
    results = mp.Manager().dict()
    worlds.spawn(_rebuild, args=(_port(), stage, results), nprocs=1)
    assert results[stage] == [True, True, True]  # engine, optimizer (and its state), module


def _counting(calls, name, fn):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return counted


def _two_steps(rank, plan):
    """step(engine, s): rank `rank`'s micro-batch of step s (0 or 1) through `engine`; its loss."""
    from airay.models import tiny_gpt
    from airay.worker.engine import backward_micro_batch

    batches = [{"tokens": torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(10 * s + rank))}
               for s in range(2)]

    def step(engine, s):
        loss = tiny_gpt.loss(engine, batches[s])
        backward_micro_batch(engine, loss, 1, plan)
        return float(loss)
    return step


def _resize_build(rank, port, ckpt, results):
    """Rank `rank` of a world of 2: an engine as DeepSpeed builds it trains a step and saves; then
    airay's build for that checkpoint (a resize's) loads it, and both train the next step."""
    import collections

    import deepspeed
    import deepspeed.comm as dist

    sys.path.insert(0, str(ROOT))
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.build import build_model
    from airay.worker.deepspeed_compat import reset_zero3_globals
    from airay.worker.engine import build_engine, drop_engine, engine_config

    worlds.join(rank, 2, port)
    plan = plan_batch(2, 1, 2)
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    cfg = engine_config(base, plan, True, False)
    calls = collections.Counter()  # the collectives of zero.Init's broadcast and a parameter's gather
    dist.broadcast = _counting(calls, "broadcast", dist.broadcast)
    dist.all_gather_into_tensor = _counting(calls, "all_gather", dist.all_gather_into_tensor)
    step = _two_steps(rank, plan)

    out = {}
    reset_zero3_globals()
    model = build_model(tiny_gpt.build, {"d_model": 64, "n_layers": 2}, 0, cfg)
    out["params"], out["init_broadcasts"] = len(list(model.parameters())), calls["broadcast"]
    calls.clear()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      dist_init_required=False)  # DeepSpeed as it is
    out["deepspeed_gathers"] = calls["all_gather"]
    step(engine, 0)
    engine.save_checkpoint(ckpt, tag="s1", save_latest=False)
    out["reference"] = step(engine, 1)
    drop_engine(engine)
    del engine, model
    reset_zero3_globals()
    calls.clear()
    model = build_model(tiny_gpt.build, {"d_model": 64, "n_layers": 2}, 0, cfg, init_weights=False)
    out["load_broadcasts"] = calls["broadcast"]
    calls.clear()
    engine = build_engine(model, base, plan, "cpu")
    out["airay_gathers"] = calls["all_gather"]
    engine.load_checkpoint(ckpt, tag="s1")
    out["resumed"] = step(engine, 1)
    results[rank] = out


def test_a_build_for_a_checkpoint_moves_no_weights_between_ranks_and_resumes_exactly(tmp_path):
    # zero.Init broadcasts rank 0's copy of every parameter, and ZeRO-3's optimizer gathered every
    # parameter whole to register its gradient hooks: the whole model over the network per rank at
    # each build (deepspeed 0.19). A build whose weights a checkpoint overwrites needs neither
    # (deepspeed_compat.zero_init_without_broadcast, grad_hooks_without_gathering).
    results = mp.Manager().dict()
    worlds.spawn(_resize_build, args=(_port(), str(tmp_path), results), nprocs=2)
    for rank, r in dict(results).items():
        # The counters see them where DeepSpeed makes them: a broadcast and a gather per parameter.
        assert r["init_broadcasts"] == r["params"] and r["deepspeed_gathers"] >= r["params"], (rank, r)
        assert r["load_broadcasts"] == 0 and r["airay_gathers"] < r["params"] // 4, (rank, r)
        assert r["resumed"] == r["reference"], (rank, r)  # bit for bit: the same weights and moments


def _replicated_build_for_load(rank, port, ckpt, stage, results):
    """Rank `rank` of a world of 2 at ZeRO `stage` (0-2: every rank holds the whole model): an
    engine trains a step and saves; then a build for that checkpoint, whose "uninitialised"
    weights are made NaN on purpose, loads it as a resize does, and both train the next step."""
    import deepspeed  # noqa: F401 - DeepSpeed's accelerator before the engine

    sys.path.insert(0, str(ROOT))
    import airay.worker.build as build
    from airay.checkpoint.loading import _without, trained_keys
    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.engine import build_engine, drop_engine, engine_config

    worlds.join(rank, 2, port)
    plan = plan_batch(2, 1, 2)
    cfg = engine_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}},
                        plan, True, False)
    step = _two_steps(rank, plan)

    small = {"d_model": 64, "n_layers": 2}
    engine = build_engine(build.build_model(tiny_gpt.build, small, 0, cfg), cfg, plan, "cpu")
    step(engine, 0)
    engine.save_checkpoint(ckpt, tag="s1", save_latest=False)
    out = {"reference": step(engine, 1)}
    drop_engine(engine)
    del engine
    def nan(tensor, *args, **kwargs):  # where an initialiser would have written
        with torch.no_grad():
            return tensor.fill_(float("nan"))

    build._keep = nan
    model = build.build_model(tiny_gpt.build, small, 0, cfg, init_weights=False)
    out["built_nan"] = all(bool(torch.isnan(p).all()) for p in model.parameters())
    engine = build_engine(model, cfg, plan, "cpu")
    trained = trained_keys(engine)  # ZeRO-1/2: from the fp32 masters, as airay's load (load_engine) does
    out["from_masters"] = len(trained)
    engine.load_checkpoint(ckpt, tag="s1", custom_load_fn=_without(trained) if trained else None)
    if trained:
        engine.optimizer.update_lp_params()
    out["resumed"] = step(engine, 1)
    results[rank] = out


@pytest.mark.parametrize("stage", [0, 2])
def test_a_replicated_build_for_a_checkpoint_initialises_nothing_and_resumes_exactly(tmp_path, stage):
    # Stages 0-2 hold the whole model on every rank: a survivor's resize ran the factory's random
    # initialisation (about a second a rank at 101M parameters here) for weights the load replaces.
    results = mp.Manager().dict()
    worlds.spawn(_replicated_build_for_load, args=(_port(), str(tmp_path), stage, results), nprocs=2)
    for rank, r in dict(results).items():
        assert r["built_nan"], (rank, r)  # no initialiser wrote a parameter: each went through _keep
        assert (r["from_masters"] > 0) == (stage > 0), (rank, r)
        assert r["resumed"] == r["reference"], (rank, r)  # bit for bit, whatever the build left in memory

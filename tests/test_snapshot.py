"""The host-snapshot checkpoint engine on a real one-rank DeepSpeed engine (gloo, no Ray)."""

import os

import pytest
import torch

from airay import snapshot


def test_snapshot_is_a_private_copy_and_keeps_container_types():
    from collections import OrderedDict, defaultdict

    w = torch.ones(4)
    state = {"module": OrderedDict(w=w, view=w[:2]), "opt": defaultdict(list, {"s": [w, (w, 3)]}), "lr": 0.1}
    snap = snapshot.snapshot(state)
    w.mul_(5)  # the optimizer's in-place update after the save returned
    assert torch.equal(snap["module"]["w"], torch.ones(4)) and torch.equal(snap["opt"]["s"][1][0], torch.ones(4))
    assert snap["module"]["view"].untyped_storage().size() == 2 * 4  # compact: not the whole base storage
    assert type(snap["module"]) is OrderedDict and snap["opt"].default_factory is list and snap["lr"] == 0.1


def test_a_later_snapshot_copies_into_the_earlier_ones_buffers_where_shapes_match():
    w, b = torch.ones(4), torch.zeros(2, dtype=torch.int64)
    made = []
    first = snapshot.snapshot({"w": w, "b": b}, None, made)
    w.add_(1)
    b = torch.zeros(3, dtype=torch.int64)  # a tensor whose shape changed gets a fresh buffer
    again = []
    second = snapshot.snapshot({"w": w, "b": b}, made, again)
    assert second["w"].data_ptr() == first["w"].data_ptr() and torch.equal(second["w"], torch.full((4,), 2.0))
    assert second["b"].shape == (3,) and second["b"].data_ptr() != b.data_ptr()
    assert [t.data_ptr() for t in again] == [second["w"].data_ptr(), second["b"].data_ptr()]


def test_deferred_tensors_get_a_buffer_now_and_their_copy_later_the_rest_is_copied_at_once():
    param, buffer = torch.ones(4), torch.zeros(3)
    later = []
    snap = snapshot.snapshot({"param": param, "buffer": buffer, "view": param[1:3]}, None, None,
                             {param.untyped_storage().data_ptr()}, later)
    # Forward updates a buffer in place (running statistics): its copy was made inside the save.
    buffer.add_(7)
    assert torch.equal(snap["buffer"], torch.zeros(3))
    assert [src.data_ptr() for _, src in later] == [param.data_ptr(), param[1:3].data_ptr()]
    snapshot.copy_pairs(later)  # what the copy thread does before the next optimizer step
    assert torch.equal(snap["param"], torch.ones(4)) and torch.equal(snap["view"], torch.ones(2))
    assert snap["view"].untyped_storage().size() == 2 * 4  # compact, as the immediate copy is


def test_writer_reraises_a_failed_write_unless_the_save_is_thrown_away():
    writer = snapshot.Writer()
    writer.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        writer.wait()
    writer.submit(lambda: 1 / 0)
    assert writer.wait(raise_errors=False) == 1 and writer.wait() == 0


@pytest.fixture(params=[1, 3], ids=["zero1", "zero3"])
def engine(request):
    import deepspeed
    import deepspeed.comm as dist

    from airay.models import tiny_gpt
    from airay.policy import BatchPlan
    from airay.worker import free_port
    from airay.worker.deepspeed_compat import disable_cpu_shm_comm as _disable_cpu_shm_comm
    from airay.worker.engine import engine_config

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    _disable_cpu_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    model = tiny_gpt.build(d_model=32, n_layers=2, n_heads=2, seq_len=8)
    cfg = engine_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": request.param}},
                        BatchPlan(1, 2, 2, 1), on_cpu=True, load_universal=False)
    from airay.worker.deepspeed_compat import reset_zero3_globals as _reset_zero3_globals

    _reset_zero3_globals()
    eng, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    yield eng
    eng.destroy()
    dist.destroy_process_group()


def _train_step(eng, seed):
    from airay.models import tiny_gpt

    g = torch.Generator().manual_seed(seed)
    eng.backward(tiny_gpt.loss(eng, {"tokens": torch.randint(0, 256, (2, 9), generator=g)}))
    eng.step()


def _files(d):
    return {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file()}


def test_async_save_writes_the_state_at_the_save_in_deepspeeds_layout(engine, tmp_path):
    import threading
    import time

    _train_step(engine, 0)
    engine.save_checkpoint(str(tmp_path / "sync"), tag="native", save_latest=False)  # DeepSpeed's own engine
    writer = snapshot.Writer()
    snapshot.install(engine, writer)
    hold = threading.Event()

    class Held:  # a copy that lasts until `hold` is set: the save's copies queue behind it
        def copy_(self, src):
            hold.wait()

    writer.copy_later([(Held(), None)])
    engine.save_checkpoint(str(tmp_path / "async"), tag="native", save_latest=False)
    ck = engine.checkpoint_engine
    # Parameters and optimizer state (nearly all the bytes) are copied beside the next step.
    assert writer.copying() and ck.deferred_bytes > 9 * ck.copied_bytes
    # Training goes on: forward and backward while the copies wait, then the optimizer step,
    # which waits for them (released a moment later: without that wait the step would update
    # the weights and moments before they were copied, and the files below would differ).
    from airay.models import tiny_gpt

    engine.backward(tiny_gpt.loss(engine, {"tokens": torch.randint(0, 256, (2, 9))}))
    threading.Thread(target=lambda: (time.sleep(0.3), hold.set())).start()
    engine.step()
    assert writer.take_copy_wait() > 0 and not writer.copying()
    _train_step(engine, 1)  # weights and optimizer state change while the files may still be written
    assert writer.wait() >= 2  # model states and the ZeRO optimizer partition
    sync, async_ = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert set(async_) == set(sync)  # same files, same names
    for name, path in ((n, p) for n, p in async_.items() if n.endswith(".pt")):
        a = torch.load(path, weights_only=False)
        b = torch.load(sync[name], weights_only=False)
        flat_a, flat_b = _tensors(a), _tensors(b)
        assert flat_a.keys() == flat_b.keys() and flat_a
        assert all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), name
    # And DeepSpeed loads it: the state at the save, not the later step's.
    engine.load_checkpoint(str(tmp_path / "async"), tag="native")
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.load_checkpoint(str(tmp_path / "sync"), tag="native")
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    # ds_to_universal reads it as it reads DeepSpeed's own (what loading at another world size needs;
    # once: ZeRO-3's conversion is covered at real world sizes by tests/test_elastic.py).
    from airay.checkpoint import UNIVERSAL_TAG, convert_to_universal

    if engine.zero_optimization_stage() == 3:
        return
    convert_to_universal(tmp_path / "sync")
    convert_to_universal(tmp_path / "async")
    uni_sync, uni_async = _files(tmp_path / "sync" / UNIVERSAL_TAG), _files(tmp_path / "async" / UNIVERSAL_TAG)
    assert set(uni_sync) == set(uni_async) and any(n.endswith("fp32.pt") for n in uni_async)
    for name in (n for n in uni_async if n.endswith(".pt")):
        a, b = _tensors(torch.load(uni_async[name], weights_only=False)), _tensors(torch.load(uni_sync[name], weights_only=False))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def _tensors(item, prefix=""):
    if torch.is_tensor(item):
        return {prefix: item}
    out = {}
    if isinstance(item, dict):
        for k, v in item.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(item, (list, tuple)):
        for i, v in enumerate(item):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out

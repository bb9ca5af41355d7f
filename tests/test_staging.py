"""The staging checkpoint engine on a real one-rank DeepSpeed engine (gloo, no Ray); a ZeRO-3 save
on a world of 2."""

import os
import zlib

import pytest
import torch

from airay.checkpoint import staging
from airay.checkpoint.checksum import is_sidecar, unpack_crcs


def test_stage_keeps_live_tensors_without_copying_and_clones_the_rest():
    from collections import OrderedDict, defaultdict

    base = torch.zeros(10)
    param, buffer = base[2:6], torch.ones(3)
    counts = {"live": 0, "cloned": 0}
    staged = staging.stage({"module": OrderedDict(param=param, buffer=buffer), "opt": defaultdict(list, {"s": [buffer]}),
                            "lr": 0.1}, {base.untyped_storage().data_ptr()}, counts)
    # The parameter is written from the live tensor (no copy), on a storage of its own 4 elements.
    assert staged["module"]["param"].data_ptr() == param.data_ptr()
    assert staged["module"]["param"].untyped_storage().nbytes() == 4 * 4
    buffer.add_(7)  # forward updates a buffer in place after the save returned: its clone did not move
    assert torch.equal(staged["module"]["buffer"], torch.ones(3)) and torch.equal(staged["opt"]["s"][0], torch.ones(3))
    assert type(staged["module"]) is OrderedDict and staged["opt"].default_factory is list and staged["lr"] == 0.1
    assert counts == {"live": 16, "cloned": 24}


def test_own_storage_rewraps_contiguous_views_and_clones_strided_ones():
    base = torch.arange(12.0)
    view = staging.own_storage(base[3:7])
    assert view.data_ptr() == base[3:7].data_ptr() and view.untyped_storage().nbytes() == 16
    strided = staging.own_storage(base.view(3, 4)[:, 1])
    assert strided.data_ptr() != base.data_ptr() and torch.equal(strided, torch.tensor([1.0, 5.0, 9.0]))
    assert staging.own_storage(base) is base


def test_writer_computes_each_files_crc_and_reraises_a_failed_write(tmp_path):
    writer = staging.Writer()
    writer.submit(str(tmp_path / "a.pt"), {"x": torch.arange(100)}, live=True)
    writer.wait_live()
    assert writer.wait() == 1
    written = writer.take_written()
    path = str(tmp_path / "a.pt")
    data, side = (tmp_path / "a.pt").read_bytes(), (tmp_path / "a.pt.crc32").read_bytes()
    assert sorted(written) == [path, path + ".crc32"]  # the file and its CRC sidecar, each checked as a file
    assert written[path] == (len(data), zlib.crc32(data)) and torch.equal(torch.load(path)["x"], torch.arange(100))
    assert written[path + ".crc32"] == (len(side), zlib.crc32(side))
    chunk = writer.take_chunks()[path]  # the sidecar: zlib's CRC-32 of every chunk, little-endian uint32s
    assert unpack_crcs(side) == [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)]
    writer.submit(str(tmp_path / "missing-dir" / "b.pt"), {}, live=False)
    with pytest.raises(FileNotFoundError):
        writer.wait()
    writer.submit(str(tmp_path / "missing-dir" / "c.pt"), {}, live=False)
    assert writer.wait(raise_errors=False) == 1 and writer.wait() == 0


def test_a_saves_writes_wait_for_the_room_made_for_them_and_the_save_call_does_not(tmp_path):
    # The memory budget's removals of old steps run on the stores; the files of the save they make
    # room for must not land before they are done (the tier would outgrow its budget meanwhile).
    import threading

    writer, room = staging.Writer(), threading.Event()
    writer.after(lambda: room.wait(timeout=60))
    writer.submit(str(tmp_path / "a.pt"), {"x": torch.arange(10)}, live=True)  # returns: the call is not held
    assert not room.wait(timeout=0.3) and not (tmp_path / "a.pt").exists() and writer.writing()
    room.set()
    assert writer.wait() == 1 and torch.equal(torch.load(tmp_path / "a.pt")["x"], torch.arange(10))


@pytest.fixture(params=[1, 3], ids=["zero1", "zero3"])
def engine(request):
    import deepspeed
    import deepspeed.comm as dist

    from airay.models import tiny_gpt
    from airay.policy import BatchPlan
    from airay.worker import free_port
    from airay.worker.deepspeed_compat import disable_cpu_shm_comm, reset_zero3_globals
    from airay.worker.engine import build_engine

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    disable_cpu_shm_comm()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    reset_zero3_globals()
    model = tiny_gpt.build(d_model=32, n_layers=2, n_heads=2, seq_len=8)
    eng = build_engine(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                               "zero_optimization": {"stage": request.param}}, BatchPlan(1, 2, 2, 1), "cpu")
    yield eng
    eng.destroy()
    dist.destroy_process_group()


def _train_step(eng, seed):
    from airay.models import tiny_gpt

    g = torch.Generator().manual_seed(seed)
    eng.backward(tiny_gpt.loss(eng, {"tokens": torch.randint(0, 256, (2, 9), generator=g)}))
    eng.step()


def _files(d):
    return {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file() and p.suffix == ".pt"}


def test_staged_save_writes_the_state_at_the_save_in_deepspeeds_layout(engine, tmp_path):
    import threading
    import time

    _train_step(engine, 0)
    engine.save_checkpoint(str(tmp_path / "sync"), tag="native", save_latest=False)  # DeepSpeed's own engine
    writer = staging.Writer()
    staging.install(engine, writer)
    hold = threading.Event()
    writer._pool.submit(hold.wait)  # the writer is busy: this save's writes queue behind
    engine.save_checkpoint(str(tmp_path / "staged"), tag="native", save_latest=False)
    ck = engine.checkpoint_engine
    # Parameters and optimizer state (nearly all the bytes) are written from the live tensors.
    assert writer.writing() and ck.live_bytes > 9 * ck.cloned_bytes
    # Training goes on: forward and backward while the writes wait, then the optimizer step, which
    # waits for them (released a moment later: without that wait the step would update the
    # weights and moments before they were written, and the files below would differ).
    from airay.models import tiny_gpt

    engine.backward(tiny_gpt.loss(engine, {"tokens": torch.randint(0, 256, (2, 9))}))
    threading.Thread(target=lambda: (time.sleep(0.3), hold.set())).start()
    engine.step()
    assert writer.take_wait() > 0.2
    _train_step(engine, 1)  # weights and optimizer state change after the files are written
    assert writer.wait() >= 2  # model states and the ZeRO optimizer partition
    written = {p: v for p, v in writer.take_written().items() if not is_sidecar(p)}
    sync, staged = _files(tmp_path / "sync"), _files(tmp_path / "staged")
    assert set(staged) == set(sync) and {os.path.basename(p) for p in written} == {os.path.basename(n) for n in staged}
    for name, path in staged.items():
        data = path.read_bytes()
        assert written[str(path)] == (len(data), zlib.crc32(data))  # computed as it was written
        a, b = _tensors(torch.load(path, weights_only=False)), _tensors(torch.load(sync[name], weights_only=False))
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), name
        # Each tensor saved its own elements, not the flat buffer it views (ZeRO's).
        assert path.stat().st_size < 2 * sync[name].stat().st_size
    # And DeepSpeed loads it: the state at the save, not the later step's.
    engine.load_checkpoint(str(tmp_path / "staged"), tag="native")
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.load_checkpoint(str(tmp_path / "sync"), tag="native")
    assert all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())


def _save_world(rank, port, tmp, results):
    """Rank `rank` of a ZeRO-3 world of 2: DeepSpeed's save, then airay's, of the same state,
    counting the all-gathers each makes."""
    import deepspeed.comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from airay.models import tiny_gpt
    from airay.policy import plan_batch
    from airay.worker.build import build_model
    from airay.worker.deepspeed_compat import reset_zero3_globals, save_keeping_gathered
    from airay.worker.engine import backward_micro_batch, build_engine, engine_config
    from tests import worlds

    worlds.join(rank, 2, port)
    reset_zero3_globals()
    plan = plan_batch(2, 1, 2)
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 3}}
    engine = build_engine(build_model(tiny_gpt.build, {"d_model": 64, "n_layers": 2}, 0, engine_config(base, plan, True, False)),
                          base, plan, "cpu")
    batch = {"tokens": torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(rank))}
    backward_micro_batch(engine, tiny_gpt.loss(engine, batch), 1, plan)
    gathers = []
    dist.all_gather_into_tensor = lambda *a, _f=dist.all_gather_into_tensor, **k: gathers.append(1) or _f(*a, **k)
    kept = engine.optimizer.persistent_parameters
    before = [(p.data, p.data.clone()) for p in kept]  # held: a new gather cannot reuse their memory
    engine.save_checkpoint(f"{tmp}/deepspeed", tag="t", save_latest=False)
    out = {"kept": len(kept), "deepspeed_gathers": len(gathers)}
    before, gathers[:] = [(p.data, p.data.clone()) for p in kept], []
    with save_keeping_gathered(engine):
        engine.save_checkpoint(f"{tmp}/airay", tag="t", save_latest=False)
    out["airay_gathers"] = len(gathers)
    # The very tensors they had, whole and available, and the hooks gone with the block.
    out["same_tensors"] = [p.data_ptr() for p in kept] == [t.data_ptr() for t, _ in before]
    out["available"] = all(p.ds_status == ZeroParamStatus.AVAILABLE and torch.equal(p.data, d) for p, (_, d) in zip(kept, before))
    out["hooks_left"] = "checkpoint_event_epilogue" in vars(engine.optimizer)
    out["loss_after"] = float(tiny_gpt.loss(engine, batch))
    engine.load_checkpoint(f"{tmp}/deepspeed", tag="t")
    out["loss_from_deepspeeds"] = float(tiny_gpt.loss(engine, batch))
    results[rank] = out


def test_a_save_gives_zero3s_gathered_parameters_back_instead_of_gathering_them_again(tmp_path):
    # DeepSpeed's save partitions the parameters ZeRO-3 keeps gathered between steps, then gathers
    # them again (a collective each); airay's save hands them their tensors back. The same files.
    from tests import worlds
    from tests.test_reshard import _port

    results = torch.multiprocessing.Manager().dict()
    worlds.spawn(_save_world, args=(_port(), str(tmp_path), results), nprocs=2)
    for rank, r in dict(results).items():
        assert r["kept"] and r["deepspeed_gathers"] >= r["kept"] and r["airay_gathers"] == 0, (rank, r)
        assert r["same_tensors"] and r["available"] and not r["hooks_left"], (rank, r)
        assert r["loss_after"] == r["loss_from_deepspeeds"], (rank, r)
    plain, files = _files(tmp_path / "deepspeed"), _files(tmp_path / "airay")
    assert plain.keys() == files.keys() and len(files) == 4  # 2 ranks: model states, optimizer partition
    for name, path in files.items():
        a, b = _tensors(torch.load(path, weights_only=False)), _tensors(torch.load(plain[name], weights_only=False))
        assert a.keys() == b.keys() and a and all(torch.equal(a[k], b[k]) for k in a), name


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


def test_a_slow_write_holds_the_next_optimizer_step_even_when_the_persist_waits_for_it(engine, tmp_path, monkeypatch):
    """The tear: on a GPU a step takes milliseconds and the writes of a big state take seconds.
    Here the writer is made slow on purpose (its first write of the save blocks until the step
    after the save has returned, or 2 s), while another thread waits for the files as the
    persist does. The optimizer step must wait for the writes, so the files hold the state of
    the save's step; a step that went ahead would change the weights and Adam moments before
    they were written (and the CRCs, computed over what was written, would still verify)."""
    import threading

    from airay.models import tiny_gpt

    _train_step(engine, 0)
    engine.save_checkpoint(str(tmp_path / "sync"), tag="native", save_latest=False)
    step_returned = threading.Event()

    class SlowFile(staging.CrcFile):
        blocked = False

        def write(self, data):
            if not SlowFile.blocked:
                SlowFile.blocked = True
                step_returned.wait(timeout=2.0)
            return super().write(data)

    monkeypatch.setattr(staging, "CrcFile", SlowFile)
    writer = staging.Writer()
    staging.install(engine, writer)
    engine.save_checkpoint(str(tmp_path / "staged"), tag="native", save_latest=False)
    persist = threading.Thread(target=writer.wait)  # the io thread's persist, waiting for the files
    persist.start()
    persist.join(timeout=0.3)
    assert persist.is_alive()  # it is waiting beside the step
    engine.backward(tiny_gpt.loss(engine, {"tokens": torch.randint(0, 256, (2, 9))}))
    engine.step()
    step_returned.set()
    persist.join()
    waited = writer.take_wait()  # what the step reports as checkpoint_wait_s
    assert waited > 1.0, waited
    sync, staged = _files(tmp_path / "sync"), _files(tmp_path / "staged")
    assert set(staged) == set(sync)
    for name, path in staged.items():
        a, b = _tensors(torch.load(path, weights_only=False)), _tensors(torch.load(sync[name], weights_only=False))
        assert a.keys() == b.keys() and a
        assert all(torch.equal(a[k], b[k]) for k in a), name

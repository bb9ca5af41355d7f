"""Checkpoint visibility and retention on real files (no DeepSpeed needed: layout only)."""

import json

from airay import checkpoint as ck


def fake_checkpoint(root, step, complete=True):
    d = ck.step_dir(root, step)
    (d / "native").mkdir(parents=True)
    (d / "native" / "mp_rank_00_model_states.pt").write_bytes(b"x" * (100 + step))
    if complete:
        files = {"native/mp_rank_00_model_states.pt": 100 + step}
        (d / ck.MANIFEST).write_text(json.dumps({"step": step, "world_size": 4, "zero_stage": 0,
                                                 "load_tag": "native", "files": files}))
    return d


def test_latest_complete_skips_incomplete_and_corrupt(tmp_path):
    fake_checkpoint(tmp_path, 5)
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 15, complete=False)
    assert ck.latest_complete(tmp_path).step == 10
    (ck.step_dir(tmp_path, 10) / "native" / "mp_rank_00_model_states.pt").write_bytes(b"short")
    assert ck.verify(ck.step_dir(tmp_path, 10)) is None
    assert ck.latest_complete(tmp_path).step == 5


def test_prune_keeps_last_k_and_never_an_in_progress_dir(tmp_path):
    for s in (5, 10, 15, 20):
        fake_checkpoint(tmp_path, s)
    fake_checkpoint(tmp_path, 25, complete=False)  # still being written
    removed = ck.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step_00000005", "step_00000010"]
    assert sorted(p.name for p in ck.step_dirs(tmp_path)) == ["step_00000015", "step_00000020", "step_00000025"]


def test_prune_protects_the_checkpoint_being_loaded(tmp_path):
    for s in (5, 10, 15):
        fake_checkpoint(tmp_path, s)
    ck.prune(tmp_path, keep_last=1, protect=ck.step_dir(tmp_path, 5))
    assert sorted(p.name for p in ck.step_dirs(tmp_path)) == ["step_00000005", "step_00000015"]


def test_checksums_catch_a_flipped_byte_and_reject_sets_it_aside(tmp_path):
    d = ck.step_dir(tmp_path, 5)
    (d / "native").mkdir(parents=True)
    f = d / "native" / "mp_rank_00_model_states.pt"
    f.write_bytes(b"y" * 1000)
    ck.commit(d, 5, world_size=2, zero_stage=0)
    assert ck.corrupt_files(d) == []
    data = bytearray(f.read_bytes())
    data[500] ^= 0xFF
    f.write_bytes(bytes(data))
    assert ck.verify(d) is not None  # same size: only the checksum tells
    assert ck.corrupt_files(d) == ["native/mp_rank_00_model_states.pt"]
    moved = ck.reject(d)
    assert moved.name == "rejected_step_00000005" and ck.step_dirs(tmp_path) == []


def test_checkpointer_latest_falls_back_past_a_corrupt_checkpoint(tmp_path):
    class Rec:
        events = []

        def event(self, type_, **fields):
            self.events.append((type_, fields))

    for step in (5, 10):
        d = ck.step_dir(tmp_path, step)
        (d / "native").mkdir(parents=True)
        (d / "native" / "mp_rank_00_model_states.pt").write_bytes(bytes([step]) * 100)
        ck.commit(d, step, world_size=2, zero_stage=0)
    f = ck.step_dir(tmp_path, 10) / "native" / "mp_rank_00_model_states.pt"
    f.write_bytes(b"\0" * 100)
    rec = Rec()
    assert ck.Checkpointer(tmp_path, 0, 3, rec).latest().step == 5
    assert [(t, f["step"]) for t, f in rec.events] == [("checkpoint_rejected", 10)]

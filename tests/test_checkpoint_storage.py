"""Checkpoint tiers and storage on real files and a real S3-compatible server (no Ray, no
DeepSpeed save: the committer's logic runs in this process on rank files made here)."""

import json
import os

import pytest

from airay import checkpoint as ck
from airay.config import ConfigError, JobConfig
from airay.storage import Storage
from tests.s3server import s3_server


class Rec:
    def __init__(self):
        self.events = []

    def event(self, type_, **fields):
        self.events.append((type_, fields))


def rank_files(step, world=2, size=4000):
    """What `TrainWorker.collect` hands the committer: each rank's DeepSpeed files, by rank."""
    out = [{"native/mp_rank_00_model_states.pt": bytes([step % 251]) * size}]
    for r in range(world):
        out.append({f"native/zero_pp_rank_{r}_mp_rank_00_optim_states.pt": bytes([(step + r) % 251]) * size})
    return out


def commit(step, durable, memory=None, keep_last=3, to_durable=True):
    spec = {"step": step, "world_size": 2, "zero_stage": 0, "durable": durable if to_durable else None,
            "keep_last": keep_last, "memory": str(memory) if memory else None, "memory_keep_last": 2}
    return ck.Committer.__new__(ck.Committer).commit(spec, *rank_files(step))


@pytest.fixture(scope="module")
def s3():
    with s3_server() as bucket_uri:
        yield bucket_uri


def test_s3_round_trip_commit_verify_reject_prune(s3, tmp_path):
    uri = s3("run-a")
    for step in (5, 10, 15, 20):
        done = commit(step, uri, keep_last=2)
        assert done["path"].startswith("s3://") and "endpoint_override" not in done["path"]
    storage = Storage(uri)
    # Retention: the newest two are left, in the bucket, complete.
    assert ck.step_names(storage) == ["step_00000020", "step_00000015"]
    info = ck.latest_complete(storage)
    assert (info.step, info.world_size, info.load_tag, info.tier) == (20, 2, "native", "durable")
    assert info.bytes == 3 * 4000
    assert ck.corrupt_files_at(storage, info.name) == []
    # Downloaded bytes are the bytes each rank saved.
    storage.download(info.name, tmp_path / "dl", sorted(storage.sizes(info.name)))
    assert (tmp_path / "dl/native/zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes() == bytes([21]) * 4000
    # Same size, flipped bytes: only the checksum tells; the Checkpointer sets it aside and falls back.
    storage.write_bytes(f"{info.name}/native/mp_rank_00_model_states.pt", b"\0" * 4000)
    rec = Rec()
    assert ck.Checkpointer(uri, 0, 2, rec).latest().step == 15
    assert [(t, f["step"], f["tier"]) for t, f in rec.events] == [("checkpoint_rejected", 20, "durable")]
    assert storage.list_dirs() == ["rejected_step_00000020", "step_00000015"]


def test_a_partial_upload_is_never_loaded(s3):
    """A driver killed mid-upload leaves files without a manifest (or short files): invisible."""
    uri = s3("run-b")
    commit(5, uri)
    storage = Storage(uri)
    storage.write_bytes("step_00000010/native/mp_rank_00_model_states.pt", b"x" * 10)  # no manifest yet
    assert ck.latest_complete(storage).step == 5
    # A manifest whose files are not all there (e.g. a truncated file) is no better.
    storage.write_bytes("step_00000010/manifest.json", json.dumps(
        {"step": 10, "world_size": 2, "load_tag": "native", "files": {"native/mp_rank_00_model_states.pt": 4000}}).encode())
    assert ck.verify_at(storage, "step_00000010") is None
    assert ck.Checkpointer(uri, 0, 3, Rec()).latest().step == 5
    # Retention never deletes the newest good one for a newer partial, nor the partial (it may
    # still be being written).
    assert ck.prune(storage, keep_last=1) == []


def test_memory_tier_is_preferred_at_the_same_step_and_falls_back_across_tiers(tmp_path):
    durable, memory = tmp_path / "durable", tmp_path / "mem"
    commit(10, str(durable), memory)                    # a durable step: both tiers
    commit(15, str(durable), memory, to_durable=False)  # a memory-only step
    assert sorted(p.name for p in ck.step_dirs(durable)) == ["step_00000010"]
    rec = Rec()
    cp = ck.Checkpointer(durable, 0, 3, rec, memory=memory)
    assert [(c.step, c.tier) for c in cp.candidates()] == [(15, "memory"), (10, "memory"), (10, "durable")]
    assert (cp.latest().step, cp.latest().tier) == (15, "memory")
    # Truncate the newest: it is incomplete, skipped without a word; corrupt the next: rejected.
    (memory / "step_00000015/native/mp_rank_00_model_states.pt").write_bytes(b"short")
    (memory / "step_00000010/native/mp_rank_00_model_states.pt").write_bytes(b"\1" * 4000)
    info = cp.latest()
    assert (info.step, info.tier) == (10, "durable")
    assert [(t, f["step"], f["tier"]) for t, f in rec.events] == [("checkpoint_rejected", 10, "memory")]


def test_a_memory_commit_leaves_steps_being_uploaded_and_the_upload_publishes_them(s3, tmp_path):
    """With a memory tier the Checkpointer commits to memory (spec durable None) and uploads apart."""
    uri, memory = s3("run-up"), tmp_path / "mem"
    committer = ck.Committer.__new__(ck.Committer)
    first = commit(10, uri, memory, to_durable=False)
    assert first["path"] == str(memory / "step_00000010") and ck.step_names(Storage(uri)) == []
    for step in (12, 14):  # memory_keep_last is 2: step 10 would go, but its upload still reads it
        spec = {"step": step, "world_size": 2, "zero_stage": 0, "durable": None, "keep_last": 3,
                "memory": str(memory), "memory_keep_last": 2, "protect": ["step_00000010"]}
        committer.commit(spec, *rank_files(step))
    assert [p.name for p in ck.step_dirs(memory)] == ["step_00000014", "step_00000012", "step_00000010"]
    done = committer.upload(first["path"], uri, keep_last=1)
    assert done["path"] == Storage(uri).uri("step_00000010") and done["committed_ts"] >= first["committed_ts"]
    info = ck.latest_complete(Storage(uri))
    assert (info.step, info.bytes) == (10, 3 * 4000) and ck.corrupt_files_at(Storage(uri), info.name) == []
    commit(16, str(memory), memory, to_durable=False)  # unprotected again: pruned to the newest two
    assert [p.name for p in ck.step_dirs(memory)] == ["step_00000016", "step_00000014"]


def test_upload_queue_runs_one_upload_and_the_newest_waiting_step_supersedes_older():
    q = ck.UploadQueue()
    assert q.add(10) == (10, None)  # nothing running: starts now
    assert q.add(20) == (None, None)  # waits for 10
    assert q.add(30) == (None, 20)  # 20 never started: superseded by 30 (recorded by the caller)
    assert q.items() == [10, 30]
    assert q.finished() == 30 and q.items() == [30]
    assert q.finished() is None and q.items() == []
    assert q.add(40) == (40, None)


def test_memory_tier_keeps_its_own_last_k(tmp_path):
    durable, memory = tmp_path / "durable", tmp_path / "mem"
    for step in (2, 4, 6, 8):
        commit(step, str(durable), memory, to_durable=step % 4 == 0)
    assert [p.name for p in ck.step_dirs(memory)] == ["step_00000008", "step_00000006"]
    assert [p.name for p in ck.step_dirs(durable)] == ["step_00000008", "step_00000004"]


def test_prune_keeps_marked_checkpoints_and_the_protected_one(tmp_path):
    for step in (5, 10, 15, 20):
        commit(step, str(tmp_path), keep_last=10)
    (ck.step_dir(tmp_path, 5) / ck.KEEP_MARKER).write_text("")
    assert ck.verify(ck.step_dir(tmp_path, 5)).keep
    removed = ck.prune(tmp_path, keep_last=1, protect=ck.step_dir(tmp_path, 10))
    assert [p.name for p in removed] == ["step_00000015"]
    assert [p.name for p in ck.step_dirs(tmp_path)] == ["step_00000020", "step_00000010", "step_00000005"]


def test_load_order_is_newest_first_memory_before_durable():
    infos = [ck.CheckpointInfo(s, f"/x/{t}/{s}", 2, "native", 1, tier=t) for s, t in
             [(5, "durable"), (10, "durable"), (10, "memory"), (7, "memory")]]
    assert [(c.step, c.tier) for c in ck.load_order(infos)] == [(10, "memory"), (10, "durable"), (7, "memory"),
                                                               (5, "durable")]


def test_load_order_takes_the_memory_replica_after_the_primary_and_before_older_steps():
    infos = [ck.CheckpointInfo(s, f"/x/{c}/{s}", 2, "native", 1, tier=t, copy=c) for s, t, c in
             [(10, "durable", "primary"), (15, "memory", "replica"), (15, "memory", "primary"), (12, "memory", "replica")]]
    assert [(c.step, c.copy) for c in ck.load_order(infos)] == [(15, "primary"), (15, "replica"), (12, "replica"),
                                                               (10, "primary")]
    # The primary copy gone (the driver node's memory lost): the replica of the same step wins.
    assert ck.load_order([i for i in infos if i.copy != "primary" or i.tier == "durable"])[0].copy == "replica"


def test_lose_memory_deletes_only_the_tiers_step_directories(tmp_path):
    from airay.chaos import lose_memory

    for name in ("step_00000005", "step_00000010", "other"):
        (tmp_path / name).mkdir()
    assert [p.name for p in lose_memory(tmp_path)] == ["step_00000005", "step_00000010"]
    assert [p.name for p in tmp_path.iterdir()] == ["other"]


def test_memory_root_is_stable_per_checkpoint_path(tmp_path):
    a = ck.memory_root(tmp_path, "s3://b/run1?endpoint_override=http://h:1")
    assert a == ck.memory_root(tmp_path, "s3://b/run1?endpoint_override=http://h:2")  # same bucket path
    assert a != ck.memory_root(tmp_path, "s3://b/run2") and a.parent == tmp_path


BASE = {"model": {"factory": "airay.models.tiny_gpt:build"}, "loss_fn": "airay.models.tiny_gpt:loss",
        "global_batch_size": 8, "micro_batch_size": 4, "max_steps": 10}


@pytest.mark.parametrize("checkpoint, message", [
    ({"every_n_steps": 10, "fast_every_n_steps": 3}, "fast_every_n_steps (3) must divide every_n_steps (10)"),
    ({"every_n_steps": 4, "fast_every_n_steps": 8}, "must divide"),
    ({"path": "ftp://host/ckpt"}, "'ftp://' is not a pyarrow filesystem"),
    ({"preemption_grace_s": 0}, "checkpoint.preemption_grace_s"),
])
def test_bad_checkpoint_fields_are_named(checkpoint, message):
    with pytest.raises(ConfigError, match="checkpoint") as err:
        JobConfig.from_dict({**BASE, "checkpoint": checkpoint})
    assert message in str(err.value)


def test_good_two_tier_spec():
    cfg = JobConfig.from_dict({**BASE, "checkpoint": {"path": "s3://bucket/run", "every_n_steps": 10,
                                                      "fast_every_n_steps": 2}})
    assert cfg.checkpoint.interval == 2


def test_cli_lists_both_tiers_with_status_and_marks_keep(tmp_path, capsys):
    from airay.cli import main

    run = tmp_path / "run"
    run.mkdir()
    memory = tmp_path / "mem"
    (run / "config.yaml").write_text(f"checkpoint:\n  fast_every_n_steps: 5\n  memory_path: {memory}\n")
    durable = run / "checkpoints"
    mem = ck.memory_root(memory, str(durable))
    commit(10, str(durable), mem)
    commit(15, str(durable), mem, to_durable=False)
    commit(20, str(durable), mem)
    (durable / "step_00000020/native/mp_rank_00_model_states.pt").write_bytes(b"\1" * 4000)  # corrupt
    (durable / "step_00000025/native").mkdir(parents=True)  # a save in progress
    assert main(["checkpoints", str(run), "--crc", "--keep", "10", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tier"], r["step"], r["status"], r["world_size"], r["keep"]) for r in rows] == [
        ("memory", 20, "verified", 2, False), ("memory", 15, "verified", 2, False),
        ("durable", 25, "incomplete", None, False), ("durable", 20, "corrupt", 2, False),
        ("durable", 10, "verified", 2, True)]
    assert rows[0]["bytes"] == 3 * 4000
    assert main(["checkpoints", str(durable)]) == 0
    out = capsys.readouterr().out
    assert "incomplete" in out and "verified keep" in out and "memory" not in out
    assert main(["checkpoints", str(run), "--keep", "15"]) == 2  # not a durable checkpoint


def test_cli_lists_an_s3_prefix(s3, capsys):
    from airay.cli import main

    uri = s3("run-cli")
    commit(5, uri)
    assert main(["checkpoints", uri, "--crc", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["step"], row["status"], row["tier"]) == (5, "verified", "durable")
    assert row["path"].startswith("s3://") and "endpoint" not in row["path"]


def test_stale_scratch_of_dead_processes_is_removed(monkeypatch, tmp_path):
    import subprocess
    import sys

    monkeypatch.setattr(ck, "scratch_root", lambda: tmp_path / "airay-1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"airay-{dead}/stage").mkdir(parents=True)
    (tmp_path / f"airay-{os.getpid()}/stage").mkdir(parents=True)  # alive: kept
    assert [p.name for p in ck.remove_stale_scratch()] == [f"airay-{dead}"]
    assert (tmp_path / f"airay-{os.getpid()}").is_dir()

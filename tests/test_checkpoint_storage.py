"""Checkpoint layout, tiers and storage on real files and a real S3-compatible server (no Ray, no
DeepSpeed: the manifests, stamps, copies and retention the ranks and the driver rely on)."""

import json
import os
import random
import zlib

import pytest

from airay.checkpoint import reshard
from airay.checkpoint.layout import step_of, KEEP_MARKER, MANIFEST, OWNER, CheckpointInfo, FileEntry, Manifest, \
    job_identity, load_order, private_dir, step_name
from airay.checkpoint.loading import CheckpointUnavailable, Source, fetch_verified
from airay.checkpoint.manager import UploadQueue
from airay.checkpoint.storage import Storage
from airay.checkpoint.tiers import DurableTier, ForeignCheckpoints, MemoryTier, memory_base, remove_stale_scratch
from airay.config import ConfigError, JobConfig
from tests.s3server import s3_server

JOB = job_identity("job", {"factory": "airay.models.tiny_gpt:build", "kwargs": {}}, 2)


@pytest.fixture(scope="module")
def s3():
    with s3_server() as bucket_uri:
        yield bucket_uri


def write_step(storage: Storage, step: int, world: int = 2, complete: bool = True, size: int = 4000) -> Manifest:
    """A step as ranks upload it (each its own files) and the driver commits it (manifest last)."""
    files = {reshard.MODEL_FILE: bytes([step % 251]) * size}
    files.update({reshard.optim_file(r): bytes([(step + r) % 251]) * size for r in range(world)})
    entries = {}
    for rank_of, (name, data) in enumerate(files.items()):
        storage.write_bytes(f"{step_name(step)}/{name}", data)
        entries[name] = FileEntry(len(data), zlib.crc32(data), max(0, rank_of - 1))
    manifest = Manifest(step, world, 2, JOB, entries, {"partitions": [size]})
    if complete:
        DurableTier(storage.location, JOB).commit(manifest)
    return manifest


def test_manifest_round_trip_and_the_files_a_rank_reads():
    m = Manifest.from_reports(10, 2, 2, JOB, [
        {"files": {reshard.MODEL_FILE: [100, 7], reshard.optim_file(0): [50, 8]}, "layout": {"partitions": [10]}},
        {"files": {reshard.optim_file(1): [50, 9]}, "layout": {}}], created=1.0)
    again = Manifest.from_json(m.to_json())
    assert again.files[reshard.optim_file(1)] == FileEntry(50, 9, 1) and again.layout == {"partitions": [10]}
    assert again.bytes == 200 and again.job == JOB
    from airay.checkpoint.layout import files_to_load

    assert files_to_load(again, 1, 2, {}) == [reshard.MODEL_FILE, reshard.optim_file(1)]  # same world: its own
    # A world of 3 resharding partitions of 10 (total 20) into 7, 7, 6: rank 1's [7, 14) spans both.
    new = {"partitions": [7], "totals": [20]}
    assert files_to_load(again, 1, 3, new) == [reshard.MODEL_FILE, reshard.optim_file(0), reshard.optim_file(1)]
    assert files_to_load(again, 2, 3, new) == [reshard.MODEL_FILE, reshard.optim_file(1)]
    with pytest.raises(ValueError, match="not an airay"):
        Manifest.from_json(json.dumps({"step": 1}))


def test_manifest_keeps_each_files_chunk_crcs_and_reads_one_written_without_them():
    m = Manifest.from_reports(4, 2, 3, JOB, [
        {"files": {"a.pt": [300, 1]}, "chunks": {"a.pt": [11, 12, 13]}, "chunk_bytes": 128, "layout": {}},
        {"files": {"b.pt": [100, 2]}, "chunks": {"b.pt": [21]}, "chunk_sizes": {"b.pt": 64}, "chunk_bytes": 128,
         "layout": {}}], created=1.0)
    again = Manifest.from_json(m.to_json())
    assert again.chunk_bytes == 128 and again.files["a.pt"] == FileEntry(300, 1, 0, [11, 12, 13])
    assert again.files["b.pt"] == FileEntry(100, 2, 1, [21], 64)  # a small file's own chunk size
    assert (again.chunk_bytes_of("a.pt"), again.chunk_bytes_of("b.pt")) == (128, 64)
    # Today's writers keep the CRCs in a sidecar the manifest lists as a file: no CRC in the manifest.
    m = Manifest.from_reports(4, 1, 3, JOB, [{"files": {"a.pt": [300, 1], "a.pt.crc32": [12, 7]},
                                              "chunk_sizes": {"a.pt": 128}, "chunk_bytes": 1024, "layout": {}}], 1.0)
    again = Manifest.from_json(m.to_json())
    assert again.files == {"a.pt": FileEntry(300, 1, 0, [], 128), "a.pt.crc32": FileEntry(12, 7, 0)}
    # A manifest of an earlier airay (no chunk CRCs): whole files are read and verified.
    import json

    old = json.loads(m.to_json())
    old.pop("chunk_bytes")
    old["files"] = {n: v[:3] for n, v in old["files"].items()}
    legacy = Manifest.from_json(json.dumps(old))
    assert legacy.chunk_bytes == 0 and legacy.files["a.pt"] == FileEntry(300, 1, 0)


def test_job_identity_ignores_run_length_and_faults_but_not_the_model():
    a = job_identity("gpt", {"factory": "m:build", "kwargs": {"d_model": 64}}, 2)
    assert a == job_identity("gpt", {"factory": "m:build", "kwargs": {"d_model": 64}}, 2)
    assert a["id"] != job_identity("gpt", {"factory": "m:build", "kwargs": {"d_model": 128}}, 2)["id"]
    assert a["id"] != job_identity("other", {"factory": "m:build", "kwargs": {"d_model": 64}}, 2)["id"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_durable_complete_verify_prune_reject(where, tmp_path, s3):
    storage = Storage(str(tmp_path / "ckpt") if where == "local" else s3("durable"))
    tier = DurableTier(storage.location, JOB)
    tier.claim()
    for step in (5, 10, 15, 20):
        write_step(storage, step)
    write_step(storage, 25, complete=False)  # a step still uploading: no manifest yet
    assert [i.step for i in tier.complete()] == [20, 15, 10, 5]
    # A file short of its manifest's size: the step is incomplete, whatever its manifest says.
    storage.write_bytes(f"{step_name(15)}/{reshard.optim_file(1)}", b"short")
    assert [i.step for i in tier.complete()] == [20, 10, 5]
    storage.write_bytes(f"{step_name(5)}/{KEEP_MARKER}", b"")
    assert sorted(tier.prune(keep_last=1, protect={10})) == [15]  # incomplete, older than the newest
    assert [i.step for i in tier.complete()] == [20, 10, 5]  # 10 protected, 5 marked KEEP
    assert step_name(25) in storage.list_dirs()  # newer than the newest complete: never pruned
    moved = tier.reject(20)
    assert moved.endswith("rejected_step_00000020") and [i.step for i in tier.complete()] == [10, 5]


def test_a_durable_tier_of_another_job_is_refused(tmp_path):
    path = str(tmp_path / "shared")
    DurableTier(path, JOB).claim()
    DurableTier(path, JOB).claim()  # the same job resumes
    other = job_identity("other-job", {"factory": "m:build"}, 2)
    with pytest.raises(ForeignCheckpoints, match="holds the checkpoints of job 'job'.*give this job its own checkpoint.path"):
        DurableTier(path, other).claim()


def test_durable_writes_are_fsynced_and_the_manifest_is_written_last_and_whole(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    storage = Storage(str(tmp_path / "d"))
    src = tmp_path / "shard.pt"
    src.write_bytes(os.urandom(3000))
    assert storage.upload_file(src, "step_00000001/a.pt") == (3000, zlib.crc32(src.read_bytes()))
    assert synced == [str(tmp_path / "d/step_00000001/a.pt")]
    tier = DurableTier(storage.location, JOB)
    m = Manifest(1, 1, 2, JOB, {"a.pt": FileEntry(3000, zlib.crc32(src.read_bytes()), 0)})
    tier.commit(m)
    # The step directory (its entries) and the manifest itself, before the manifest is renamed in.
    assert str(tmp_path / "d/step_00000001") in synced and any(s.endswith(f"{MANIFEST}.tmp") for s in synced)
    assert not (tmp_path / f"d/step_00000001/{MANIFEST}.tmp").exists()
    assert tier.verify(step_name(1)).manifest.files == m.files


def test_memory_tier_is_private_stamped_and_clears_another_jobs(tmp_path):
    base = tmp_path / "mem" / "ckpt-x"
    tier = MemoryTier(base, "node-a-0123456789abcdef", JOB)
    assert tier.open() is None
    assert oct(os.stat(base).st_mode & 0o777) == "0o700" and oct(os.stat(tier.root).st_mode & 0o777) == "0o700"
    (tier.step_dir(5)).mkdir()
    tier.commit(5, "{}")
    assert MemoryTier(base, "node-a-0123456789abcdef", JOB).open() is None and tier.steps() == [5]  # same job
    other = job_identity("other", {}, 2)
    found = MemoryTier(base, "node-a-0123456789abcdef", other).open()
    assert found["id"] == JOB["id"] and tier.steps() == []  # another job's steps are never resumed
    assert json.loads((tier.root / OWNER).read_text())["id"] == other["id"]
    assert tier.prune({1}) == [] and (tier.step_dir(3).mkdir() or tier.prune({1})) == [3]


def test_a_directory_of_another_user_is_refused(tmp_path):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 12345, 12345)  # the tests run as root, which can hand it to someone else
    with pytest.raises(PermissionError, match="belongs to uid 12345.*checkpoint.memory_path"):
        private_dir(d)


def test_fetch_prefers_the_local_copy_then_falls_back_to_durable_and_reports_bad_copies(tmp_path, s3):
    storage = Storage(s3("fetch"))
    m = write_step(storage, 7, size=1000)
    name = reshard.optim_file(1)
    expect = (m.files[name].size, m.files[name].crc32)
    local = tmp_path / "node" / step_name(7)
    local.mkdir(parents=True)
    (local / name).write_bytes(storage.read_bytes(f"{step_name(7)}/{name}"))
    path, copy, bad = fetch_verified(name, expect, Source(str(local), {}, storage.location), 7)
    assert (copy, bad) == ("local", []) and path == str(local / name)
    data = bytearray((local / name).read_bytes())
    data[500] ^= 0xFF  # a bad memory copy, same size: only the checksum tells
    (local / name).write_bytes(bytes(data))
    path, copy, bad = fetch_verified(name, expect, Source(str(local), {}, storage.location), 7)
    assert copy == "durable" and [b["copy"] for b in bad] == ["local"] and "crc32" in bad[0]["reason"]
    assert (local / name).read_bytes() == storage.read_bytes(f"{step_name(7)}/{name}")  # replaced, verified
    (local / name).unlink()
    with pytest.raises(CheckpointUnavailable, match=f"no good copy of {name} of step 7"):
        fetch_verified(name, (expect[0], expect[1] ^ 1), Source(str(local), {}, storage.location), 7)


def test_ranged_reads_of_an_object_store_are_coalesced_and_sent_together():
    """A resharding rank reading pieces of an old partition from S3 (after every node holding it
    in memory is lost) makes a GET of each group of nearby pieces, the GETs at once, not thousands
    of GETs one after another at a store's latency."""
    log: list = []
    data = random.Random(3).randbytes(8 << 20)
    with s3_server(log=log, get_s=0.3) as bucket_uri:
        storage = Storage(bucket_uri("ranges"))
        storage.write_bytes("step_00000001/optim_rank_0.pt", data)
        page, mib = 4096, 1 << 20
        near = [(i * (page + 256), page) for i in range(64)]  # 64 pages, 256 bytes apart
        far = [(m * mib, page) for m in (2, 4, 6, 7)]  # pages MiBs apart: a GET each
        spans = far[2:] + near + far[:2]
        del log[:]
        got = storage.read_spans("step_00000001/optim_rank_0.pt", spans)
    assert [bytes(g) for g in got] == [data[o:o + n] for o, n in spans]
    gets = [entry for entry in log if entry[0] == "GET" and entry[2]]
    last = 63 * (page + 256) + page - 1
    assert sorted(g[2] for g in gets) == sorted([f"bytes=0-{last}"] + [f"bytes={o}-{o + page - 1}" for o, _ in far])
    assert storage.dropped_bytes == 63 * 256  # the gaps read and dropped: counted as bytes read
    assert max(g[3] for g in gets) > 1  # sent together (each held 0.3 s by the store)


def test_upload_queue_runs_one_upload_and_the_newest_waiting_step_supersedes_older():
    q = UploadQueue()
    assert q.add("10") == ("10", None)
    assert q.add("20") == (None, None)
    assert q.add("30") == (None, "20")  # 20 waited and is superseded: it stays in memory only
    assert q.items() == ["10", "30"]
    assert q.finished() == "30" and q.finished() is None and q.items() == []


def test_load_order_is_newest_first_memory_before_durable():
    def info(step, tier):
        return CheckpointInfo(step, 2, 1, tier, f"{tier}:{step}")

    order = load_order([info(10, "durable"), info(15, "memory"), info(10, "memory"), info(5, "durable")])
    assert [(c.step, c.tier) for c in order] == [(15, "memory"), (10, "memory"), (10, "durable"), (5, "durable")]


def test_memory_base_is_stable_per_checkpoint_path(tmp_path):
    a = memory_base(str(tmp_path / "m"), str(tmp_path / "ckpt"))
    assert a == memory_base(str(tmp_path / "m"), str(tmp_path / "ckpt"))
    assert a != memory_base(str(tmp_path / "m"), str(tmp_path / "other"))
    # URI parameters say how to reach the store, not where in it: the same tier.
    assert memory_base(None, "s3://b/p?endpoint_override=x") == memory_base(None, "s3://b/p")


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


def test_bf16_at_zero_stage_0_cannot_change_world_size():
    with pytest.raises(ConfigError, match="bf16 with zero_optimization.stage 0"):
        JobConfig.from_dict({**BASE, "deepspeed": {"bf16": {"enabled": True}}, "scaling": {"min_workers": 1,
                                                                                        "max_workers": 2}})
    JobConfig.from_dict({**BASE, "deepspeed": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}},
                         "scaling": {"min_workers": 1, "max_workers": 2}})


def test_cli_lists_both_tiers_with_status_and_prune_marks_keep_and_deletes(tmp_path, capsys):
    from airay.cli import main

    run = tmp_path / "run"
    run.mkdir()
    mem = tmp_path / "mem"
    (run / "config.yaml").write_text(f"checkpoint:\n  memory_path: {mem}\n")
    durable = Storage(str(run / "checkpoints"))
    for step in (10, 20):
        write_step(durable, step)
    durable.write_bytes(f"{step_name(20)}/{reshard.MODEL_FILE}", b"\1" * 4000)  # corrupt, same size
    durable.write_bytes(f"{step_name(25)}/{reshard.MODEL_FILE}", b"")  # a save in progress
    node = MemoryTier(memory_base(str(mem), durable.location), "n1", JOB)
    node.open()
    node.step_dir(15).mkdir()
    (node.step_dir(15) / reshard.MODEL_FILE).write_bytes(b"m" * 10)
    node.commit(15, write_step(Storage(str(tmp_path / "scratch")), 15).to_json())
    assert main(["prune", str(run), "--keep", "10", "--json"]) == 0  # marks, deletes nothing
    assert json.loads(capsys.readouterr().out)["deleted"] == []
    assert main(["checkpoints", str(run), "--crc", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["tier"], r["step"], r["status"], r["world_size"], r["keep"]) for r in rows] == [
        ("memory", 15, "committed", 2, False), ("durable", 25, "incomplete", None, False),
        ("durable", 20, "corrupt", 2, False), ("durable", 10, "verified", 2, True)]
    assert main(["checkpoints", str(run / "checkpoints")]) == 0
    out = capsys.readouterr().out
    assert "incomplete" in out and "verified keep" in out and "memory" not in out
    assert main(["prune", str(run), "--keep", "15"]) == 2  # not a durable checkpoint
    assert "--keep [15]: no complete checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # listing changes nothing: it has no such option
        main(["checkpoints", str(run), "--keep", "10"])
    capsys.readouterr()
    # Prune as a run prunes: the newest complete step stays, the kept one stays, nothing newer goes.
    write_step(durable, 30)
    write_step(durable, 40)
    assert main(["prune", "--dry-run", "--keep-last", "1", "--json", str(run)]) == 0
    assert json.loads(capsys.readouterr().out) == {"location": durable.uri(), "kept_marked": [],
                                                   "deleted": [30, 25, 20], "dry_run": True}
    assert sorted(step_of(n) for n in durable.list_dirs()) == [10, 20, 25, 30, 40]
    assert main(["prune", str(run), "--keep-last", "1"]) == 0
    assert "deleted 3 step(s)" in capsys.readouterr().out
    assert sorted(step_of(n) for n in durable.list_dirs()) == [10, 40]  # 25 was incomplete and older than 40


def test_cli_lists_an_s3_prefix(s3, capsys):
    from airay.cli import main

    uri = s3("run-cli")
    write_step(Storage(uri), 5)
    assert main(["checkpoints", uri, "--crc", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert (row["step"], row["status"], row["tier"]) == (5, "verified", "durable")
    assert row["path"].startswith("s3://") and "endpoint" not in row["path"]


def test_stale_scratch_of_dead_processes_is_removed(monkeypatch, tmp_path):
    import subprocess
    import sys

    from airay.checkpoint import tiers

    monkeypatch.setattr(tiers, "scratch_dir", lambda: tmp_path / "airay-1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / f"airay-{dead}/load").mkdir(parents=True)
    (tmp_path / f"airay-{os.getpid()}/load").mkdir(parents=True)  # alive: kept
    assert [p.name for p in remove_stale_scratch()] == [f"airay-{dead}"]
    assert (tmp_path / f"airay-{os.getpid()}").is_dir()

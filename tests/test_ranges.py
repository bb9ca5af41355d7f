"""Resharded loads that read only the chunks they need (airay.checkpoint.ranges): DeepSpeed's real
files, a new world's real layouts, each new rank's partition built from sparse copies holding
only the verified chunks its reshard touches, equal to the one built from the whole files."""

import json
import random
import zlib
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from airay.checkpoint.ranges import ChunkedCopy, ChunkUnavailable, batches, chunks_of, coalesce, load_skeleton, runs
from airay.checkpoint.staging import CrcFile, chunk_size_for
from tests import worlds
from tests.test_reshard import SMALL_SUB_GROUPS, _engine, _port, _save_world

CHUNK = 4096  # the tiny GPT's partitions are tens of KB: chunks of 4 KiB stand for 64 MiB ones


def chunk_crcs(data: bytes, chunk: int = CHUNK) -> list[int]:
    return [zlib.crc32(data[i:i + chunk]) for i in range(0, len(data), chunk)]


def test_crc_file_keeps_a_crc_per_chunk_however_the_writes_fall():
    data = random.Random(0).randbytes(10_000)
    for chunk in (7, 1000, 4096, 20_000):
        f = CrcFile("/dev/null", chunk)
        pos, rng = 0, random.Random(chunk)
        while pos < len(data):
            n = rng.randint(1, 3000)
            f.write(data[pos:pos + n])
            pos += n
        f.close()
        assert f.chunk_crcs() == chunk_crcs(data, chunk) and (f.size, f.crc) == (len(data), zlib.crc32(data))


def test_a_file_has_at_least_4096_chunks_powers_of_two_between_4_kib_and_chunk_mib():
    assert chunk_size_for(300 << 20, 1 << 20) == 64 << 10  # a 300 MiB partition: 4800 chunks of 64 KiB
    assert chunk_size_for(2 << 30, 1 << 20) == 512 << 10  # 2 GiB: 4096 of 512 KiB
    assert chunk_size_for(17 << 30, 1 << 20) == 1 << 20  # 17 GB (70B on 64 ranks): chunk_mib's, 17408 of them
    assert chunk_size_for(19 << 20, 1 << 20) == 4 << 10  # 19 MiB (6.5M parameters' ZeRO-3 partition): 4 KiB
    assert chunk_size_for(1000, 1 << 20) == chunk_size_for(0, 1 << 20) == 4 << 10
    assert chunk_size_for(26 << 20, 1024) == 1024  # chunk_mib below the smallest: chunk_mib's


def spans_of(data):
    """A fetcher serving `data`, as a copy in a peer's store or in durable storage would."""
    return lambda spans: [bytes(data[off:off + n]) for off, n in spans]


def test_a_run_of_needed_chunks_is_one_range_and_the_ranges_go_in_one_call(monkeypatch):
    from airay.checkpoint import ranges

    data = random.Random(2).randbytes(10 * CHUNK)
    calls = []

    def peer(spans):
        calls.append(spans)
        return spans_of(data)(spans)

    assert runs([0, 1, 2, 5, 6, 9], 2) == [(0, 1), (2, 2), (5, 6), (9, 9)]
    assert batches([(0, 1), (2, 2), (5, 6), (9, 9)], 3) == [[(0, 1), (2, 2)], [(5, 6), (9, 9)]]
    copy = ChunkedCopy("f.pt", len(data), CHUNK, chunk_crcs(data), "/dev/null", False)
    copy._write = lambda pieces: None
    assert copy.ensure([1, 2, 3, 7, 9], [("peer:n1", peer)]) == [] and sorted(copy.verified) == [1, 2, 3, 7, 9]
    # A ZeRO-3 reshard needs a piece of every parameter: one round trip for all of them.
    assert calls == [[(CHUNK, 3 * CHUNK), (7 * CHUNK, CHUNK), (9 * CHUNK, CHUNK)]] and copy.bytes_read == 5 * CHUNK
    # No call asks for more than MAX_READ bytes (a peer's reply is held in memory whole).
    monkeypatch.setattr(ranges, "MAX_READ", 2 * CHUNK)
    calls.clear()
    copy = ChunkedCopy("f.pt", len(data), CHUNK, chunk_crcs(data), "/dev/null", False)
    copy._write = lambda pieces: None
    assert copy.ensure([0, 1, 2, 4, 6], [("peer:n1", peer)]) == []
    assert calls == [[(0, 2 * CHUNK)], [(2 * CHUNK, CHUNK), (4 * CHUNK, CHUNK)], [(6 * CHUNK, CHUNK)]]


def test_spans_close_together_are_one_read_while_the_bytes_dropped_stay_a_small_share():
    page = 4096
    # Three pages 256 bytes apart: one read; 512 bytes dropped of 12288 kept.
    assert coalesce([(0, page), (page + 256, page), (2 * page + 512, page)], gap=1 << 20) == \
        ([(0, 3 * page + 512)], [(0, 0), (0, page + 256), (0, 2 * page + 512)])
    # A gap as large as `gap` is a read of its own; so is one that would drop more than 1/8 of
    # what the read keeps (a page after a page, a page apart: half of the read dropped).
    assert coalesce([(0, page), (2 * page, page)], gap=page)[0] == [(0, page), (2 * page, page)]
    assert coalesce([(0, page), (2 * page, page)], gap=1 << 20)[0] == [(0, page), (2 * page, page)]
    # Spans given out of order come back in their order; overlapping ones share a read.
    reads, where = coalesce([(9 * page, page), (0, 2 * page), (page, page)], gap=1 << 20)
    assert reads == [(0, 2 * page), (9 * page, page)] and where == [(1, 0), (0, 0), (0, page)]
    assert coalesce([], gap=1) == ([], [])


def test_spans_of_a_file_come_back_to_back_in_one_array_and_zeros_past_its_end(tmp_path):
    from airay.checkpoint.ranges import read_packed, unpack

    data = random.Random(3).randbytes(3 * CHUNK)
    (tmp_path / "f").write_bytes(data)
    spans = [(CHUNK, 10), (5, CHUNK), (3 * CHUNK - 4, 8)]  # the last reaches 4 bytes past the end
    got = [bytes(v) for v in unpack(read_packed(tmp_path / "f", spans), spans)]
    assert got == [data[CHUNK:CHUNK + 10], data[5:5 + CHUNK], data[-4:] + bytes(4)]


def test_a_skeleton_of_small_chunks_is_one_call_for_both_ends(tmp_path):
    from airay.checkpoint.ranges import SKELETON_START

    state = {"state": {i: {"exp_avg": torch.randn(10000)} for i in range(20)}, "step": 3}
    torch.save(state, tmp_path / "o.pt")
    data = (tmp_path / "o.pt").read_bytes()
    calls = []
    copy = ChunkedCopy("o.pt", len(data), CHUNK, chunk_crcs(data), str(tmp_path / "o.sparse"), False)
    skeleton, bad = load_skeleton(copy, [("peer:n1", lambda spans: calls.append(spans) or spans_of(data)(spans))])
    assert bad == [] and sorted(skeleton["state"]) == list(range(20)) and skeleton["step"] == 3
    tail = (-(-len(data) // CHUNK) - SKELETON_START // CHUNK) * CHUNK  # where the last k chunks begin
    assert calls == [[(0, SKELETON_START), (tail, len(data) - tail)]]


def test_a_chunked_copy_verifies_each_chunk_and_falls_back_to_the_next_copy(tmp_path):
    data = random.Random(1).randbytes(3 * CHUNK + 100)
    bad = bytearray(data)
    bad[CHUNK + 5] ^= 0xFF  # chunk 1 of the peer's copy is corrupt
    peer = ("peer:n1", spans_of(bad))
    durable = ("durable", spans_of(data))
    copy = ChunkedCopy("f.pt", len(data), CHUNK, chunk_crcs(data), str(tmp_path / "f.pt.sparse"), False)
    met = copy.ensure(chunks_of([(CHUNK - 10, CHUNK + 10)], len(data), CHUNK), [peer, durable])
    assert sorted(copy.verified) == [0, 1] and [(b["copy"], b["reason"][:7]) for b in met] == [("peer:n1", "chunk 1")]
    held = Path(copy.path).read_bytes()
    assert len(held) == len(data) and held[:2 * CHUNK] == data[:2 * CHUNK] and held[2 * CHUNK:] == bytes(CHUNK + 100)
    assert copy.bytes_read == 3 * CHUNK  # chunk 0 once, chunk 1 twice (the bad copy, then the good one)
    with pytest.raises(ChunkUnavailable, match="chunk 1 of f.pt"):
        ChunkedCopy("f.pt", len(data), CHUNK, chunk_crcs(data), str(tmp_path / "g"), False).ensure([1], [peer])
    # The node's own whole copy serves in place; a bad chunk of it moves every chunk to a sparse copy.
    local = tmp_path / "local.pt"
    local.write_bytes(bytes(bad))
    copy = ChunkedCopy("f.pt", len(data), CHUNK, chunk_crcs(data), str(local), True)
    assert copy.ensure([0], [durable]) == [] and copy.path == str(local)
    assert [b["copy"] for b in copy.ensure([1], [durable])] == ["local"]
    assert copy.path == str(local) + ".sparse" and sorted(copy.verified) == [0, 1]
    assert Path(copy.path).read_bytes()[:2 * CHUNK] == data[:2 * CHUNK]


def test_a_files_chunk_crcs_come_from_its_verified_sidecar_or_an_earlier_manifest(tmp_path):
    from airay.checkpoint.checksum import pack_crcs
    from airay.checkpoint.layout import FileEntry, Manifest, step_name
    from airay.checkpoint.loading import CheckpointUnavailable, Source, chunk_crcs as sidecar_crcs

    data = random.Random(2).randbytes(5 * CHUNK + 3)
    side = pack_crcs(chunk_crcs(data))
    local, durable = tmp_path / "node" / step_name(7), tmp_path / "durable" / step_name(7)
    local.mkdir(parents=True), durable.mkdir(parents=True)
    (durable / "a.pt.crc32").write_bytes(side)
    (local / "a.pt.crc32").write_bytes(side[:4] + bytes([side[4] ^ 1]) + side[5:])  # the node's copy is bad
    source = Source(str(local), {}, str(tmp_path / "durable"))

    def manifest(sidecar: bytes, inline=()) -> Manifest:
        files = {"a.pt": FileEntry(len(data), zlib.crc32(data), 0, list(inline), CHUNK),
                 "a.pt.crc32": FileEntry(len(sidecar), zlib.crc32(sidecar), 0)}
        return Manifest(7, 1, 3, {}, files, chunk_bytes=CHUNK)

    crcs, bad, read = sidecar_crcs(manifest(side), "a.pt", source)
    assert crcs == chunk_crcs(data) and read == len(side) == 4 * 6
    assert [b["copy"] for b in bad] == ["local"]  # the bad copy was met, the durable one replaced it
    assert (local / "a.pt.crc32").read_bytes() == side
    # A sidecar of the wrong length for its file (a writer bug, not a bad copy): refused by name.
    m = manifest(side[:8])
    (local / "a.pt.crc32").write_bytes(side[:8])
    with pytest.raises(CheckpointUnavailable, match="a.pt.crc32 holds 2 chunk CRCs for a.pt"):
        sidecar_crcs(m, "a.pt", source)
    # An earlier airay's manifest held the CRCs itself: nothing is read.
    assert sidecar_crcs(manifest(side, inline=[1, 2]), "a.pt", source) == ([1, 2], [], 0)


def test_a_zero12_model_file_is_read_without_its_trained_weights_and_loads_the_rest_strictly(tmp_path):
    """ZeRO-1/2 rebuild the trained weights from the fp32 masters (loading.load_engine): a load
    reads every other storage of the model-states file (buffers, frozen parameters' fragments)
    and none of theirs, an alias of a trained weight (tied embeddings) included."""
    from collections import OrderedDict

    from airay.checkpoint.loading import _without, module_ranges
    from airay.checkpoint.ranges import load_meta, storage_range, tensors_in

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    model[1].weight.requires_grad_(False)  # frozen: not in the optimizer, so read from the file
    sd = model.state_dict()
    sd["2.tied"] = sd["0.weight"]  # an alias: the same storage under another key
    saved = {"module": sd, "frozen_param_fragments": {"1.weight": torch.ones(64)}, "param_shapes": [{}]}
    torch.save(saved, tmp_path / "mp_rank_00_model_states.pt")
    meta = load_meta(tmp_path / "mp_rank_00_model_states.pt")
    trained = frozenset({"0.weight", "0.bias", "2.tied"})
    ranges = module_ranges(meta, trained)
    where = {path: storage_range(t) for path, t in tensors_in(meta)}
    assert where["/module/0.weight"] == where["/module/2.tied"] and where["/module/0.weight"] not in ranges
    assert where["/module/0.bias"] not in ranges
    kept = [p for p in where if p not in {"/module/0.weight", "/module/0.bias", "/module/2.tied"}]
    assert sorted(ranges) == sorted(where[p] for p in kept) and "/module/1.running_mean" in kept
    assert "/frozen_param_fragments/1.weight" in kept and "/module/1.weight" in kept

    # The loader: the trained entries are never copied (NaN here), the rest are, keys as strict as torch's.
    target = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    before = target[0].weight.detach().clone()
    src = OrderedDict((k, torch.full_like(v, float("nan")) if k in ("0.weight", "0.bias") else v + 1)
                      for k, v in model.state_dict().items())
    _without(frozenset({"0.weight", "0.bias"}))(src=src, dst=target)
    assert torch.equal(target[0].weight, before) and torch.equal(target[1].running_mean, model[1].running_mean + 1)
    del src["1.running_var"]
    with pytest.raises(RuntimeError, match=r"missing keys \['1.running_var'\]"):
        _without(frozenset({"0.weight"}))(src=src, dst=target)


def _new_rank(rank, world, stage, port, out, zero, results):
    """A rank of the new world: its engine's layout, then its partition resharded from whole files
    and from sparse copies of only the chunks it needs."""
    from airay.checkpoint.layout import FileEntry, Manifest
    from airay.checkpoint.loading import LoadPlan, needed_files
    from airay.checkpoint.ranges import tensors_in
    from airay.checkpoint.reshard import layout_of

    from airay.checkpoint import ranges

    ranges.SKELETON_START = CHUNK  # to scale with the chunks: one chunk of each end, as at 64 MiB
    old = Path(out, "ck")
    names = sorted(p.name for p in old.iterdir() if p.name.endswith(".pt"))
    files = {n: FileEntry(len(d), zlib.crc32(d), 0, chunk_crcs(d)) for n in names for d in [(old / n).read_bytes()]}
    old_world = len([n for n in names if "optim_states" in n])
    manifest = Manifest(0, old_world, stage, {}, files, json.loads(Path(out, "layout.json").read_text()),
                        chunk_bytes=CHUNK)
    engine, _ = _engine(rank, world, stage, port, extra=zero)
    layout = layout_of(engine)
    need = [n for n in needed_files(manifest, rank, world, layout) if "optim_states" in n]
    copies = {n: ChunkedCopy(n, files[n].size, CHUNK, files[n].chunks, f"{out}/sparse-{rank}/{n}", False) for n in need}
    # Rank 1 reads from durable storage (the old files' directory, through Storage's coalesced
    # ranged reads), the others from a peer's copy.
    from airay.checkpoint.storage import Storage

    durable = Storage(old)
    fetch = {n: [("durable", lambda spans, n=n: durable.read_spans(n, spans)) if rank == 1 else
                 ("peer", spans_of((old / n).read_bytes()))] for n in need}
    skeletons = {n: load_skeleton(c, fetch[n])[0] for n, c in copies.items()}
    sparse = LoadPlan(manifest, rank, world, {n: c.path for n, c in copies.items()}, layout)
    wanted = sparse.needed_ranges(skeletons.__getitem__)
    for n, spans in wanted.items():
        copies[n].ensure(chunks_of(spans, copies[n].size, CHUNK), fetch[n])
    whole = LoadPlan(manifest, rank, world, {n: str(old / n) for n in need}, layout)
    name = [n for n in need if f"pp_rank_{rank}_" in n] or need
    own = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    a, b = dict(tensors_in(sparse.load(own))), dict(tensors_in(whole.load(own)))
    # What reading exactly the chunks of the skeleton and of the ranges costs (the last chunk may be short).
    touched = {n: set(chunks_of(wanted.get(n, []), c.size, CHUNK)) | {0, (c.size - 1) // CHUNK}
               for n, c in copies.items()}
    expect = sum(min(CHUNK, c.size - i * CHUNK) for n, c in copies.items() for i in touched[n])
    results[rank] = {"equal": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "expect": expect,
                     "read": sum(c.bytes_read for c in copies.values()), "files": sum(c.size for c in copies.values()),
                     "needed": sum(hi - lo for ranges in wanted.values() for lo, hi in ranges), "name": name,
                     "dropped": durable.dropped_bytes}


@pytest.mark.parametrize("stage,zero", [(2, None), (3, SMALL_SUB_GROUPS)], ids=["zero2", "zero3-subgroups"])
def test_a_resharded_load_reads_only_the_chunks_it_needs_and_builds_the_same_partition(tmp_path, stage, zero):
    out = str(tmp_path)
    worlds.spawn(_save_world, args=(4, stage, _port(), out, zero), nprocs=4)
    results = mp.Manager().dict()
    worlds.spawn(_new_rank, args=(3, stage, _port(), out, zero, results), nprocs=3)
    results = dict(results)
    assert sorted(results) == [0, 1, 2]
    for rank, r in results.items():
        assert r["equal"], rank  # the same new partition, moments and scalars as from the whole files
        # Every byte used was read, and no chunk but those holding them and the files' skeletons.
        assert r["needed"] <= r["read"] == r["expect"], (rank, r)
        # Durable reads coalesced drop (and count) at most an eighth of what they keep.
        assert r["dropped"] <= r["read"] / 8, (rank, r)
        if stage == 2:  # a third of the state, contiguous in two old files: well under their bytes
            assert r["read"] < 0.8 * r["files"], (rank, r)

"""A rank's side of loading a checkpoint: find each file it needs in the nearest good copy, then
hand DeepSpeed its files (resharded when the world size changed) as DeepSpeed asks for them.

Copies are tried nearest first: this node's memory tier, a peer node's (through its NodeStore,
in chunks), then durable storage. Every copy is checked as it is read, size and CRC-32 against
the manifest; a bad copy is reported and the next one tried. A file fetched from elsewhere lands
in this node's memory tier (renamed into place once verified), so the other ranks of the node
that need it too (the model-states file) read it from there.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from airay.checkpoint import reshard
from airay.checkpoint.actors import io_timeout_s
from airay.checkpoint.checksum import crc32, crc_sidecar, unpack_crcs
from airay.checkpoint.layout import Manifest, files_to_load, step_name
from airay.checkpoint.ranges import ChunkedCopy, ChunkUnavailable, chunks_of, load_mmap, load_skeleton, \
    slice_range, storage_range, tensors_in, unpack

CHUNK = 64 << 20  # bytes per piece when a file crosses nodes (through the object store) or storage


class CheckpointIncompatible(ValueError):
    """The checkpoint's layout cannot be resharded to this world (a DeepSpeed key airay refuses,
    airay.checkpoint.reshard.unreshardable): no retry can load it, so the run ends, saying why."""


class CheckpointUnavailable(RuntimeError):
    """No good copy of a file of the checkpoint: the driver falls back to an older step."""

    def __init__(self, message: str, step: int | None = None, bad: list | None = None):
        super().__init__(message)
        self.step, self.bad = step, bad or []

    def __reduce__(self):  # Ray pickles it back to the driver with its step and the bad copies
        return type(self), (str(self), self.step, self.bad)


def file_crc(path: str | os.PathLike) -> tuple[int, int]:
    """(size, CRC-32) of a local file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = crc32(chunk, crc)
            size += len(chunk)
    return size, crc


@dataclass
class Source:
    """Where copies of a step's files are: this node's memory directory for the step, other
    nodes' stores holding each file, and the durable tier if the step is there."""

    local_dir: str
    peers: dict[str, list] = field(default_factory=dict)  # file -> [(node_id, NodeStore handle)]
    durable: str | None = None  # the durable tier's location (airay.checkpoint.storage.Storage)


def fetch_verified(name: str, expect: tuple[int, int], source: Source, step: int) -> tuple[str, str, list[dict]]:
    """A verified local path of `name`: (path, which copy, bad copies met). Raises
    CheckpointUnavailable when no copy is good."""
    local = Path(source.local_dir) / name
    bad: list[dict] = []
    Path(source.local_dir).mkdir(parents=True, exist_ok=True)
    # One rank of a node fetches a file the node lacks; the others wait and then read it locally.
    with open(Path(source.local_dir) / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if local.exists():
                got = file_crc(local)
                if got == tuple(expect):
                    return str(local), "local", bad
                # Left in place until a good copy replaces it (atomically): another node may be
                # reading it now, and must see a whole file, bad or good, never a missing one.
                bad.append({"file": name, "copy": "local", "reason": _mismatch(got, expect)})
            tmp = local.with_name(f".{name}.part")
            for node_id, store in source.peers.get(name, []):
                try:
                    got = _from_peer(store, step, name, tmp)
                except Exception as exc:  # the peer or its node is gone: the next copy
                    bad.append({"file": name, "copy": f"peer:{node_id}", "reason": f"{type(exc).__name__}: {exc}"})
                    continue
                if got == tuple(expect):
                    os.replace(tmp, local)
                    return str(local), "peer", bad
                bad.append({"file": name, "copy": f"peer:{node_id}", "reason": _mismatch(got, expect)})
            if source.durable is not None:
                from airay.checkpoint.storage import Storage

                try:
                    got = Storage(source.durable).download_file(f"{step_name(step)}/{name}", tmp)
                except OSError as exc:
                    bad.append({"file": name, "copy": "durable", "reason": f"{type(exc).__name__}: {exc}"})
                else:
                    if got == tuple(expect):
                        os.replace(tmp, local)
                        return str(local), "durable", bad
                    bad.append({"file": name, "copy": "durable", "reason": _mismatch(got, expect)})
            tmp.unlink(missing_ok=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    raise CheckpointUnavailable(f"no good copy of {name} of step {step}: "
                                + "; ".join(f"{b['copy']}: {b['reason']}" for b in bad), step, bad)


def _mismatch(got: tuple[int, int], expect) -> str:
    size, crc = expect
    return f"size {got[0]} crc32 {got[1]:#010x}, manifest says size {size} crc32 {crc:#010x}"


def _from_peer(store, step: int, name: str, dest: Path) -> tuple[int, int]:
    """Copy a file from another node's store into `dest`, chunk by chunk (two in flight);
    returns (size, crc32) of what arrived."""
    import ray

    crc, size, offset = 0, 0, 0
    pending = [store.read.remote(step, name, 0, CHUNK)]
    with open(dest, "wb") as out:
        while pending:
            data = ray.get(pending.pop(0), timeout=io_timeout_s(2 * CHUNK))
            if len(data) == CHUNK:  # there may be more: ask for the one after the next
                pending.append(store.read.remote(step, name, offset + (len(pending) + 1) * CHUNK, CHUNK))
            out.write(data)
            crc, size, offset = crc32(data, crc), size + len(data), offset + len(data)
            if len(data) < CHUNK:
                for ref in pending:
                    ray.cancel(ref)
                break
    return size, crc


class LoadPlan:
    """DeepSpeed's reads of one checkpoint on this rank (installed on StagingEngine.plan while
    `load_checkpoint` runs): each file from its verified local copy, opened with mmap so only the
    bytes used are read; this rank's own partition built from the old ranks' that overlap it when
    the world size changed (airay.checkpoint.reshard)."""

    def __init__(self, manifest: Manifest, rank: int, world_size: int, paths: dict[str, str], layout: dict,
                 trained: frozenset[str] = frozenset()):
        self.manifest, self.rank, self.world, self.paths, self.layout = manifest, rank, world_size, paths, layout
        self.trained = trained  # module keys whose weights the load rebuilds from the fp32 masters (trained_keys)
        self.reshard_s = 0.0
        self.into: dict | None = None  # the engine's buffers a reshard gathers into (load_engine sets them)

    def stage_dir(self, root: str | os.PathLike, tag: str) -> str:
        """A load directory for DeepSpeed: it globs `root/tag` for the model-states file (and reads
        nothing from it: every read goes through `load`). Returns `root`."""
        d = Path(root) / tag
        d.mkdir(parents=True, exist_ok=True)
        m = self.manifest
        names = [reshard.zero3_model_file(self.rank, m.mp_rank)] if m.zero_stage == 3 else \
            [reshard.model_file(s) for s in range(m.slices)]  # it checks that every slice's is there
        for name in names:
            (d / name).touch()
        return str(root)

    @property
    def resharded(self) -> bool:
        return self.world != self.manifest.world_size

    def _open(self, name: str):
        return load_mmap(self.paths[name])

    def load(self, name: str):
        m = self.manifest
        if name.endswith("_model_states.pt"):
            if name not in self.paths and m.zero_stage != 3 and m.slices > 1:
                # Another slice's file, which DeepSpeed opens only to check how many slices there
                # are (deepspeed 0.19: state_dict_factory.check_ckpt_list): not fetched.
                return {"mp_world_size": m.slices}
            if name not in self.paths:  # a rank the old world did not have (ZeRO-3): any rank's will do
                name = reshard.zero3_model_file(min(self.rank, m.world_size - 1), m.mp_rank)
            sd = self._open(name)
            if self.resharded:  # DeepSpeed checks it against the world; the partitions are resharded
                sd = {**sd, "dp_world_size": self.world}
            return sd
        bf16 = name.startswith("bf16_")
        if name != reshard.optim_file(self.rank, bf16, m.mp_rank):
            raise KeyError(f"rank {self.rank} asked for {name}, which its load plan does not hold")
        if not self.resharded:
            return self._open(name)
        refused = reshard.unreshardable(m.layout, self.layout) if m.zero_stage in (1, 2) else None
        if refused:
            raise CheckpointIncompatible(f"step {m.step} saved at world size {m.world_size}: {refused}")
        t0 = time.perf_counter()
        out = self._reshard({r: self._open(reshard.optim_file(r, bf16, m.mp_rank)) for r in self._ranks()},
                            into=self.into)
        self.reshard_s += time.perf_counter() - t0
        return out

    def _reshard(self, old: dict[int, dict], touch=None, into: dict | None = None) -> dict:
        m = self.manifest
        if m.zero_stage == 3:
            return reshard.reshard_zero3(old, m.world_size, self.rank, self.world, m.layout, self.layout, touch, into)
        return reshard.reshard_zero12(old, m.world_size, self.rank, self.world, m.layout["partitions"],
                                      self.layout["partitions"], self.layout["totals"], touch, into)

    def needed_ranges(self, meta_of) -> dict[str, list[tuple[int, int]]]:
        """The byte ranges of each old optimizer file this rank's reshard reads, found by running
        it dry on the files' structures (`meta_of(name)`: airay.checkpoint.ranges.load_meta):
        the slices of the old partitions it takes, and, of the first old file (whose other
        entries the new file copies: step counts, loss scaler, hyperparameters), every storage
        that is not such a partition."""
        bf16 = any(n.startswith("bf16_") and "optim_states" in n for n in self.manifest.files)
        mp = self.manifest.mp_rank
        old = {r: meta_of(reshard.optim_file(r, bf16, mp)) for r in self._ranks()}
        used: dict[int, list] = {r: [] for r in old}
        self._reshard(old, touch=lambda r, t: used[r].append(slice_range(t)))
        partitions = {path for r in old for path, t in tensors_in(old[r])  # sliced in some old file
                      if any(storage_range(t)[0] <= lo and hi <= storage_range(t)[1] for lo, hi in used[r])}
        first = min(old)
        used[first] += [storage_range(t) for path, t in tensors_in(old[first]) if path not in partitions]
        return {reshard.optim_file(r, bf16, mp): ranges for r, ranges in used.items()}

    def _ranks(self) -> list[int]:
        m = self.manifest
        if m.zero_stage == 3:
            return reshard.ranks_needed(3, m.world_size, self.rank, self.world, param_numels=self.layout["param_numels"])
        return reshard.ranks_needed(m.zero_stage, m.world_size, self.rank, self.world,
                                    partitions=m.layout["partitions"], new_partitions=self.layout["partitions"],
                                    totals=self.layout["totals"])


def trained_keys(engine) -> frozenset[str]:
    """The module state dict's keys (every alias) of the parameters a ZeRO-1/2 engine's fp32
    masters hold, when it restores the masters from a checkpoint (load_from_fp32_weights,
    DeepSpeed's default): their weights in the model-states file are the masters cast, so a load
    never reads them (at 7B in bf16, 14 GB a rank, 8 ranks a node, at every resize) and rebuilds
    them from the masters instead (load_engine). Empty for every other engine."""
    opt = engine.optimizer
    groups = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)
    if engine.zero_optimization_stage() not in (1, 2) or not engine.zero_load_from_fp32_weights() \
            or not groups or not hasattr(opt, "update_lp_params"):
        return frozenset()
    held = {id(p) for group in groups for p in group}
    return frozenset(k for k, t in engine.module.state_dict(keep_vars=True).items() if id(t) in held)


def load_engine(engine, plan: LoadPlan, root: str | os.PathLike, tag: str):
    """DeepSpeed's load_checkpoint of `plan`'s step (its reads served by the plan, installed on
    the engine's StagingEngine by the caller); the weights of plan.trained come from the fp32
    masters, all-gathered from every rank's partition (what DeepSpeed does after loading a
    universal checkpoint), not from the model-states file. Returns load_checkpoint's answer."""
    loader = _without(plan.trained) if plan.trained else None
    plan.into = reshard.engine_buffers(engine) if plan.resharded else None
    try:
        load_path, client = engine.load_checkpoint(plan.stage_dir(root, tag), tag=tag, load_optimizer_states=True,
                                                   load_lr_scheduler_states=True, custom_load_fn=loader)
    finally:
        plan.into = None
    if loader is not None and load_path is not None:
        engine.optimizer.update_lp_params()
    return load_path, client


def _without(skip: frozenset[str]):
    """A module loader (load_checkpoint's custom_load_fn) that loads every entry but `skip`'s,
    as strictly as DeepSpeed's own: the file's keys must be the module's."""
    def load(src, dst):
        own = set(dst.state_dict().keys())
        missing, unexpected = sorted(own - set(src)), sorted(set(src) - own)
        if missing or unexpected:
            raise RuntimeError(f"the checkpoint's model does not match this one: missing keys {missing[:4]}, "
                               f"unexpected keys {unexpected[:4]}")
        kept = type(src)((k, v) for k, v in src.items() if k not in skip)
        if hasattr(src, "_metadata"):  # the modules' state-dict versions, which their load hooks read
            kept._metadata = src._metadata
        dst.load_state_dict(kept, strict=False)
    return load


def module_ranges(structure, trained: frozenset[str]) -> list[tuple[int, int]]:
    """The byte ranges of a model-states file (its structure loaded on the meta device) a load
    reads: every storage but those of the `trained` module entries (load_engine rebuilds them)."""
    skip = {f"/module/{k}" for k in trained}
    return [storage_range(t) for path, t in tensors_in(structure) if path not in skip]


def needed_files(manifest: Manifest, rank: int, world_size: int, layout: dict) -> list[str]:
    """The manifest's names of the files this rank reads (bf16 engines name them bf16_...)."""
    names = files_to_load(manifest, rank, world_size, layout)
    return [n if n in manifest.files or f"bf16_{n}" not in manifest.files else f"bf16_{n}" for n in names]


def fetch_partial(manifest: Manifest, rank: int, world_size: int, layout: dict, names: list[str], source: Source,
                  sparse_dir: str | os.PathLike, trained: frozenset[str] = frozenset()
                  ) -> tuple[dict[str, str], list[dict], int, int, dict[str, str]]:
    """For a load from a manifest with chunk CRCs: local copies of the files `names` holding just
    the chunks this rank reads (airay.checkpoint.ranges): of old optimizer files, what its reshard
    takes; of a model-states file, all but the `trained` weights (module_ranges). Each chunk is
    verified, nearest copy first: the node's own whole file when it has one (read in place), else
    a sparse copy filled from a peer's store or durable storage. Returns (paths, bad copies met,
    bytes read, bytes the load uses, the kind of copy that served each file most). Raises
    CheckpointUnavailable when a chunk has no good copy."""
    import ray

    step = manifest.step
    copies, fetchers, bad = {}, {}, []
    storage = None
    if source.durable is not None:
        from airay.checkpoint.storage import Storage

        storage = Storage(source.durable)
    sidecar_bytes = 0
    for name in names:
        f = manifest.files[name]
        local = Path(source.local_dir) / name
        whole = local.is_file() and local.stat().st_size == f.size
        crcs, met, n = chunk_crcs(manifest, name, source)
        bad += met
        sidecar_bytes += n
        copies[name] = ChunkedCopy(name, f.size, manifest.chunk_bytes_of(name), crcs,
                                   str(local if whole else Path(sparse_dir) / name), whole)
        fetchers[name] = [(f"peer:{node_id}", lambda spans, store=store, name=name:
                           unpack(ray.get(store.read_packed.remote(step, name, spans),
                                          timeout=io_timeout_s(sum(n for _, n in spans))), spans))
                          for node_id, store in source.peers.get(name, [])]
        if storage is not None:
            fetchers[name].append(("durable", lambda spans, name=name:
                                   storage.read_spans(f"{step_name(step)}/{name}", spans)))
    try:
        skeletons = {}
        for name, c in copies.items():
            skeletons[name], met = load_skeleton(c, fetchers[name])
            bad += met
        plan = LoadPlan(manifest, rank, world_size, {n: c.path for n, c in copies.items()}, layout)
        wanted = plan.needed_ranges(skeletons.__getitem__) if any("optim_states" in n for n in names) else {}
        wanted.update({n: module_ranges(skeletons[n], trained) for n in names if n.endswith("_model_states.pt")})
        for name, ranges in wanted.items():
            bad += copies[name].ensure(chunks_of(ranges, copies[name].size, copies[name].chunk_bytes), fetchers[name])
    except ChunkUnavailable as exc:
        raise CheckpointUnavailable(f"{exc} (step {step})", step, bad + exc.bad) from None
    needed = sum(hi - lo for ranges in wanted.values() for lo, hi in ranges)
    served = {n: max(c.served, key=c.served.get) if c.served else "local" for n, c in copies.items()}
    dropped = storage.dropped_bytes if storage is not None else 0  # read between spans (coalesced reads)
    return ({n: c.path for n, c in copies.items()}, bad,
            sidecar_bytes + sum(c.bytes_read for c in copies.values()) + dropped, needed, served)


def chunk_crcs(manifest: Manifest, name: str, source: Source) -> tuple[list[int], list[dict], int]:
    """The chunk CRCs of file `name`: from its CRC sidecar (checksum.crc_sidecar), fetched and
    verified like any file, or the manifest's own list (an earlier airay's manifests held them).
    Returns (CRCs, bad copies met, bytes read). Raises CheckpointUnavailable."""
    f = manifest.files[name]
    side = crc_sidecar(name)
    if f.chunks or side not in manifest.files:
        return f.chunks, [], 0
    entry = manifest.files[side]
    path, _, bad = fetch_verified(side, (entry.size, entry.crc32), source, manifest.step)
    crcs = unpack_crcs(Path(path).read_bytes())
    if len(crcs) != -(-f.size // manifest.chunk_bytes_of(name)):
        raise CheckpointUnavailable(f"{side} holds {len(crcs)} chunk CRCs for {name} of {f.size} bytes in chunks of "
                                    f"{manifest.chunk_bytes_of(name)} (step {manifest.step})", manifest.step, bad)
    return crcs, bad, entry.size

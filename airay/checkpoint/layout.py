"""What a checkpoint is on disk: names, the manifest, the job's identity, and which files a rank
reads to load one.

One directory per step in every place that holds a copy:

    step_00000010/
      mp_rank_00_model_states.pt                  DeepSpeed's own files, one format: the native
      zero_pp_rank_R_mp_rank_00_optim_states.pt   partition of each rank (ZeRO 1-3), written by
      ...                                         that rank and by no other process
      manifest.json   written last: step, world size, ZeRO stage, job, every file's size, CRC-32,
                      writing rank and node, and the partition layout a new world reshards from
      KEEP            optional: never pruned

A node's memory tier holds its own ranks' files and, as a peer copy, its ring predecessor's; the
durable tier (`checkpoint.path`) every file. A step is complete in a tier when its manifest is
there; a copy of a file is good when its size and CRC-32 match the manifest's (checked by the rank
that reads it, as it reads).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

from airay.checkpoint import reshard

MANIFEST = "manifest.json"
OWNER = "OWNER.json"  # a tier's stamp: whose checkpoints these are
KEEP_MARKER = "KEEP"
FORMAT = "deepspeed-native"
TIERS = ("memory", "durable")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(name: str) -> int:
    return int(name.rsplit("_", 1)[-1])


def job_identity(name: str, model: dict[str, Any], zero_stage: int, model_parallel: int = 1) -> dict[str, Any]:
    """What makes two runs the same job, so one may resume the other's checkpoints: the job's name,
    model, ZeRO stage and model-parallel size (its files are slices of the model; not max_steps,
    faults or scaling: a longer re-run resumes)."""
    what = {"name": name, "model": model, "zero_stage": zero_stage}
    if model_parallel > 1:  # absent at 1: the identities of runs before model parallelism stay
        what["model_parallel"] = model_parallel
    key = json.dumps(what, sort_keys=True)
    return {"name": name, "id": hashlib.sha256(key.encode()).hexdigest()[:16]}


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32: int
    rank: int
    chunks: list[int] = field(default_factory=list)  # CRC-32 of each chunk of the file
    chunk_bytes: int = 0  # the size of its chunks; 0: the manifest's chunk_bytes


@dataclass
class Manifest:
    step: int
    world_size: int
    zero_stage: int
    job: dict[str, Any]
    files: dict[str, FileEntry]
    layout: dict[str, Any] = field(default_factory=dict)  # e.g. {"partitions": [...]} (ZeRO-1/2)
    created: float = 0.0
    chunk_bytes: int = 0  # the largest chunk (a file's own: chunk_bytes_of); 0: no chunk CRCs, files read whole
    model_parallel: int = 1  # ranks per model replica: world_size / model_parallel data-parallel replicas
    mp_rank: int = 0  # a slice's view (`slice`): whose files its names are; not written
    slices: int = 1  # a slice's view: how many slices the checkpoint has (DeepSpeed counts their files)

    @property
    def data_parallel(self) -> int:
        return self.world_size // self.model_parallel

    def slice(self, mp_rank: int) -> "Manifest":
        """The manifest as model-parallel slice `mp_rank` sees it: a data-parallel world of the
        replicas, that slice's partition layout, its files' names (reshard.optim_file's `mp`).
        Each slice's ZeRO partitions reshard across data-parallel sizes on their own, as the
        whole model's do without model parallelism."""
        if self.model_parallel == 1:
            return self
        return replace(self, world_size=self.data_parallel, layout=self.layout["slices"][mp_rank], model_parallel=1,
                       mp_rank=mp_rank, slices=self.model_parallel)

    def chunk_bytes_of(self, name: str) -> int:
        """The size of file `name`'s chunks (a small file has small ones: staging.chunk_size_for)."""
        return self.files[name].chunk_bytes or self.chunk_bytes

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "step": self.step, "world_size": self.world_size,
                           "zero_stage": self.zero_stage, "job": self.job, "created": self.created,
                           "layout": self.layout, "chunk_bytes": self.chunk_bytes, "model_parallel": self.model_parallel,
                           "files": {n: [f.size, f.crc32, f.rank, f.chunks] + ([f.chunk_bytes] if f.chunk_bytes else [])
                                     for n, f in sorted(self.files.items())}},
                          indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        d = json.loads(text)
        if d.get("format") != FORMAT:
            raise ValueError(f"not an airay {FORMAT} manifest (format {d.get('format')!r})")
        return cls(d["step"], d["world_size"], d["zero_stage"], d["job"],
                   {n: FileEntry(*v) for n, v in d["files"].items()}, d.get("layout", {}), d.get("created", 0.0),
                   d.get("chunk_bytes", 0), d.get("model_parallel", 1))

    @classmethod
    def from_reports(cls, step: int, world_size: int, zero_stage: int, job: dict, reports: list[dict],
                     created: float, model_parallel: int = 1) -> "Manifest":
        """The manifest of a save from every rank's report ({"files": {name: [size, crc]}, "layout",
        "chunks": {name: [crc, ...]}, "chunk_sizes": {name: bytes}, "chunk_bytes"}). With model
        parallelism, ranks 0..mp-1 (the first replica) report their slices' layouts: {"slices": [...]}."""
        files = {n: FileEntry(size, crc, rank, list(rep.get("chunks", {}).get(n, [])), rep.get("chunk_sizes", {}).get(n, 0))
                 for rank, rep in enumerate(reports) for n, (size, crc) in rep["files"].items()}
        if model_parallel > 1:
            layout = {"slices": [reports[m].get("layout") or {} for m in range(model_parallel)]}
        else:
            layout = next((rep["layout"] for rep in reports if rep.get("layout")), {})
        chunk_bytes = {rep.get("chunk_bytes", 0) for rep in reports}
        return cls(step, world_size, zero_stage, job, files, layout, created,
                   chunk_bytes.pop() if len(chunk_bytes) == 1 else 0, model_parallel)


def files_to_load(manifest: Manifest, rank: int, world_size: int, new_layout: dict[str, Any]) -> list[str]:
    """The files rank `rank` of a world of `world_size` reads to load `manifest`'s step. The same
    world: its own partition (and the model-states file); another: the old partitions that overlap
    its new one (airay.checkpoint.reshard). `new_layout`: the loading engine's own partition
    layout (reshard.layout_of)."""
    stage, old, mp = manifest.zero_stage, manifest.world_size, manifest.mp_rank
    if stage == 3:
        own_model = reshard.zero3_model_file(min(rank, old - 1), mp)
        if world_size == old:
            return [own_model, reshard.optim_file(rank, mp=mp)]
        ranks = reshard.ranks_needed(3, old, rank, world_size, param_numels=new_layout["param_numels"])
        return [own_model, *[reshard.optim_file(r, mp=mp) for r in ranks]]
    model = [reshard.model_file(mp)]
    if stage == 0:
        own = [n for n in (reshard.optim_file(rank, bf16=True, mp=mp),) if n in manifest.files]
        if own and world_size != old:  # DeepSpeed's BF16_Optimizer partitions even at stage 0
            raise ValueError("a bf16 checkpoint of ZeRO stage 0 cannot be resharded to another world size; "
                             "use zero_optimization.stage 1-3")
        return model + own
    if world_size == old:
        return [*model, reshard.optim_file(rank, mp=mp)]
    ranks = reshard.ranks_needed(stage, old, rank, world_size, partitions=manifest.layout["partitions"],
                                 new_partitions=new_layout["partitions"], totals=new_layout["totals"])
    return [*model, *[reshard.optim_file(r, mp=mp) for r in ranks]]


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint in one tier, as the driver chooses what to load."""

    step: int
    world_size: int
    bytes: int
    tier: str  # memory or durable
    path: str  # where to show it: the durable step directory (URI), or memory:step_N
    committed_ts: float = 0.0
    keep: bool = False
    manifest: Manifest | None = field(default=None, repr=False, compare=False)
    holders: dict[str, list[str]] = field(default_factory=dict, repr=False, compare=False)  # memory: file -> nodes


def load_order(candidates: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """Newest step first; at the same step the memory tier first (it loads faster)."""
    return sorted(candidates, key=lambda c: (-c.step, TIERS.index(c.tier)))


def private_dir(path: str | os.PathLike) -> None:
    """Create `path` (and parents) private to this user (mode 0700), or refuse one that belongs
    to another user: checkpoints hold the model and must not be readable by others, and a
    directory someone else controls could be swapped under the run."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"checkpoint directory {path} belongs to uid {st.st_uid}, not to this user "
                              f"({os.getuid()}); set checkpoint.memory_path to a directory of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)

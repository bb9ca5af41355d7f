"""A worker group without Ray, for driving the controller's state machine in unit tests.

It has WorkerGroup's interface (what airay.controller and airay.checkpoint.manager call) and
scripts each call's rank outcomes: `script[call][n] = {rank: kind}` makes the n-th call (1-based)
of `call` ("form", "train", "save", "load", "persist", "upload") fail on those ranks, kind
"died", "hung", "oom" (MemoryError), "user" (an exception in user code), "internal" (one in airay's own
code), "gpu" (a CUDA error), "nccl" (NCCL's own failure) or "comm" (a collective aborted behind a
peer's failure); an upload kind "storage" fails the upload as a storage error would;
`script["copies_lost"]` names steps of which no store holds a failed upload's files. Workers are
started at once (ready on the next poll, or after
`ready_after` polls each), steps are instant with a deterministic loss, and durable uploads
write files of the declared sizes, so the durable tier's listing sees them as complete.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from airay.checkpoint.layout import CheckpointInfo, Manifest, step_name
from airay.health import RankOutcome
from airay.policy import BatchPlan
from airay.worker_group import ranks_to_release, world_members

FILE_BYTES = 64

# Scripted exceptions a rank's call raises: (class name, message after the rank).
ERRORS = {
    "internal": ("InternalError", "IndexError: list index out of range\nTraceback (most recent call last):\n"
                                  '  File "airay/data/source.py", line 25, in collate\nIndexError: list index out of range'),
    "gpu": ("GPUError", "AcceleratorError: CUDA error: device-side assert triggered"),
    "nccl": ("NCCLError", "DistBackendError: NCCL error in: NCCLUtils.hpp:317, unhandled system error"),
    "comm": ("DistBackendError", "DistBackendError: NCCL communicator was aborted on rank 0."),
}


def step_loss(step: int) -> float:
    return 10.0 / (step + 1)


def local_s(rank: int, step: int) -> float:
    """A rank's local work in a step: 5 ms, up to 5% more by rank and step (real ranks differ, and
    the straggler check must sort real values), never a straggler (the excess is far below
    health.straggler_min_excess_s)."""
    return 0.005 * (1 + ((rank * 7919 + step * 104729) % 101) / 2000)


@dataclass
class FakeMember:
    node_id: str
    bundle_index: int = 0
    polls_left: int = 0  # polls before it is ready
    info: dict[str, Any] = field(default_factory=dict)
    joined: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    ready_ts: float = 0.0
    warm: bool = True


@dataclass
class FakeRef:
    value: Any = None
    error: BaseException | None = None


class FakeGroup:
    calls: list[tuple[str, Any]]  # every call, for assertions

    @classmethod
    def factory(cls, script: dict | None = None, capacity: int = 4, ready_after: list[int] | None = None,
                nodes: int = 2):
        """A stand-in for the WorkerGroup class: Controller(group_factory=...)."""
        made = []

        def make(*args, **kwargs):
            group = cls(script or {}, capacity, list(ready_after or []), nodes)
            made.append(group)
            return group

        make.default_resources = staticmethod(lambda: {"CPU": 1.0})
        make.made = made
        return make

    def __init__(self, script: dict, capacity: int, ready_after: list[int], nodes: int):
        self.script, self.free, self.ready_after, self.nodes = script, capacity, ready_after, nodes
        self.counts: dict[str, int] = {}
        self.calls = []
        self.formed = []  # (world size, init_weights) of each form
        self.active: list[FakeMember] = []
        self.pending: list[FakeMember] = []
        self.standby: list[FakeMember] = []
        self.start_failures: list[str] = []
        self.first_failure_ts: float | None = None
        self.hangs: list[dict] = []
        self.excluded: set[str] = set()
        self.foreign_tiers: list[dict] = []
        self._ids = itertools.count()
        self.plan: BatchPlan | None = None
        self.memory: dict[int, Manifest] = {}
        self.launched: list[tuple[int, int]] = []  # every round launched, in order
        self.settled: list[list] = []  # refs of rounds queued behind a failed one
        self.sigtermed: set[int] = set()  # workers (id) that got SIGTERM
        self.memory_figures: dict[str, dict] = {}  # node -> NodeMemory fields (empty: no budget to keep)
        self.room = 10 ** 6  # workers the cluster's nodes hold without some (room_without)
        self.no_peer: dict[int, set[str]] = {}  # step -> nodes whose ranks made no peer copy of it
        self.catalog_failures: list[dict] = []

    # ---- the cluster -------------------------------------------------------------------------

    @staticmethod
    def dead_nodes(nodes, suspects, wait_s):
        return set()

    def capacity(self) -> int:
        return len(self.standby) + self.free

    def demand(self, n: int) -> None:
        self.calls.append(("demand", n))

    def reserve(self, n: int, timeout_s: float, warm: bool = True) -> int:
        n = min(n, self.free)
        for _ in range(n):
            self._start()
        self.free -= n
        return n

    def _start(self) -> None:
        i = next(self._ids)
        polls = self.ready_after.pop(0) if self.ready_after else 0
        self.pending.append(FakeMember(f"node{i % self.nodes}", polls_left=polls, info={"node_id": f"node{i % self.nodes}",
                                                                            "pid": 1000 + i}))

    def poll_pending(self, timeout_s: float = 0.0) -> list[FakeMember]:
        newly, waiting = [], []
        for m in self.pending:
            if m.polls_left > 0:
                m.polls_left -= 1
                waiting.append(m)
                continue
            m.ready_ts = time.time()
            self.standby.append(m)
            newly.append(m)
        self.pending = waiting
        return newly

    def formable(self) -> int:
        return len(self.active) + len(self.standby)

    def wait_for_standby(self, n: int, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while len(self.standby) < n and time.time() < deadline:
            if not self.pending:
                return False
            self.poll_pending()
        return len(self.standby) >= n

    def ensure_stores(self, timeout_s: float = 60.0) -> None:
        pass

    def node_memory(self, nodes=None, timeout_s: float = 10.0) -> list[dict]:
        return [dict(f, node_id=n) for n, f in self.memory_figures.items() if nodes is None or n in nodes]

    def memory_usage(self, timeout_s: float = 30.0) -> dict[str, dict[int, int]]:
        held = {f"node{i}": {} for i in range(self.nodes)}
        for step, manifest in self.memory.items():
            for f in manifest.files.values():
                node = f"node{f.rank % self.nodes}"
                held[node][step] = held[node].get(step, 0) + f.size
        return held

    def ring(self) -> dict[str, str]:
        nodes = [f"node{i}" for i in range(self.nodes)]
        return {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)} if len(nodes) > 1 else {}

    def room_without(self, nodes: set[str]) -> int:
        return self.room

    def drop_copies(self, node: str, files: dict[int, list[str]], timeout_s: float = 60.0) -> None:
        self.calls.append(("drop_copies", node, {s: list(n) for s, n in files.items()}))

    def release_vacant_groups(self) -> list[str]:
        return []

    def member(self, rank: int) -> FakeMember:
        return self.active[rank]

    # ---- scripted outcomes -------------------------------------------------------------------

    def _outcomes(self, call: str, world: int) -> list[RankOutcome]:
        self.counts[call] = n = self.counts.get(call, 0) + 1
        self.calls.append((call, n))
        failing = self.script.get(call, {}).get(n, {})
        out = []
        self.hangs = []
        for rank in range(world):
            kind = failing.get(rank)
            if kind is None:
                out.append(RankOutcome(rank, "ok"))
            elif kind == "unavailable":  # no good copy of some file of the checkpoint (loading.py)
                out.append(RankOutcome(rank, "errored", error=f"rank {rank}: scripted: no good copy",
                                       cause="CheckpointUnavailable"))
            elif kind == "incompatible":  # the checkpoint's layout cannot be resharded (loading.py)
                out.append(RankOutcome(rank, "errored", error="CheckpointIncompatible: scripted: "
                                       "zero_optimization.round_robin_gradients", cause="CheckpointIncompatible"))
            elif kind == "oom":  # the process ran out of memory (or Ray's memory monitor killed it)
                out.append(RankOutcome(rank, "errored", error=f"rank {rank}: MemoryError: scripted",
                                       cause="MemoryError"))
            elif kind == "user":
                out.append(RankOutcome(rank, "errored", error=f"rank {rank}: ValueError: scripted", user_error=True,
                                       cause="UserCodeError"))
            elif kind in ERRORS:  # what the worker raises, named (airay.worker.failures)
                cause, text = ERRORS[kind]
                out.append(RankOutcome(rank, "errored", error=f"rank {rank}: {text}", cause=cause))
            else:
                if kind == "hung":
                    self.hangs.append({"rank": rank, "stalled_s": 1.0, "heartbeat": True, "progress": {},
                                       "reason": "scripted hang"})
                out.append(RankOutcome(rank, kind, error=f"scripted {kind}"))
        if any(o.kind != "ok" for o in out):
            self.first_failure_ts = time.time()
        return out

    def form(self, world_size: int, plan: BatchPlan, faults=None, init_weights=True):
        self.active, self.standby = world_members(self.active, self.standby, world_size)
        self.plan = plan
        self.formed.append((world_size, init_weights))
        return self._outcomes("form", world_size), {}

    def launch(self, start, end, faults, feed=None):
        """A round's calls, one per rank: played (their script consulted) when collected."""
        self.launched.append((start, end))
        self.calls.append(("launch", (start, end)))
        return [FakeRef((start, end)) for _ in self.active]

    def collect(self, refs, hang_timeout_s=None, first_step_timeout_s=None, idle=None):
        if idle is not None:  # the driver's work while a real round runs
            idle()
        start, end = refs[0].value
        return self._play(start, end)

    def settle(self, refs):
        """A round queued behind a failed one: every rank waited for failed too (collateral)."""
        self.settled.append(refs)
        return [None if ref is None else RankOutcome(r, "errored", error="in no world", cause="RuntimeError")
                for r, ref in enumerate(refs)]

    def _play(self, start, end):
        world = len(self.active)
        outcomes = self._outcomes("train", world)
        values = []
        for rank in range(world):
            if outcomes[rank].kind != "ok":
                values.append(None)
                continue
            lo, hi = self.plan.rank_rows(rank)
            values.append([{"step": s, "loss_sum": step_loss(s) * (hi - lo), "step_time_s": 0.01,
                            "data_wait_s": 0.0, "checkpoint_wait_s": 0.0, "local_s": local_s(rank, s), "comm_s": 0.0,
                            "compute_s": 0.01, "tokens": 0, "end_ts": time.time()} for s in range(start, end)])
            # {"sigterm": {n: [ranks]}}: those ranks' workers get SIGTERM in the nth train call; they
            # report it at the end of every round from then on (a replacement is another worker).
            if rank in self.script.get("sigterm", {}).get(self.counts["train"], ()):
                self.sigtermed.add(id(self.active[rank]))
            if id(self.active[rank]) in self.sigtermed:
                values[-1][-1]["preempted"] = True
        return outcomes, values

    def save(self, step: int, data_position=None, faults=None, room=None):
        return self._outcomes("save", len(self.active)), [{"save_s": 0.0}] * len(self.active)

    def persist(self, step: int, no_peer: frozenset = frozenset()) -> list[FakeRef]:
        self.no_peer[step] = set(no_peer)
        outcomes = self._outcomes("persist", len(self.active))
        return [FakeRef(error=RuntimeError(o.error)) if o.kind != "ok" else
                FakeRef({"files": {f"rank{r}.pt": [FILE_BYTES, 0]}, "layout": {}, "node_id": m.node_id,
                         "peer_node": None, "write_s": 0.0, "copied": []})
                for r, (m, o) in enumerate(zip(self.active, outcomes))]

    def upload(self, step: int, location: str, members: list) -> list[FakeRef]:
        outcomes = self._outcomes("upload", len(members))
        refs = []
        for r, o in enumerate(outcomes):
            if o.kind != "ok":
                refs.append(FakeRef(error=OSError(f"scripted {o.kind} failure of rank {r}'s upload")))
                continue
            d = Path(location) / step_name(step)
            d.mkdir(parents=True, exist_ok=True)
            (d / f"rank{r}.pt").write_bytes(b"\0" * FILE_BYTES)
            refs.append(FakeRef({"files": {f"rank{r}.pt": [FILE_BYTES, 0]}, "upload_s": 0.0,
                                 "window": [time.time(), time.time()]}))
        return refs

    def export(self, step_dir, out_dir, factory, model_kwargs, seed, timeout_s):
        raise NotImplementedError("the fake group exports nothing")

    def upload_from_store(self, step, names, location, nodes):
        if step in self.script.get("copies_lost", ()):  # the peer copy was cut short with its sender's node
            return FakeRef({"missing": list(names)})
        return FakeRef(error=OSError("scripted: the store's upload fails too"))

    def load(self, ckpt, durable, faults=None):
        world = len(self.active)
        outcomes = self._outcomes("load", world)
        values = [{"step": ckpt.step, "data_position": None, "bad": [], "copies": {"local": 0, "peer": 0, "durable": 1},
                   "resharded": ckpt.world_size != world, "fetch_s": 0.0, "reshard_s": 0.0, "bytes": 0, "load_s": 0.0}
                  if o.kind == "ok" else None for o in outcomes]
        return outcomes, values

    # ---- memory tier: committed manifests, every file held by node0 ---------------------------

    def commit_memory(self, step, manifest_json, timeout_s=60.0):
        self.memory[step] = Manifest.from_json(manifest_json)
        self.calls.append(("commit_memory", step))
        return self.node_memory()

    def prune_memory(self, keep, also_drop=(), timeout_s=60.0, wait=True):
        self.calls.append(("prune_memory", sorted(keep)))
        self.memory = {s: m for s, m in self.memory.items() if s in keep and s not in also_drop}
        return {}

    def memory_checkpoints(self, job, timeout_s=30.0):
        return [CheckpointInfo(s, m.world_size, m.bytes, "memory", f"memory:{step_name(s)}", m.created, manifest=m,
                               holders={name: ["node0"] for name in m.files}) for s, m in self.memory.items()]

    def end_memory(self, remove, keep, timeout_s=60.0):
        pass

    # ---- results of calls in flight ----------------------------------------------------------

    @staticmethod
    def ready(refs, timeout_s: float = 0.0) -> bool:
        return True

    @staticmethod
    def results(refs, timeout_s):
        for ref in refs:
            if ref.error is not None:
                raise ref.error
        return [ref.value for ref in refs]

    @staticmethod
    def each_result(refs, keys, timeout_s):
        done, failed = {}, {}
        for key, ref in zip(keys, refs):
            if ref.error is not None:
                failed[key] = f"{type(ref.error).__name__}: {ref.error}"
            else:
                done[key] = ref.value
        return done, failed

    # ---- losing and replacing workers --------------------------------------------------------

    def drop(self, ranks: list[int]) -> None:
        self.calls.append(("drop", sorted(ranks)))
        lost = set(ranks)
        self.active = [m for r, m in enumerate(self.active) if r not in lost]
        for _ in ranks:
            self._start()  # its replacement, in its bundle

    def release_idle(self) -> list[str]:
        """A planned shrink: idle workers go, their capacity back to the cluster."""
        n = len(self.standby) + len(self.pending)
        self.calls.append(("release_idle", n))
        self.free += n
        self.standby, self.pending = [], []
        return [f"pg{i}" for i in range(n)]

    def releasable(self, n: int) -> list[int]:
        return ranks_to_release(list(range(len(self.active))), n)  # one placement group per worker

    def release(self, ranks: list[int]) -> list[str]:
        self.calls.append(("release", sorted(ranks)))
        gone = set(ranks)
        self.active = [m for r, m in enumerate(self.active) if r not in gone]
        self.free += len(ranks)
        return [f"pg{r}" for r in ranks]

    def exclude(self, node_id: str) -> list[int]:
        self.excluded.add(node_id)
        return [r for r, m in enumerate(self.active) if m.node_id == node_id]

    def leave_all(self) -> None:
        pass

    def shutdown(self, timeout_s: float = 15.0) -> None:
        self.calls.append(("shutdown", None))
        self.active, self.pending, self.standby = [], [], []

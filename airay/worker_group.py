"""The one layer that owns Ray actors and placement groups.

Workers live in bundle slots of placement groups. A worker that dies leaves its slot vacant and
a replacement is started in it at once, in the background: if the node is alive the replacement
comes up in seconds; if the node is gone Ray re-places the bundle when capacity returns. Either
way the controller keeps training with the survivors and grows the world once a replacement is
ready (it stands by until then). Nothing outside this module holds an actor handle.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from airay import placement, policy
from airay.checkpoint import CheckpointInfo, Committer, MemoryReplica
from airay.storage import Storage
from airay.health import RankOutcome, find_hung, position
from airay.policy import BatchPlan
from airay.worker import TrainWorker, UserCodeError


@dataclass
class Member:
    actor: Any
    pg: PlacementGroup
    bundle_index: int
    ready_ref: Any
    info: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    joined: dict[str, Any] = field(default_factory=dict)  # what its last join handed torch and DeepSpeed

    @property
    def node_id(self) -> str | None:
        return self.info.get("node_id")


class WorkerGroup:
    def __init__(self, spec: dict[str, Any], per_worker: dict[str, float], strategy: str,
                 drain_s: float, replica: tuple[str, int] | None = None):
        """`replica`: (directory, checkpoints kept) of the memory tier's copy on a peer node."""
        self.spec = spec
        self.per_worker = per_worker
        self.strategy = strategy
        self.drain_s = drain_s
        self.pgs: list[PlacementGroup] = []
        self.active: list[Member] = []   # in the world, ordered by rank
        self.pending: list[Member] = []  # started, not yet ready
        self.standby: list[Member] = []  # ready, waiting to join at the next resize
        self.start_failures: list[str] = []  # why replacement workers died while starting
        self.first_failure_ts: float | None = None  # when the last failed call was first noticed
        self.hangs: list[dict[str, Any]] = []  # the hung ranks of the last failed round, and why
        self.excluded: set[str] = set()  # nodes kept out of placement for the rest of the run
        self.demanded = 0  # worker bundles requested from the autoscaler (placement.request_capacity)
        self._actor_cls = ray.remote(concurrency_groups={"control": 1, "io": 1})(TrainWorker)
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if per_worker.get("GPU") else {}
        self._actor_opts = {**placement.actor_options(per_worker), "max_restarts": 0,
                            "runtime_env": {"env_vars": env} if env else None}
        # The committer reshards checkpoints; it lives beside the driver, whose node outlives workers.
        self.driver_node = ray.get_runtime_context().get_node_id()
        # Uploads to durable storage run in their own thread, so they never hold up a commit.
        self.committer = ray.remote(concurrency_groups={"upload": 1})(Committer).options(
            num_cpus=0, max_restarts=-1, scheduling_strategy=NodeAffinitySchedulingStrategy(
                self.driver_node, soft=False)).remote()
        self.replica_spec = replica
        self.replica = None
        self.replica_node: str | None = None
        if replica is not None:
            self._place_replica()  # now, so a resumed run finds copies it left on that node

    def _place_replica(self) -> bool:
        """Start the memory tier's replica on a live node other than the driver's (and not an
        excluded one); False when there is none (a one-node cluster: no peer to copy to)."""
        peers = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != self.driver_node
                       and n["NodeID"] not in self.excluded)
        if not peers:
            return False
        self.replica_node = peers[0]
        self.replica = ray.remote(MemoryReplica).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
                self.replica_node, soft=False)).remote(*self.replica_spec)
        return True

    def replica_died(self, exc: BaseException) -> bool:
        """Whether a failed copy failed because the replica (or its node) died, not its source."""
        return (self.replica is not None and isinstance(exc, ray.exceptions.RayActorError)
                and exc.actor_id == self.replica._actor_id.hex())

    def replica_lost(self) -> None:
        """The replica (or its node) died: drop it; the next copy re-places it on a live peer."""
        if self.replica is not None:
            try:
                ray.kill(self.replica, no_restart=True)
            except Exception:
                pass
        self.replica, self.replica_node = None, None

    def replicate(self, path: str):
        """Copy a committed memory-tier checkpoint from the committer to the replica, actor to
        actor through the object store (never through the driver); returns the copy's ref, or
        None when there is no peer node."""
        if self.replica_spec is None or (self.replica is None and not self._place_replica()):
            return None
        files = self.committer.package_step.remote(path)
        return self.replica.receive.remote(Path(path).name, files)

    def replica_checkpoints(self, timeout_s: float = 30.0) -> tuple[list[CheckpointInfo], list[dict]]:
        """The replica's complete, checksum-verified copies (and those it set aside as corrupt);
        nothing when it is gone (its node lost)."""
        if self.replica is None:
            return [], []
        try:
            return ray.get(self.replica.checkpoints.remote(), timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            self.replica_lost()
            return [], []

    def lose_memory_primary(self) -> None:
        """Chaos: the committer dies as with its node (Ray restarts it, empty-handed)."""
        ray.kill(self.committer, no_restart=False)

    def commit(self, spec: dict, dirs: list[str]):
        """Hand each rank's saved files to the committer (through the object store, in the
        ranks' io threads while they train on); returns the commit's ref."""
        refs = [m.actor.collect.remote(d) for m, d in zip(self.active, dirs)]
        return self.committer.commit.remote(spec, *refs)

    def upload(self, path: str, durable: str, keep_last: int):
        """Upload a committed memory-tier checkpoint to durable storage, in the committer's upload
        thread (commits of later saves go on meanwhile); returns the upload's ref."""
        return self.committer.upload.options(concurrency_group="upload").remote(path, durable, keep_last)

    # ---- reserving capacity ----------------------------------------------------------------

    def capacity(self) -> int:
        """Workers that could be added now: placed-but-idle members plus bundles that fit free resources."""
        return len(self.standby) + placement.bundles_that_fit(
            placement.available_per_node(exclude=self.excluded), self.per_worker)

    def demand(self, n: int) -> None:
        """Keep a standing request for `n` worker bundles before the autoscaler (0: withdraw it).
        Renewed when a node is excluded, so the request is for capacity elsewhere."""
        self.demanded = n
        placement.request_capacity(self.per_worker, n, self.excluded)

    def reserve(self, n: int, timeout_s: float) -> int:
        """Reserve n bundles (in as many placement groups as the strategy needs) and start a
        worker in each (not waited for); returns the workers started (groups not placed within
        `timeout_s` are given up)."""
        fits = placement.fits_per_node(placement.available_per_node(exclude=self.excluded), self.per_worker)
        pgs = [placement_group([dict(self.per_worker) for _ in range(k)], strategy=self.strategy,
                               bundle_label_selector=placement.avoid_nodes(self.excluded, k))
               for k in placement.group_sizes(n, fits, self.strategy)]
        if not pgs:
            return 0
        refs = [pg.ready() for pg in pgs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        started = 0
        for pg, ref in zip(pgs, refs):
            if ref not in ready:
                remove_placement_group(pg)
                continue
            self.pgs.append(pg)
            for i in range(pg.bundle_count):
                self._start(pg, i)
            started += pg.bundle_count
        return started

    def _start(self, pg: PlacementGroup, bundle_index: int) -> Member:
        opts = {k: v for k, v in self._actor_opts.items() if v is not None}
        actor = self._actor_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
            **opts).remote(self.spec)
        member = Member(actor, pg, bundle_index, actor.warmup.remote())
        self.pending.append(member)
        return member

    def poll_pending(self, timeout_s: float = 0.0) -> list[Member]:
        """Move workers that are up and warmed to standby; returns the newly ready ones."""
        if not self.pending:
            return []
        refs = [m.ready_ref for m in self.pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        newly = []
        for m in [m for m in self.pending if m.ready_ref in ready]:
            self.pending.remove(m)
            try:
                m.info = ray.get(m.ready_ref)
            except ray.exceptions.RayActorError as exc:
                self.start_failures.append(str(exc).splitlines()[0])
                self._start(m.pg, m.bundle_index)  # died while starting: try its slot again
                continue
            except ray.exceptions.RayTaskError as exc:  # the user's model or spec fails: no retry
                raise RuntimeError(f"a worker failed to start: {getattr(exc, 'cause', None) or exc}") from exc
            self.standby.append(m)
            newly.append(m)
        return newly

    def wait_for_standby(self, n: int, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while len(self.standby) < n:
            left = deadline - time.time()
            if left <= 0:
                return False
            self.poll_pending(timeout_s=min(left, 1.0))
        return True

    # ---- forming the world -----------------------------------------------------------------

    def form(self, world_size: int, plan: BatchPlan, load_universal: bool) -> tuple[list[RankOutcome], dict]:
        """Make a world of `world_size`: survivors keep their order, standby workers join after."""
        # Joining workers take ranks grouped by node: co-located ranks are neighbours (the order
        # ring collectives favour), and a node's ranks are predictable for chaos at named ranks.
        self.standby.sort(key=lambda m: (m.node_id or "", m.bundle_index))
        while len(self.active) < world_size and self.standby:
            self.active.append(self.standby.pop(0))
        if len(self.active) > world_size:  # an allowed size below the survivors (whole nodes only)
            idle = policy.ranks_to_idle([m.node_id for m in self.active], world_size)
            self.standby += [self.active[r] for r in idle]
            self.active = [m for r, m in enumerate(self.active) if r not in idle]
        assert len(self.active) == world_size, (len(self.active), world_size)
        master = self.active[0]
        port = ray.get(master.actor.free_port.remote())
        refs = [m.actor.join.remote(rank, world_size, master.info["ip"], port, plan.__dict__, load_universal)
                for rank, m in enumerate(self.active)]
        outcomes, values = self._gather(refs)
        for m, v in zip(self.active, values):
            m.joined = v or {}
        timings = {k: max(v[k] for v in values if v) for k in ("process_group_s", "engine_s", "join_s")} \
            if all(values) else {}
        return outcomes, timings

    # ---- collective calls ------------------------------------------------------------------

    def train(self, start: int, end: int, faults: dict[int, dict[int, dict]],
              after_launch: Callable[[], None] | None = None,
              hang_timeout_s: float | None = None,
              feed: dict[int, list] | None = None) -> tuple[list[RankOutcome], list]:
        refs = [m.actor.train.remote(start, end, faults.get(rank), feed) for rank, m in enumerate(self.active)]
        if after_launch is not None:
            after_launch()
        return self._gather(refs, hang_timeout_s)

    def save(self, step: int, data_position: dict | None = None) -> tuple[list[RankOutcome], list]:
        return self._gather([m.actor.save.remote(step, data_position) for m in self.active])

    def load(self, ckpt: CheckpointInfo) -> tuple[list[RankOutcome], list]:
        """Every rank loads `ckpt`: a memory-tier one is served by the committer, a remote one
        is downloaded by each rank, a shared directory is read in place."""
        if ckpt.tier == "memory":
            holder = self.replica if ckpt.copy == "replica" else self.committer
            files = holder.package.remote(ckpt.path, ckpt.load_tag)
            refs = [m.actor.load.remote(ckpt.path, ckpt.load_tag, "memory", files) for m in self.active]
        elif Storage(ckpt.root).is_local:
            refs = [m.actor.load.remote(ckpt.path, ckpt.load_tag) for m in self.active]
        else:
            refs = [m.actor.load.remote(ckpt.path, ckpt.load_tag, "storage", root=ckpt.root, name=ckpt.name)
                    for m in self.active]
        return self._gather(refs)

    def _gather(self, refs: list, hang_timeout_s: float | None = None) -> tuple[list[RankOutcome], list]:
        """Wait for one call per rank. Once any rank fails, the rest get `drain_s` to finish
        (their collectives fail fast when a peer's sockets close); ranks still silent then are
        counted as lost. With `hang_timeout_s`, ranks' heartbeats are polled meanwhile and a rank
        that makes no progress that long (airay.health.find_hung) is killed as hung."""
        by_ref = {ref: rank for rank, ref in enumerate(refs)}
        outcomes: dict[int, RankOutcome] = {}
        values: list = [None] * len(refs)
        deadline = None
        watch = _HangWatch(len(refs), hang_timeout_s) if hang_timeout_s else None
        self.hangs = []
        while by_ref:
            timeout = (watch.poll_s if watch else 1.0) if deadline is None else max(0.0, deadline - time.time())
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout)
            for ref in ready:
                rank = by_ref.pop(ref)
                try:
                    values[rank] = ray.get(ref)
                    outcomes[rank] = RankOutcome(rank, "ok")
                except ray.exceptions.RayActorError as exc:
                    outcomes[rank] = RankOutcome(rank, "died", error=str(exc).splitlines()[0],
                                                 cause=type(exc).__name__)
                except ray.exceptions.RayTaskError as exc:
                    cause = getattr(exc, "cause", None)
                    # str(MemoryError()) is empty: name the exception too, except our own wrapper.
                    error = str(cause) if isinstance(cause, UserCodeError) \
                        else f"{type(cause or exc).__name__}: {cause or exc}"
                    outcomes[rank] = RankOutcome(rank, "errored", error=error,
                                                 user_error=isinstance(cause, UserCodeError),
                                                 cause=type(cause).__name__ if cause is not None else "",
                                                 step=getattr(cause, "step", None))
                except ray.exceptions.RayError as exc:  # e.g. an object the call needed was lost
                    outcomes[rank] = RankOutcome(rank, "errored", error=str(exc).splitlines()[0],
                                                 cause=type(exc).__name__)
            if watch is not None and deadline is None and by_ref:
                running = set(by_ref.values())
                for rank in watch.poll([self.active[r].actor for r in range(len(refs))], running):
                    by_ref.pop(refs[rank])
                    self.hangs.append(watch.describe(rank))
                    outcomes[rank] = RankOutcome(rank, "hung", error=self.hangs[-1]["reason"])
                    # A hung process cannot be asked to stop; SIGKILL through Ray is the only way.
                    ray.kill(self.active[rank].actor, no_restart=True)
            if deadline is None and any(o.kind != "ok" for o in outcomes.values()):
                self.first_failure_ts = time.time()
                deadline = self.first_failure_ts + self.drain_s
                # The world is broken: wake every rank still inside a collective.
                for ref, rank in by_ref.items():
                    self.active[rank].actor.abort_world.remote()
            if deadline is not None and time.time() >= deadline:
                break
        for ref, rank in by_ref.items():
            outcomes[rank] = RankOutcome(rank, "silent", error=f"no answer {self.drain_s:.0f}s after a peer failed")
        return [outcomes[r] for r in range(len(refs))], values

    # ---- losing and replacing workers -------------------------------------------------------

    def member(self, rank: int) -> Member:
        return self.active[rank]

    def drop(self, ranks: list[int]) -> None:
        """Remove lost ranks from the world, kill what is left of them, start replacements in
        their bundles (not on excluded nodes: their capacity is found elsewhere by `reserve`)."""
        for m in [self.active[r] for r in ranks]:
            self.active.remove(m)
            ray.kill(m.actor, no_restart=True)
            if m.node_id not in self.excluded:
                self._start(m.pg, m.bundle_index)

    def exclude(self, node_id: str) -> list[int]:
        """Keep `node_id` out of placement from now on: idle workers there are killed and not
        replaced; returns the ranks of active workers there, for the caller to drop. The node's
        bundles stay reserved by their placement groups until the run ends (Ray cannot release
        one bundle of a group), which also keeps other work of this run off it."""
        self.excluded.add(node_id)
        if self.demanded:
            self.demand(self.demanded)  # the request now asks for room off this node
        for pool in (self.standby, self.pending):
            for m in [m for m in pool if m.node_id == node_id or _bundle_node(m) == node_id]:
                pool.remove(m)
                ray.kill(m.actor, no_restart=True)
        return [r for r, m in enumerate(self.active) if m.node_id == node_id]

    def leave_all(self) -> None:
        """Survivors of a failed round leave their broken process group (errors ignored)."""
        refs = [m.actor.leave.remote() for m in self.active]
        ray.wait(refs, num_returns=len(refs), timeout=self.drain_s)

    def shutdown(self, timeout_s: float = 15.0) -> None:
        """Kill every actor and remove every placement group this group made, and wait until
        Ray reports them gone, so a run that returns has really given its resources back."""
        if self.demanded:
            try:
                self.demand(0)  # the autoscaler may scale the run's nodes down again
            except Exception as exc:  # the cluster is going away: nothing left to withdraw from
                print(f"airay: could not withdraw the autoscaler request: {exc}")
        actors = [m.actor for m in self.active + self.pending + self.standby] + [self.committer]
        actors += [self.replica] if self.replica is not None else []
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.active, self.pending, self.standby = [], [], []
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception:
                pass
        pg_ids = {pg.id.hex() for pg in self.pgs}
        self.pgs = []
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            table = ray.util.placement_group_table()
            if all(table.get(i, {}).get("state", "REMOVED") == "REMOVED" for i in pg_ids):
                break
            time.sleep(0.1)


def node_alive(node_id: str | None) -> bool:
    if node_id is None:
        return False
    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())


def nodes_died(nodes: set[str | None], suspects: set[str | None], wait_s: float) -> set[str | None]:
    """Which of `nodes` are dead by Ray's health checks: now, or for `suspects` (nodes Ray lost
    contact with) within `wait_s`. One wait for them all, however many ranks they held."""
    deadline = time.time() + wait_s
    while True:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        dead = {n for n in nodes if n not in alive}
        if not (suspects - dead) or time.time() >= deadline:
            return dead
        time.sleep(0.1)


def _bundle_node(m: Member) -> str | None:
    """The node a pending worker's bundle is on (its own info arrives only once it is ready)."""
    table = ray.util.placement_group_table(m.pg)
    return table.get("bundles_to_node_id", {}).get(m.bundle_index)


class _HangWatch:
    """Polls every running rank's heartbeat and remembers when its progress last changed."""

    def __init__(self, world: int, hang_timeout_s: float):
        now = time.time()
        self.timeout = hang_timeout_s
        self.poll_s = min(1.0, hang_timeout_s / 4)
        self.progress: dict[int, dict] = {r: {} for r in range(world)}
        self.last_change = {r: now for r in range(world)}
        self.last_answer = {r: now for r in range(world)}
        self.inflight: dict[int, Any] = {}

    def poll(self, actors: list, running: set[int]) -> list[int]:
        """Collect answered heartbeats, ask again, return the ranks to declare hung."""
        now = time.time()
        if self.inflight:
            ready, _ = ray.wait(list(self.inflight.values()), num_returns=len(self.inflight), timeout=0)
            for rank, ref in list(self.inflight.items()):
                if ref not in ready:
                    continue
                del self.inflight[rank]
                try:
                    beat = ray.get(ref)
                except ray.exceptions.RayError:
                    continue  # the actor died: its train call reports that
                self.last_answer[rank] = now
                if beat != self.progress[rank]:
                    self.progress[rank], self.last_change[rank] = beat, now
        for rank in running:
            if rank not in self.inflight:
                self.inflight[rank] = actors[rank].heartbeat.remote()
        answering = {r for r in running if now - self.last_answer[r] < self.timeout}
        return find_hung({r: position(self.progress[r]) for r in running},
                         {r: self.last_change[r] for r in running}, answering, now, self.timeout)

    def describe(self, rank: int) -> dict[str, Any]:
        now = time.time()
        p = self.progress[rank]
        answering = now - self.last_answer[rank] < self.timeout
        where = f"step {p.get('step')} micro-batch {p.get('micro')} phase {p.get('phase')}" if p else "its first step"
        return {"rank": rank, "stalled_s": now - self.last_change[rank], "heartbeat": answering, "progress": p,
                "reason": f"no progress for {now - self.last_change[rank]:.1f}s at {where}; heartbeat "
                          f"{'answering (blocked in the training thread)' if answering else 'not answering (process stopped)'}"}

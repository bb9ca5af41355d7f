"""The one layer that owns Ray actors and placement groups.

Workers live in bundle slots of placement groups. A worker that dies leaves its slot vacant and
a replacement is started in it at once, in the background: if the node is alive the replacement
comes up in seconds; if the node is gone Ray re-places the bundle when capacity returns. Either
way the controller keeps training with the survivors and grows the world once a replacement is
ready (it stands by until then). Each node that trains also has a NodeStore (its memory tier of
checkpoints, airay.checkpoint.actors). Nothing outside this module holds an actor handle.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from airay import placement, policy
from airay.checkpoint.actors import start_store
from airay.checkpoint.layout import CheckpointInfo, Manifest, step_name
from airay.health import RankOutcome, actor_died, deadline, find_hung, position
from airay.policy import BatchPlan
from airay.worker import TrainWorker
from airay.worker.failures import RankError, UserCodeError


@dataclass
class Member:
    actor: Any
    pg: PlacementGroup
    bundle_index: int
    ready_ref: Any
    info: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    joined: dict[str, Any] = field(default_factory=dict)  # what its last join handed torch and DeepSpeed
    warm: bool = True  # started with a warm-up engine build, or has built an engine since
    ready_ts: float = 0.0  # when it was up (and warm) and moved to standby
    team: tuple | None = None  # its model-parallel group in the last world it joined (airay.parallel.layout)

    @property
    def node_id(self) -> str | None:
        return self.info.get("node_id")


class WorkerGroup:
    def __init__(self, spec: dict[str, Any], per_worker: dict[str, float], strategy: str,
                 drain_s: float, memory_base: str, job: dict, phase_timeout_s: float = 600.0, unit: int = 0,
                 mp: int = 1):
        """`memory_base`: the job's memory-tier directory on every node; `job`: its identity;
        `phase_timeout_s`: a rank without progress this long in a join, save or load is hung;
        `unit`: bundles per placement group at most (0: as the strategy allows), so a planned
        shrink can give back whole groups (airay.placement.group_sizes); `mp`: ranks per
        model-parallel group, which share a node (every placement group is one node's, of whole
        groups) and are the unit of a world (a member of a broken group stands by)."""
        self.unit, self.mp = unit, mp
        self.spec = spec
        self.per_worker = per_worker
        self.strategy = strategy  # STRICT_PACK with mp > 1 (placement.strategy_for)
        self._worlds = 0  # worlds formed: names each one's model-parallel groups (Member.team)
        self.drain_s = drain_s
        self.phase_timeout_s = phase_timeout_s
        self.pgs: list[PlacementGroup] = []
        self.active: list[Member] = []   # in the world, ordered by rank
        self.pending: list[Member] = []  # started, not yet ready
        self.standby: list[Member] = []  # ready, waiting to join at the next resize
        self.start_failures: list[str] = []  # why replacement workers died while starting
        self.first_failure_ts: float | None = None  # when the last failed call was first noticed
        self.hangs: list[dict[str, Any]] = []  # the hung ranks of the last failed round, and why
        self.excluded: set[str] = set()  # nodes kept out of placement for the rest of the run
        self.demanded = 0  # worker bundles requested from the autoscaler (placement.request_capacity)
        self.fresh: set[int] = set()  # ranks that have completed no round in the world they are in
        self._actor_cls = ray.remote(concurrency_groups={"control": 1, "io": 1, "upload": 1})(TrainWorker)
        env = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"} if per_worker.get("GPU") else {}
        self._actor_opts = {**placement.actor_options(per_worker), "max_restarts": 0,
                            "runtime_env": {"env_vars": env} if env else None}
        self.memory_base, self.job = memory_base, job
        self.stores: dict[str, Any] = {}  # node id -> its NodeStore
        self._store_starts: dict[str, Any] = {}  # node id -> a NodeStore started, not yet checked
        self.foreign_tiers: list[dict] = []  # other jobs' memory tiers the stores found (and cleared)
        self.catalog_failures: list[dict] = []  # stores whose catalog did not come (memory_checkpoints)

    # ---- the cluster, as the controller needs it ---------------------------------------------

    @staticmethod
    def default_resources() -> dict[str, float]:
        """One worker's bundle when the spec gives none: a GPU where the cluster has GPUs, else a CPU."""
        return placement.default_worker_resources(ray.cluster_resources())

    @staticmethod
    def dead_nodes(nodes: set[str | None], suspects: set[str | None], wait_s: float) -> set[str | None]:
        return nodes_died(nodes, suspects, wait_s)

    # ---- results of calls in flight (checkpoint commits and uploads) --------------------------

    @staticmethod
    def ready(refs: list, timeout_s: float = 0.0) -> bool:
        """Whether every call of `refs` has finished (within `timeout_s`)."""
        return not refs or len(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0]) == len(refs)

    @staticmethod
    def results(refs: list, timeout_s: float) -> list:
        """Every call's result; raises the first failure (or a timeout)."""
        return ray.get(refs, timeout=timeout_s)

    @staticmethod
    def each_result(refs: list, keys: list, timeout_s: float) -> tuple[dict, dict]:
        """Each call's result by its key, and {key: error} of the calls that failed (all within
        one deadline of `timeout_s`)."""
        from airay.checkpoint.manager import error_text

        deadline = time.time() + timeout_s
        done, failed = {}, {}
        for key, ref in zip(keys, refs):
            try:
                done[key] = ray.get(ref, timeout=max(0.0, deadline - time.time()))
            except Exception as exc:  # the rank or store died, or its storage failed: the caller decides
                failed[key] = error_text(exc)
        return done, failed

    # ---- the nodes' checkpoint stores -------------------------------------------------------

    def ensure_stores(self, timeout_s: float = 60.0) -> None:
        """A NodeStore on every node of the world and of the workers standing by (started once
        per node, pinned to it)."""
        new = {}
        for node in sorted({m.node_id for m in self.active + self.standby if m.node_id} - set(self.stores)):
            new[node] = self._store_starts.pop(node, None) or self._new_store(node)
        for node, store in new.items():
            try:
                info = ray.get(store.info.remote(), timeout=timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:  # the node is going: no store
                print(f"[airay] no checkpoint store on node {node[:8]}: {str(exc).splitlines()[0]}",
                      file=sys.stderr)
                continue
            self.stores[node] = store
            if info["foreign"] is not None:
                self.foreign_tiers.append({"node_id": node, "path": info["root"], "found": info["foreign"]})

    def _new_store(self, node: str):
        return start_store(node, self.memory_base, self.job)

    def _start_stores(self, pgs: list[PlacementGroup]) -> None:
        """Start the NodeStores of the nodes `pgs` landed on, not waited for: each comes up while
        the workers import, instead of after them (ensure_stores checks them)."""
        from ray.util.placement_group import placement_group_table

        for pg in pgs:
            for node in placement_group_table(pg).get("bundles_to_node_id", {}).values():
                if node and node not in self.stores and node not in self._store_starts:
                    self._store_starts[node] = self._new_store(node)

    def _live_stores(self) -> dict[str, Any]:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for node in [n for n in self.stores if n not in alive]:
            del self.stores[node]  # its memory went with it
        return self.stores

    def ring(self) -> dict[str, str]:
        """Each node's successor (nodes in id order, the last followed by the first): where its
        ranks copy their files. Empty with fewer than two nodes."""
        nodes = sorted(self._live_stores())
        if len(nodes) < 2:
            return {}
        return {node: nodes[(i + 1) % len(nodes)] for i, node in enumerate(nodes)}

    def commit_memory(self, step: int, manifest_json: str, timeout_s: float = 60.0) -> list[dict]:
        """Record a committed step's manifest on every node (a node that fails to is skipped:
        whether its copies are usable is decided when a load needs them); returns the memory
        figures of each store that did (node_memory's, read as it committed)."""
        stores = self._live_stores()
        manifest = ray.put(manifest_json)  # one copy for every node (it lists every rank's files)
        done, _ = self.each_result([s.commit.remote(step, manifest) for s in stores.values()], list(stores), timeout_s)
        return list(done.values())

    def prune_memory(self, keep: list[int], also_drop: list[int] = (), timeout_s: float = 60.0,
                     wait: bool = True) -> dict:
        """Every live store keeps only the steps of `keep` (less `also_drop`); with `wait`, for
        up to `timeout_s`; returns the calls' refs by node."""
        keep = [k for k in keep if k not in also_drop]
        refs = {node: s.prune.remote(keep) for node, s in self._live_stores().items()}
        if wait:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        return refs

    def memory_checkpoints(self, job: dict, timeout_s: float = 30.0) -> list[CheckpointInfo]:
        """Complete memory-tier checkpoints of `job`: a manifest on some node, and every file it
        lists held (at its size) by some live node. A store whose catalog does not come within
        `timeout_s` is asked once more, for twice as long; what happened is kept in
        `catalog_failures` (the caller's events): a node's copies are never dropped unsaid."""
        stores = self._live_stores()
        catalogs: dict[str, dict] = {}
        for attempt, wait_s in enumerate((timeout_s, 2 * timeout_s)):
            refs = {node: s.catalog.remote() for node, s in stores.items() if node not in catalogs}
            deadline = time.time() + wait_s
            for node, ref in refs.items():
                try:
                    catalogs[node] = ray.get(ref, timeout=max(0.0, deadline - time.time()))
                except (ray.exceptions.RayError, TimeoutError) as exc:
                    self.catalog_failures.append({"node_id": node, "attempt": attempt + 1, "timeout_s": wait_s,
                                                  "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                                                  "retried": attempt == 0})
            if len(catalogs) == len(stores):
                break
        manifests: dict[int, Manifest] = {}
        for step in sorted({step for cat in catalogs.values() for step, entry in cat.items() if entry["manifest"]}):
            # Every node holds the same manifest: one node's text is read (it lists every rank's
            # files, so one from each node would be O(world x nodes) bytes), the next one's if
            # that is unreadable or another job's.
            for node in [node for node, cat in catalogs.items() if cat.get(step, {}).get("manifest")]:
                try:
                    manifest = Manifest.from_json(ray.get(stores[node].manifest.remote(step), timeout=timeout_s))
                except (ray.exceptions.RayError, TimeoutError, ValueError, TypeError):
                    continue
                if manifest.job.get("id") == job["id"]:
                    manifests[step] = manifest
                    break
        out = []
        for step, manifest in manifests.items():
            holders: dict[str, list[str]] = {name: [] for name in manifest.files}
            for node, cat in catalogs.items():  # each file a node holds at its size: O(files held)
                for name, size in cat.get(step, {}).get("files", {}).items():
                    if name in holders and manifest.files[name].size == size:
                        holders[name].append(node)
            if all(holders.values()):
                out.append(CheckpointInfo(step, manifest.world_size, manifest.bytes, "memory",
                                          f"memory:{step_name(step)}", manifest.created, manifest=manifest,
                                          holders=holders))
        return out

    def node_memory(self, nodes: list[str] | None = None, timeout_s: float = 10.0) -> list[dict]:
        """The memory figures of every live store's node (of `nodes`), for the tier's budget; a
        store that does not answer in time is left out (its node keeps its last budget)."""
        stores = {n: s for n, s in self._live_stores().items() if nodes is None or n in nodes}
        done, _ = self.each_result([s.memory.remote() for s in stores.values()], list(stores), timeout_s)
        return list(done.values())

    def memory_usage(self, timeout_s: float = 30.0) -> dict[str, dict[int, int]]:
        """{node: {step: bytes held there}} of every live store that answers in time."""
        stores = self._live_stores()
        done, _ = self.each_result([s.usage.remote() for s in stores.values()], list(stores), timeout_s)
        return done

    def drop_copies(self, node: str, files: dict[int, list[str]], timeout_s: float = 60.0) -> None:
        """Remove files (peer copies) of steps from one node's store ({step: [file names]})."""
        store = self._live_stores().get(node)
        if store is not None:
            ray.wait([store.drop_files.remote(files)], timeout=timeout_s)

    def end_memory(self, remove: bool, keep: list[int], timeout_s: float = 60.0) -> None:
        """The run ends: a finished run's memory tier goes (its last checkpoint is durable); one
        that stopped otherwise keeps its newest steps for a re-run to resume from."""
        stores = self._live_stores()
        refs = [s.remove.remote() if remove else s.prune.remote(keep) for s in stores.values()]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def damage_memory(self, step: int, name: str, nodes: list[str] | None = None) -> list[str]:
        """Chaos: flip bytes in the copies of a file on `nodes` (default: every node holding it)."""
        stores = {n: s for n, s in self._live_stores().items() if nodes is None or n in nodes}
        return [ray.get(s.damage.remote(step, name), timeout=60) for n, s in stores.items()
                if name in ray.get(s.catalog.remote(), timeout=60).get(step, {}).get("files", {})]

    def drop_memory(self, step: int, node: str) -> list[str]:
        """Chaos: a node's memory-tier copies of a step are lost."""
        return ray.get(self.stores[node].drop.remote(step), timeout=60)

    # ---- reserving capacity ----------------------------------------------------------------

    def capacity(self) -> int:
        """Workers that could be added now: placed-but-idle members plus bundles that fit free resources."""
        fits = placement.fits_per_node(placement.available_per_node(exclude=self.excluded), self.per_worker)
        return len(self.standby) + sum(f - f % self.mp for f in fits)

    def formable(self) -> int:
        """The largest world the active and standby workers make: all of them, or with
        model-parallel groups, the ranks of the whole groups they form (airay.parallel.layout)."""
        if self.mp == 1:
            return len(self.active) + len(self.standby)
        return self.mp * len(_teams(self.active + self.standby, self.mp))

    def demand(self, n: int) -> None:
        """Keep a standing request for `n` worker bundles before the autoscaler (0: withdraw it).
        Renewed when a node is excluded, so the request is for capacity elsewhere."""
        self.demanded = n
        placement.request_capacity(self.per_worker, n, self.excluded)

    def reserve(self, n: int, timeout_s: float, warm: bool = True) -> int:
        """Reserve n bundles (in as many placement groups as the strategy needs) and start a
        worker in each (not waited for); returns the workers started (groups not placed within
        `timeout_s` are given up). `warm`: each builds a throwaway engine before it stands by
        (TrainWorker.warmup); False for the run's first world, which joins as soon as it is up."""
        fits = placement.fits_per_node(placement.available_per_node(exclude=self.excluded), self.per_worker)
        pgs = [placement_group([dict(self.per_worker) for _ in range(k)], strategy=self.strategy,
                               bundle_label_selector=placement.avoid_nodes(self.excluded, k))
               for k in placement.group_sizes(n, fits, self.strategy, self.unit, self.mp)]
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
                self._start(pg, i, warm)
            started += pg.bundle_count
        self._start_stores([pg for pg, ref in zip(pgs, refs) if ref in ready])
        return started

    def _start(self, pg: PlacementGroup, bundle_index: int, warm: bool = True) -> Member:
        opts = {k: v for k, v in self._actor_opts.items() if v is not None}
        actor = self._actor_cls.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index),
            **opts).remote(self.spec)
        member = Member(actor, pg, bundle_index, (actor.warmup if warm else actor.ready).remote(), warm=warm)
        self.pending.append(member)
        return member

    def poll_pending(self, timeout_s: float = 0.0) -> list[Member]:
        """Move workers that are up and warmed to standby; returns the newly ready ones."""
        if not self.pending:
            return []
        refs = [m.ready_ref for m in self.pending]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])  # a set: O(1) lookups
        newly, up = [], [m for m in self.pending if m.ready_ref in ready]
        self.pending = [m for m in self.pending if m.ready_ref not in ready]
        for m in up:
            try:
                m.info = ray.get(m.ready_ref)
            except ray.exceptions.RayActorError as exc:
                self.start_failures.append(str(exc).splitlines()[0])
                self._start(m.pg, m.bundle_index, m.warm)  # died while starting: try its slot again
                continue
            except ray.exceptions.RayTaskError as exc:  # the user's model or spec fails: no retry
                raise RuntimeError(f"a worker failed to start: {getattr(exc, 'cause', None) or exc}") from exc
            m.ready_ts = time.time()
            self.standby.append(m)
            newly.append(m)
        return newly

    def wait_for_standby(self, n: int, timeout_s: float) -> bool:
        """Wait until `n` more workers than the active ones can be in a world (whole
        model-parallel groups: `formable`)."""
        deadline = time.time() + timeout_s
        while self.formable() - len(self.active) < n:
            left = deadline - time.time()
            if left <= 0:
                return False
            self.poll_pending(timeout_s=min(left, 1.0))
        return True

    # ---- forming the world -----------------------------------------------------------------

    def form(self, world_size: int, plan: BatchPlan, faults: dict[int, dict] | None = None,
             init_weights: bool = True) -> tuple[list[RankOutcome], dict]:
        """Make a world of `world_size`: survivors keep their order, standby workers join after.
        `faults`: chaos struck in the ranks' joins. `init_weights` False: a checkpoint load
        follows, so the ranks build their models without weights (airay.worker.build). A rank that dies or hangs meanwhile (rank 0
        picking the rendezvous port included) comes back as its outcome, like one in a round."""
        self.active, self.standby = world_members(self.active, self.standby, world_size, self.mp)
        assert len(self.active) == world_size, (len(self.active), world_size)
        self._worlds += 1
        for rank, m in enumerate(self.active):
            m.team = (self._worlds, rank // self.mp)
        for m in self.standby:
            m.team = None
        master = self.active[0]
        (picked,), ports = self._gather([master.actor.free_port.remote()], self.phase_timeout_s, collective=False)
        if picked.kind != "ok":
            return [picked] + [RankOutcome(r, "ok") for r in range(1, world_size)], {}
        faults = faults or {}
        refs = [m.actor.join.remote(rank, world_size, master.info["ip"], ports[0], plan.__dict__, faults.get(rank),
                                    init_weights)
                for rank, m in enumerate(self.active)]
        outcomes, values = self._gather(refs, self.phase_timeout_s, abort_port=ports[0])
        self.fresh = set(range(world_size))
        for m, v in zip(self.active, values):
            m.joined = v or {}
            m.warm = True  # its join built an engine
        # Standby workers started cold (the first world's spares) warm up now, off the critical path.
        for m in [m for m in self.standby if not m.warm]:
            self.standby.remove(m)
            m.ready_ref, m.warm = m.actor.warmup.remote(), True
            self.pending.append(m)
        timings = {k: max(v[k] for v in values if v) for k in ("process_group_s", "engine_s", "join_s")} \
            if all(values) else {}
        return outcomes, timings

    # ---- collective calls ------------------------------------------------------------------

    def launch(self, start: int, end: int, faults: dict[int, dict[int, dict]],
               feed: dict[int, list] | None = None) -> list:
        """Queue the round [start, end) on every rank; returns the calls' refs. A rank runs its
        training calls one at a time, in order: a round launched while another runs starts the
        moment that one ends (the controller's pipelined rounds)."""
        return [m.actor.train.remote(start, end, faults.get(rank), feed) for rank, m in enumerate(self.active)]

    def collect(self, refs: list, hang_timeout_s: float | None = None,
                first_step_timeout_s: float | None = None, idle=None) -> tuple[list[RankOutcome], list]:
        """Wait for a launched round: its outcomes and each rank's step records. A rank that has
        completed no step in its world yet may stand still for `first_step_timeout_s`. `idle()`
        is called while the round runs (gather_calls): the driver's own work meanwhile."""
        first = dict.fromkeys(self.fresh, first_step_timeout_s) if first_step_timeout_s else None
        outcomes, values = self._gather(refs, hang_timeout_s, first_step=first, idle=idle)
        self.fresh -= {o.rank for o, v in zip(outcomes, values) if o.kind == "ok" and v}
        return outcomes, values

    def settle(self, refs: list) -> list[RankOutcome | None]:
        """A round queued behind one that failed cannot finish (a peer is gone): wake its ranks
        (abort_world) and wait for them, at most drain_s. None for a rank whose ref is None (it
        was lost in the failed round: not waited for)."""
        outcomes, _ = self._gather(refs, broken=True)
        return [o if ref is not None else None for o, ref in zip(outcomes, refs)]

    def save(self, step: int, data_position: dict | None = None,
             faults: dict[int, dict] | None = None, room: dict | None = None) -> tuple[list[RankOutcome], list]:
        """Every rank stages its part of `step` into its node's memory tier (a collective).
        `room`: the stores' removals by node (prune_memory's refs); a rank's writes wait for those
        of its node and of the peer its files are copied to (two refs a rank, whatever the
        cluster's size)."""
        self.ensure_stores()
        faults, room, ring = faults or {}, room or {}, self.ring() if room else {}
        return self._gather([m.actor.save.remote(step, data_position, self.memory_base, faults.get(rank),
                                                 [room[n] for n in dict.fromkeys((m.node_id, ring.get(m.node_id)))
                                                  if n in room])
                             for rank, m in enumerate(self.active)], self.phase_timeout_s)

    def persist(self, step: int, no_peer: frozenset[str] = frozenset()) -> list:
        """Every rank finishes writing its files of `step` and copies them to the next node's
        store (not the ranks of `no_peer` nodes: the memory budget has no room for their copy),
        beside training (its io thread); returns the calls' refs (their reports)."""
        ring = {n: p for n, p in self.ring().items() if n not in no_peer}
        return [m.actor.persist.remote(step, self.stores.get(ring.get(m.node_id)), ring.get(m.node_id))
                for m in self.active]

    def upload(self, step: int, location: str, members: list[Member]) -> list:
        """The ranks that saved `step` (`members`, whatever the world is now) upload their files
        of it to durable storage, all in parallel (each in its upload thread); returns the refs."""
        return [m.actor.upload.remote(step, location) for m in members]

    def upload_from_store(self, step: int, names: list[str], location: str, nodes: list[str]):
        """A node's store uploads files of `step` it holds (a lost rank's, from its own node or
        its peer copy): the first of `nodes` whose store is alive; returns the call's ref (its
        value {"missing": names} when no live node holds them)."""
        stores = self._live_stores()
        node = next((n for n in nodes if n in stores), None)
        if node is None:
            return ray.put({"missing": list(names)})
        return stores[node].upload.remote(step, names, location)

    def load(self, ckpt: CheckpointInfo, durable: str | None,
             faults: dict[int, dict] | None = None) -> tuple[list[RankOutcome], list]:
        """Every rank loads `ckpt` from the nearest good copy of each file it needs (its node's
        memory, a peer's, durable storage `durable`), resharded when the world size changed. In
        two phases: the files are found and verified first, with no collective, so a step with
        no good copy of some file is given up by every rank before any of them waits on others."""
        self.ensure_stores()
        peers = {name: [(node, self.stores[node]) for node in nodes if node in self.stores]
                 for name, nodes in ckpt.holders.items()}
        # One copy in the object store for every rank (the manifest and the stores' handles are
        # O(world): a copy per call would be O(world^2) bytes); Ray hands each call the value.
        spec = ray.put({"step": ckpt.step, "manifest": ckpt.manifest.to_json(), "memory_base": self.memory_base,
                        "peers": peers, "durable": durable})
        outcomes, values = self._gather([m.actor.prepare_load.remote(spec) for m in self.active],
                                        self.phase_timeout_s, collective=False)
        if any(o.kind != "ok" for o in outcomes):
            return outcomes, values
        faults = faults or {}
        outcomes, loaded = self._gather([m.actor.load.remote(ckpt.step, faults.get(rank))
                                         for rank, m in enumerate(self.active)], self.phase_timeout_s)
        return outcomes, [{**v, **(lv or {})} for v, lv in zip(values, loaded)]

    def _gather(self, refs: list, hang_timeout_s: float | None = None,
                collective: bool = True, abort_port: int | None = None,
                broken: bool = False, first_step: dict[int, float] | None = None,
                idle=None) -> tuple[list[RankOutcome], list]:
        """Wait for one call per rank. Once any rank fails, the rest get `drain_s` to finish
        (their collectives fail fast when a peer's sockets close: a `collective` call's failure
        wakes them with abort_world; a call that uses no collective leaves the world alone);
        ranks still silent then are counted as lost (`abort_port`: the rendezvous of a world still
        forming, whose store connections are shut down instead). With `hang_timeout_s`, ranks' heartbeats are polled meanwhile and a rank
        that makes no progress that long (airay.health.find_hung; `first_step`: longer deadlines of
        ranks in their world's first step) is killed as hung."""
        deadline = None
        watch = _HangWatch(len(refs), hang_timeout_s, first_step) if hang_timeout_s else None
        if broken:
            # `broken`: the calls' world already failed (settle). Wake them now; this failure was
            # detected and its hangs described by the gather that saw it: those stay as they are.
            deadline, watch = time.time() + self.drain_s, None
            for rank, ref in enumerate(refs):
                if ref is not None:
                    self.active[rank].actor.abort_world.remote(abort_port)
        else:
            self.hangs = []

        def hung(running: set[int]) -> dict[int, RankOutcome]:
            found = {}
            for rank in watch.poll([self.active[r].actor for r in range(len(refs))], running):
                self.hangs.append(watch.describe(rank))
                found[rank] = RankOutcome(rank, "hung", error=self.hangs[-1]["reason"])
                # A hung process cannot be asked to stop; SIGKILL through Ray is the only way.
                ray.kill(self.active[rank].actor, no_restart=True)
            return found

        def failed(running: list[int]) -> None:
            self.first_failure_ts = time.time()
            # The world is broken: wake every rank still inside a collective.
            for rank in running if collective else ():
                self.active[rank].actor.abort_world.remote(abort_port)

        return gather_calls(refs, ray.wait, _outcome_of, self.drain_s, poll_s=watch.poll_s if watch else 1.0,
                            hung=hung if watch else None, failed=failed, deadline=deadline, idle=idle)

    def export(self, step_dir: str, out_dir: str, factory: str, model_kwargs: dict, seed: int,
               timeout_s: float) -> str:
        """Write a checkpoint step as a Hugging Face model folder (airay.export.export_step) in a
        task on rank 0's node: the driver's node does no heavy work."""
        from airay.export import export_step

        opts: dict[str, Any] = {"num_cpus": 0, "max_retries": 0}
        node = self.active[0].node_id if self.active else None
        if node:
            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        return str(ray.get(ray.remote(export_step).options(**opts).remote(step_dir, out_dir, factory, model_kwargs, seed),
                           timeout=timeout_s))

    # ---- losing and replacing workers -------------------------------------------------------

    def member(self, rank: int) -> Member:
        return self.active[rank]

    def drop(self, ranks: list[int]) -> None:
        """Remove lost ranks from the world, kill what is left of them, start replacements in
        their bundles (not on excluded nodes: their capacity is found elsewhere by `reserve`)."""
        lost = set(ranks)
        gone, self.active = [self.active[r] for r in ranks], [m for r, m in enumerate(self.active) if r not in lost]
        for m in gone:
            ray.kill(m.actor, no_restart=True)
            if m.node_id not in self.excluded:
                self._start(m.pg, m.bundle_index)

    def exclude(self, node_id: str) -> list[int]:
        """Keep `node_id` out of placement from now on: idle workers there are killed and not
        replaced; returns the ranks of active workers there, for the caller to drop. Its placement
        groups are released once no worker holds them (release_vacant_groups); Ray cannot release
        one bundle of a group that spans other nodes too."""
        self.excluded.add(node_id)
        if self.demanded:
            self.demand(self.demanded)  # the request now asks for room off this node
        for pool in (self.standby, self.pending):
            for m in [m for m in pool if m.node_id == node_id or _bundle_node(m) == node_id]:
                pool.remove(m)
                ray.kill(m.actor, no_restart=True)
        return [r for r, m in enumerate(self.active) if m.node_id == node_id]

    def room_without(self, nodes: set[str]) -> int:
        """How many workers the cluster's alive nodes could hold (their total resources, not what
        is free now) without `nodes` and the excluded ones."""
        gone = self.excluded | set(nodes)
        totals = [n["Resources"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in gone]
        return placement.bundles_that_fit(totals, self.per_worker)

    def release_vacant_groups(self) -> list[str]:
        """Remove the placement groups no worker of this run holds a bundle of any more (an
        excluded node's, whose workers are not replaced there), so their resources go back to
        the cluster now, not when the run ends; returns their ids (short). A group with bundles
        on other nodes too keeps the excluded node's bundle until those are vacant as well."""
        used = {id(m.pg) for m in self.active + self.standby + self.pending}
        released = []
        for pg in [pg for pg in self.pgs if id(pg) not in used]:
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already gone with its node
                print(f"[airay] could not remove placement group {pg.id.hex()[:8]}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
            self.pgs.remove(pg)
            released.append(pg.id.hex()[:8])
        return released

    def release_idle(self) -> list[str]:
        """Kill the workers standing by or starting and give back their placement groups (a
        planned shrink: the scheduler gave the capacity to another job); returns the groups."""
        for m in self.standby + self.pending:
            ray.kill(m.actor, no_restart=True)
        self.standby, self.pending = [], []
        return self.release_vacant_groups()

    def releasable(self, n: int) -> list[int]:
        """Ranks whose placement groups, given back whole, free `n` workers: groups of active
        ranks only, the highest ranks first (rank 0 hosts the rendezvous); fewer than `n` when
        no set of whole groups makes exactly `n`."""
        return ranks_to_release([id(m.pg) for m in self.active], n)

    def release(self, ranks: list[int]) -> list[str]:
        """Take `ranks` out of the world without replacing them, kill them and give back the
        placement groups they leave vacant; returns those groups."""
        gone = set(ranks)
        for r in ranks:
            ray.kill(self.active[r].actor, no_restart=True)
        self.active = [m for r, m in enumerate(self.active) if r not in gone]
        return self.release_vacant_groups()

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
                print(f"[airay] could not withdraw the autoscaler request: {exc}", file=sys.stderr)
        actors = [m.actor for m in self.active + self.pending + self.standby] + list(self.stores.values()) \
            + list(self._store_starts.values())
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # e.g. its node is gone with it
                print(f"[airay] could not kill an actor at shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)
        self.active, self.pending, self.standby, self.stores, self._store_starts = [], [], [], {}, {}
        for pg in self.pgs:
            try:
                remove_placement_group(pg)
            except Exception as exc:
                print(f"[airay] could not remove placement group {pg.id.hex()[:8]}: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
        pg_ids = {pg.id.hex() for pg in self.pgs}
        self.pgs = []
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            table = ray.util.placement_group_table()
            if all(table.get(i, {}).get("state", "REMOVED") == "REMOVED" for i in pg_ids):
                break
            time.sleep(0.1)


def ranks_to_release(groups: list, n: int) -> list[int]:
    """Ranks (sorted) whose groups (`groups[rank]`: the rank's placement group) make exactly `n`
    workers, taking whole groups, those of the highest ranks first; [] when none do."""
    members: dict = {}
    for rank, g in enumerate(groups):
        members.setdefault(g, []).append(rank)
    chosen: list[int] = []
    for ranks in sorted(members.values(), key=max, reverse=True):
        if len(chosen) + len(ranks) <= n:
            chosen += ranks
        if len(chosen) == n:
            return sorted(chosen)
    return []


def gather_calls(refs: list, wait, outcome_of, drain_s: float, poll_s: float = 1.0, hung=None, failed=None,
                 deadline: float | None = None, clock=time.time, idle=None) -> tuple[list[RankOutcome], list]:
    """Wait for one call per rank (None: no call, that rank is ok): each rank's outcome and value.

    In batches: one wait blocks until some call is done (or the next hang poll, or the drain
    deadline), one more takes every call that is done by then, and the batch is handled at once:
    the ranks of a round leave their last collective together, so a round of any world size is a
    few waits, not one per rank (each wait is O(calls left)). `hung(running ranks) -> {rank:
    outcome}` is polled at most once per `poll_s` until a failure; `failed(running ranks)` is
    told once, at the first failure (a rank not ok, hung included), and the rest then get
    `drain_s` (by `deadline`, when given, from the start) before they are counted silent.
    `idle()` is called after each wait while calls are still running and none has failed (so
    about every `poll_s`): the caller's work that need not hold the ranks (a save's commit).
    `wait` has ray.wait's signature, `outcome_of(rank, ref)` gives a done call's (outcome,
    value), `clock` is time.time: unit tests pass their own (tests/test_gather.py)."""
    by_ref = {ref: rank for rank, ref in enumerate(refs) if ref is not None}
    outcomes: dict[int, RankOutcome] = {r: RankOutcome(r, "ok") for r, ref in enumerate(refs) if ref is None}
    values: list = [None] * len(refs)
    next_poll = clock() + poll_s
    while by_ref:
        now = clock()
        if deadline is not None:
            timeout = max(0.0, deadline - now)
        else:
            timeout = max(0.0, next_poll - now) if hung is not None else poll_s
        pending = list(by_ref)
        ready, _ = wait(pending, num_returns=1, timeout=timeout)
        if ready and len(pending) > 1:
            ready, _ = wait(pending, num_returns=len(pending), timeout=0)
        failure = False
        for ref in ready:
            rank = by_ref.pop(ref)
            outcomes[rank], values[rank] = outcome_of(rank, ref)
            failure = failure or outcomes[rank].kind != "ok"
        if hung is not None and deadline is None and by_ref and clock() >= next_poll:
            next_poll = clock() + poll_s
            for rank, outcome in hung(set(by_ref.values())).items():
                by_ref.pop(refs[rank])
                outcomes[rank] = outcome
                failure = True
        if idle is not None and by_ref and not failure and deadline is None:
            idle()
        if deadline is None and failure:
            if failed is not None:
                failed(sorted(by_ref.values()))
            deadline = clock() + drain_s
        if deadline is not None and clock() >= deadline:
            break
    for ref, rank in by_ref.items():
        outcomes[rank] = RankOutcome(rank, "silent", error=f"no answer {drain_s:.0f}s after a peer failed")
    return [outcomes[r] for r in range(len(refs))], values


def _outcome_of(rank: int, ref) -> tuple[RankOutcome, Any]:
    """A done call's outcome, and its value when it succeeded."""
    value = None
    try:
        value = ray.get(ref)
        outcome = RankOutcome(rank, "ok")
    except ray.exceptions.RayActorError as exc:
        outcome = actor_died(rank, type(exc).__name__, str(exc))
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        # str(MemoryError()) is empty: name the exception too, except the worker's named ones
        # (airay.worker.failures), which say their rank, name and traceback.
        error = str(cause) if isinstance(cause, RankError) \
            else f"{type(cause or exc).__name__}: {cause or exc}"
        outcome = RankOutcome(rank, "errored", error=error,
                              user_error=isinstance(cause, UserCodeError),
                              cause=type(cause).__name__ if cause is not None else "",
                              step=getattr(cause, "step", None))
    except ray.exceptions.RayError as exc:  # e.g. an object the call needed was lost
        outcome = RankOutcome(rank, "errored", error=str(exc).splitlines()[0],
                              cause=type(exc).__name__)
    return outcome, value


def world_members(active: list, standby: list, world_size: int, mp: int = 1) -> tuple[list, list]:
    """(the new world's members in rank order, those left standing by): survivors keep their
    order, standby workers join after, grouped by node (co-located ranks are neighbours, the
    order ring collectives favour, and a node's ranks are predictable for chaos at named ranks).
    An allowed size below the survivors idles whole nodes' ranks (policy.ranks_to_idle). With
    model-parallel groups of `mp`: whole groups, survivors' whole groups first
    (airay.parallel.layout.form_teams); a member of a broken group stands by."""
    standby = sorted(standby, key=lambda m: (m.node_id or "", m.bundle_index))
    if mp > 1:
        pool = list(active) + standby
        teams = _teams(pool, mp)[:world_size // mp]
        chosen = {i for t in teams for i in t}
        return [pool[i] for t in teams for i in t], [m for i, m in enumerate(pool) if i not in chosen]
    joining = standby[:max(0, world_size - len(active))]
    active, standby = list(active) + joining, standby[len(joining):]
    if len(active) > world_size:
        idle = set(policy.ranks_to_idle([m.node_id for m in active], world_size))
        standby += [m for r, m in enumerate(active) if r in idle]
        active = [m for r, m in enumerate(active) if r not in idle]
    return active, standby


def _teams(members: list, mp: int) -> list[list[int]]:
    from airay.parallel.layout import form_teams

    return form_teams([m.node_id for m in members], [m.team for m in members], mp)


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
    """Polls every running rank's heartbeat and remembers when its progress last changed.
    `first_step`: {rank: its deadline while it has completed no step in its world}."""

    def __init__(self, world: int, hang_timeout_s: float, first_step: dict[int, float] | None = None):
        now = time.time()
        self.timeout = hang_timeout_s
        self.first_step = first_step or {}
        self.poll_s = min(1.0, hang_timeout_s / 4)
        self.progress: dict[int, dict] = {r: {} for r in range(world)}
        self.last_change = {r: now for r in range(world)}
        self.last_answer = {r: now for r in range(world)}
        self.inflight: dict[int, Any] = {}

    def deadline(self, rank: int) -> float:
        return deadline(self.progress[rank], self.timeout, self.first_step.get(rank))

    def poll(self, actors: list, running: set[int]) -> list[int]:
        """Collect answered heartbeats, ask again, return the ranks to declare hung."""
        now = time.time()
        if self.inflight:
            ready = set(ray.wait(list(self.inflight.values()), num_returns=len(self.inflight), timeout=0)[0])
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
        groups = all("groups" in self.progress[r] for r in running)  # torch's counters, where all report them
        return find_hung({r: position(self.progress[r], groups) for r in running},
                         {r: self.last_change[r] for r in running}, {r: self.last_answer[r] for r in running},
                         now, {r: self.deadline(r) for r in running}, self.poll_s)

    def describe(self, rank: int) -> dict[str, Any]:
        now = time.time()
        p = self.progress[rank]
        answering = now - self.last_answer[rank] < self.deadline(rank)
        where = f"step {p.get('step')} micro-batch {p.get('micro')} phase {p.get('phase')}" if p else "its first step"
        if p.get("collectives"):
            entered, left = p["collectives"]
            where += f", {f'inside collective call {entered}' if entered > left else f'before collective call {entered + 1}'}" \
                     " of the phase"
        return {"rank": rank, "stalled_s": now - self.last_change[rank], "heartbeat": answering, "progress": p,
                "deadline_s": self.deadline(rank),
                "reason": f"no progress for {now - self.last_change[rank]:.1f}s at {where}; heartbeat "
                          f"{'answering (blocked in the training thread)' if answering else 'not answering (process stopped)'}"}

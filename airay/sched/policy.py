"""Which jobs run on a shared cluster, and at which size: the scheduler's decision, a pure function.

`decide(cluster, jobs, alloc, quotas, policy)` takes a snapshot (every queued and running job, the
workers each holds now, the teams' guaranteed GPUs) and returns a `Decision`: each job's target
size (0: not running), which jobs are admitted, shrunk, grown or preempted, and a reason per job
(`airay queue` and `airay status` print it). It keeps no state: the scheduler actor persists the
queue and carries the decision out (a running job's driver takes a lowered target as a planned
shrink at its next step boundary, a raised one as a grow).

Vocabulary (Kueue's, see STYLE.md): a worker is one GPU (one bundle); a job's sizes are the
multiples of its `world_size_multiple` in [min_workers, max_workers] (a rigid job, `elastic`
False, has one size: its largest). GPUs are counted as one pool: packing bundles onto nodes is the
placement group's work (a job of whole nodes, multiple = gpus_per_node, packs exactly).

Order. Jobs are served by priority (higher first), then submit time, then id: priority FIFO. A
job that cannot be admitted does not block lower ones that fit (Kueue's default BestEffortFIFO).

Who may take GPUs from whom. Priority first: a job may take GPUs from any job of lower priority,
whatever its team (shrink, then preempt). Among jobs of one priority, teams' guaranteed GPUs
(`quotas`, together at most the cluster) decide: a team may use more than its guarantee (it
borrows idle quota and the unguaranteed GPUs), and a job of another team takes from it only what
it holds above its guarantee; a team below its guarantee takes back what jobs of its priority in
other teams borrowed (a reclaim). So a team's guaranteed GPUs are never taken by a job of another
team of lower or equal priority. Victims are taken lowest priority first, most recently submitted
first. A whole job of another team is preempted at equal priority only in a reclaim and only when
all its GPUs are borrowed: its team stays at its guarantee, else it would reclaim them back at once.

Policies:

- `evict` (Kueue-like, the baseline): a job is admitted at the largest size that fits in the free
  GPUs (partial admission), at least its min; if its min does not fit, whole lower-priority jobs
  are evicted, lowest first, until it does; they requeue and restart from their last checkpoint.
  A running job's size never changes.
- `shrink` (shrink instead of evict): a job is admitted at its min. To make room, elastic jobs
  are first shrunk, never below their min: lower-priority ones, lowest first, then the GPUs that
  jobs of its own priority hold above their min; only when shrinking cannot make room is a whole
  lower-priority job preempted (checkpointed first, then requeued). Then, highest priority first,
  running jobs grow toward their max: from free GPUs, then from what lower-priority jobs hold above
  their min. Borrowed GPUs are given back by the same shrink when their owner reclaims them.
- `goodput`: `shrink`, except that a grow must pay for its resize. A resize idles the job's new
  world for `resize_s` (airay's measured warm recovery by default), and each job shrunk to feed it
  for as long. Growing from w to w' GPUs is made only when, over the horizon H = min(horizon_s,
  remaining_gpu_s / w) (until the job would end at its current size, or until its GPUs are
  expected to be wanted back), the grown job does more work than it would have, by more than the
  donors lose to their own resizes: w' (H - resize_s) - w H > resize_s x (the donors' new sizes),
  that is (w' - w) H > resize_s (w' + the donors' new sizes). With no horizon this is exactly "the
  grow finishes the job sooner". A start is no resize; a world already resized in this decision
  pays only for its added GPUs, a donor already resized nothing. Where the job's remaining work is unknown
  the horizon alone counts. `horizon_s` is a setting, not a measurement. Admissions are never
  refused for cost: priority decides those.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from airay.simulate import MEASURED_WARM_RECOVERY_S

POLICIES = ("evict", "shrink", "goodput")


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int = 8

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Job:
    id: str
    team: str = "default"
    priority: int = 0  # higher runs first
    min_workers: int = 1
    max_workers: int = 1
    world_size_multiple: int = 1
    submit_s: float = 0.0
    elastic: bool = True  # False: the job runs at its largest size or not at all
    remaining_gpu_s: float | None = None  # the job's own estimate of the work left (goodput's horizon)

    @property
    def largest(self) -> int:
        m = self.world_size_multiple
        return self.max_workers // m * m

    @property
    def smallest(self) -> int:
        m = self.world_size_multiple
        return -(-self.min_workers // m) * m if self.elastic else self.largest

    def check(self) -> None:
        if self.min_workers < 1 or self.world_size_multiple < 1:
            raise ValueError(f"job {self.id}: min_workers and world_size_multiple must be >= 1")
        if self.smallest > self.largest or self.largest < 1:
            raise ValueError(f"job {self.id}: no multiple of world_size_multiple ({self.world_size_multiple}) lies "
                             f"in min_workers..max_workers ({self.min_workers}..{self.max_workers})")


@dataclass(frozen=True)
class Policy:
    name: str = "shrink"
    resize_s: float = MEASURED_WARM_RECOVERY_S  # goodput: a resize idles the job's new world this long
    horizon_s: float = 3600.0  # goodput: how long a grow is expected to last (a choice, not a measurement)

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.name!r}")


@dataclass(frozen=True)
class Decision:
    targets: dict[str, int]  # every job's size after this decision; 0: not running
    admitted: tuple[str, ...] = ()
    grown: tuple[str, ...] = ()
    shrunk: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()
    reasons: dict[str, str] = field(default_factory=dict)


def decide(cluster: Cluster, jobs: Iterable[Job], alloc: Mapping[str, int] | None = None,
           quotas: Mapping[str, int] | None = None, policy: Policy | str = "shrink",
           explain: bool = True) -> Decision:
    """Every job's target size from a snapshot. `alloc`: the workers each job holds now (absent or
    0: queued); `quotas`: team -> guaranteed GPUs. `explain` False leaves out the reasons of jobs
    that wait (the simulator's fast path)."""
    pol = Policy(policy) if isinstance(policy, str) else policy
    return _Decider(cluster, list(jobs), dict(alloc or {}), dict(quotas or {}), pol, explain).run()


class _Decider:
    def __init__(self, cluster: Cluster, jobs: list[Job], alloc: dict[str, int], quotas: dict[str, int],
                 policy: Policy, explain: bool):
        self.jobs = {}
        for j in jobs:
            if j.id in self.jobs:
                raise ValueError(f"job id {j.id!r} appears twice")
            j.check()
            self.jobs[j.id] = j
        unknown = sorted(set(alloc) - set(self.jobs))
        if unknown:
            raise ValueError(f"allocations of unknown jobs: {unknown}")
        if sum(quotas.values()) > cluster.gpus or any(q < 0 for q in quotas.values()):
            raise ValueError(f"guaranteed quotas add up to {sum(quotas.values())} GPUs; each must be >= 0 and "
                             f"together at most the cluster's {cluster.gpus}")
        self.capacity, self.quotas, self.policy, self.explain = cluster.gpus, quotas, policy, explain
        self.alloc = {j: alloc.get(j, 0) for j in self.jobs}
        self.target = dict(self.alloc)
        self.usage: Counter[str] = Counter()
        self.held: Counter[tuple[int, str]] = Counter()  # GPUs by (priority, team)
        for j in self.jobs.values():
            self.usage[j.team] += self.target[j.id]
            self.held[j.priority, j.team] += self.target[j.id]
        self.free = self.capacity - sum(self.target.values())
        self.order = sorted(self.jobs.values(), key=lambda j: (-j.priority, j.submit_s, j.id))
        # Victims: lowest priority first, newest first, then id (descending) for a total order.
        by_id = sorted(self.jobs.values(), key=lambda j: j.id, reverse=True)
        self.lowest = sorted(by_id, key=lambda j: (j.priority, -j.submit_s))
        self._running: list[Job] | None = None  # running jobs in victim order (self.running())
        self.cause: dict[str, str] = {}  # victim -> what took its GPUs
        self.stopped: set[str] = set()  # running jobs preempted (some readmitted later in the same decision)
        self.reasons: dict[str, str] = {}

    # --- bookkeeping --------------------------------------------------------------------------------
    def _set(self, job: Job, size: int) -> None:
        delta = size - self.target[job.id]
        if (size == 0) != (self.target[job.id] == 0):
            self._running = None
        self.target[job.id] = size
        self.usage[job.team] += delta
        self.held[job.priority, job.team] += delta
        self.free -= delta

    def running(self) -> list[Job]:
        """The jobs holding GPUs now, lowest priority first, newest first."""
        if self._running is None:
            self._running = [j for j in self.lowest if self.target[j.id] > 0]
        return self._running

    def _borrowed(self, team: str) -> int:
        return self.usage[team] - self.quotas.get(team, 0)

    # --- taking GPUs from running jobs ---------------------------------------------------------------
    def _plan(self, claimant: Job | None, short: int, shrink: bool, top: int) -> dict[str, int] | None:
        """New sizes of victims that free at least `short` GPUs for `claimant`: shrinks alone when
        they suffice, else the fewest lowest-first evictions after which shrinks do (evictions the
        rest made needless are spared, the last taken first, as Kueue does); None if nothing does.
        Shrinks take from jobs of priority <= `top`; evictions from lower priority than the claimant."""
        if claimant is not None and self._reachable(claimant, top) < short:
            return None  # most of a long queue: decided without looking at every job
        budget = _Budget(self, claimant, top)
        victims = budget.victims()
        if shrink:
            taken, plan = self._shrinks(victims, self.target, budget.copy(), short)
            if taken >= short:
                return plan
        # Upper bounds (quota limits left out) spare the exact search where it cannot succeed.
        spare = {v.id: self.target[v.id] - v.smallest if shrink and self.target[v.id] > v.smallest else 0
                 for v in victims}
        upper, freed = sum(spare.values()), 0
        gone: list[Job] = []
        trial = budget.copy()
        for v in victims:
            if trial.evictable(v, self.target[v.id]):
                gone.append(v)
                trial.take(v, self.target[v.id], evicting=True)
                freed += self.target[v.id]
                upper -= spare[v.id]
                if freed + upper >= short and self._evicting(victims, gone, budget, short, shrink)[0] >= short:
                    break
        else:
            return None
        for v in reversed(gone[:-1]):
            fewer = [g for g in gone if g is not v]
            if self._evicting(victims, fewer, budget, short, shrink)[0] >= short:
                gone = fewer
        return {**{g.id: 0 for g in gone}, **self._evicting(victims, gone, budget, short, shrink)[1]}

    def _reachable(self, claimant: Job, top: int) -> int:
        """At most the GPUs `claimant` could take (its mins and quota limits left out)."""
        room = self.quotas.get(claimant.team, 0) - self.usage[claimant.team]
        total = 0
        for (prio, team), held in self.held.items():
            if held <= 0 or prio > claimant.priority:
                continue
            if prio < claimant.priority or team == claimant.team:
                total += held if prio < claimant.priority or prio <= top else 0
            elif self._borrowed(team) > 0 and (prio <= top or room > 0):
                total += min(held, self._borrowed(team))
        return total

    def _evicting(self, victims: list[Job], gone: list[Job], budget: _Budget, short: int,
                  shrink: bool) -> tuple[int, dict[str, int]]:
        """GPUs freed by evicting `gone`, then shrinking the rest (if `shrink`) up to `short`; and those shrinks."""
        b = budget.copy()
        freed = 0
        for g in gone:
            freed += self.target[g.id]
            b.take(g, self.target[g.id], evicting=True)
        if freed >= short or not shrink:
            return freed, {}
        sizes = {**self.target, **{g.id: 0 for g in gone}}
        taken, plan = self._shrinks(victims, sizes, b, short - freed)
        return freed + taken, plan

    @staticmethod
    def _shrinks(victims: list[Job], sizes: Mapping[str, int], budget: _Budget,
                 need: int) -> tuple[int, dict[str, int]]:
        """Shrink victims in order, never below their min, until `need` GPUs are freed or none is
        left: (GPUs freed, new sizes). Takes from `budget`."""
        taken, out = 0, {}
        for v in victims:
            if taken >= need:
                break
            size = sizes[v.id]
            if size <= v.smallest:
                continue
            m = v.world_size_multiple
            can = size - v.smallest
            lim = budget.limit(v)
            if lim is not None:
                can = min(can, lim) // m * m
            take = min(can, -(-(need - taken) // m) * m)
            if take <= 0:
                continue
            out[v.id] = size - take
            taken += take
            budget.take(v, take)
        return taken, out

    def _take_up_to(self, claimant: Job, need: int) -> tuple[int, dict[str, int]]:
        """As many GPUs as shrinking strictly lower-priority jobs (and borrowers, in a reclaim) gives
        `claimant`, at most about `need`: (freed, new sizes)."""
        budget = _Budget(self, claimant, claimant.priority - 1)
        return self._shrinks(budget.victims(), self.target, budget, need)

    def _apply(self, plan: dict[str, int], by: str) -> None:
        for vid, size in plan.items():
            self._set(self.jobs[vid], size)
            self.cause[vid] = by
            if size == 0 and self.alloc[vid] > 0:
                self.stopped.add(vid)

    # --- the decision --------------------------------------------------------------------------------
    def run(self) -> Decision:
        shrink = self.policy.name != "evict"
        if self.free < 0:  # the cluster lost capacity under the allocations
            plan = self._plan(None, -self.free, shrink, top=0) or {}
            self._apply(plan, "the cluster lost capacity")
        for job in self.order:
            if self.target[job.id] == 0:
                self._admit(job, shrink)
        if shrink:
            for job in self.order:
                if 0 < self.target[job.id] < job.largest:
                    self._grow(job)
        return self._decision()

    def _admit(self, job: Job, shrink: bool) -> None:
        need = job.smallest
        if need > self.capacity:
            self.reasons[job.id] = f"waiting: needs {need} GPUs, more than the cluster's {self.capacity}"
            return
        # An admission shrinks jobs of its own priority too (their GPUs above their min), evicts only lower ones.
        top = job.priority if shrink else job.priority - 1
        plan = {} if need <= self.free else self._plan(job, need - self.free, shrink, top)
        if plan is None:
            if self.explain:
                self.reasons[job.id] = self._waiting(job, need)
            return
        self._apply(plan, f"{job.id} (priority {job.priority})")
        m = job.world_size_multiple
        size = need if shrink else min(job.largest, self.free // m * m)
        self._set(job, size)

    def _grow(self, job: Job) -> None:
        now, m = self.target[job.id], job.world_size_multiple
        want = job.largest - now
        taken, plan = self._take_up_to(job, want - self.free) if want > self.free else (0, {})
        new = (now + min(want, self.free + taken)) // m * m
        if new <= now:
            return
        if new - now < self.free + taken and plan:  # rounded down: take only what the new size needs
            plan = self._take_up_to(job, new - now - self.free)[1] if new - now > self.free else {}
        if self.policy.name == "goodput":
            options = [(new, plan)]
            from_free = (now + self.free) // m * m
            if plan and from_free > now:
                options.append((from_free, {}))
            values = [self._grow_value(job, now, size, p) for size, p in options]
            worth = [i for i, (gain, cost) in enumerate(values) if gain > cost]
            if not worth:
                gain, cost = values[0]
                self.reasons[job.id] = (f"running at {now} of {job.largest}: growing to {new} would gain "
                                        f"{gain:.0f} GPU-s within the horizon and idle {cost:.0f} GPU-s in "
                                        "resizes; not worth it")
                return
            new, plan = options[worth[0]]
        self._apply(plan, f"{job.id} (priority {job.priority})")
        self._set(job, new)

    def _grow_value(self, job: Job, now: int, new: int, plan: dict[str, int]) -> tuple[float, float]:
        """The work the grow adds within the horizon, and the work the resizes lose (GPU-seconds)."""
        r = self.policy.resize_s
        horizon = self.policy.horizon_s
        if job.remaining_gpu_s is not None:
            horizon = min(horizon, job.remaining_gpu_s / now)
        gain = (new - now) * horizon
        was = self.alloc[job.id]
        cost = 0.0 if was == 0 else r * (new - now) if now != was else r * new  # a start is no resize
        for vid, size in plan.items():
            if self.target[vid] == self.alloc[vid]:  # not resized in this decision yet
                cost += r * size
        return gain, cost

    def _waiting(self, job: Job, need: int) -> str:
        held = Counter()
        for (prio, team), size in self.held.items():
            if size <= 0:
                continue
            if prio < job.priority:
                held["lower"] += size
            elif prio > job.priority:
                held["higher"] += size
            else:
                held["equal"] += size
                if team != job.team and self._borrowed(team) <= 0:
                    held["guaranteed"] += size
        parts = [f"waiting: needs {need} GPUs, {self.free} free"]
        if held["lower"]:
            parts.append(f"{held['lower']} held by lower-priority jobs")
        if held["equal"]:
            guaranteed = f", {held['guaranteed']} of them within other teams' guarantees" if held["guaranteed"] else ""
            parts.append(f"{held['equal']} by jobs of its priority (only what they hold above their min can be "
                         f"taken{guaranteed})")
        if held["higher"]:
            parts.append(f"{held['higher']} by higher-priority jobs")
        return "; ".join(parts)

    def _decision(self) -> Decision:
        admitted, grown, shrunk, preempted = [], [], [], []
        for job in self.order:
            a, t = self.alloc[job.id], self.target[job.id]
            if job.id in self.stopped:
                preempted.append(job.id)
                self.reasons[job.id] = f"preempted for {self.cause.get(job.id, '?')}; requeued"
                if t > 0:  # a restart from its checkpoint at the size that was left
                    admitted.append(job.id)
                    self.reasons[job.id] += f", readmitted at {t}"
            elif a == 0 and t > 0:
                admitted.append(job.id)
            elif t > a:
                grown.append(job.id)
            elif t < a:
                shrunk.append(job.id)
                self.reasons[job.id] = f"running at {t} of {job.largest}: shrunk for {self.cause.get(job.id, '?')}"
            if t > 0 and job.id not in self.reasons:
                self.reasons[job.id] = self._size_reason(job, t)
        return Decision(self.target, tuple(admitted), tuple(grown), tuple(shrunk), tuple(preempted), self.reasons)

    def _size_reason(self, job: Job, size: int) -> str:
        if size >= job.largest:
            return f"running at {size} (its max)"
        if self.policy.name == "evict":
            return f"running at {size} of {job.largest}: sizes are fixed at admission (evict policy)"
        return f"running at {size} of {job.largest}: no free GPUs, the rest held by jobs it may not shrink"


class _Budget:
    """What a claimant may still take as it takes victims. Priority first: from any job of lower
    priority, whatever its team. At its own priority (`top` = its priority: an admission's shrinks),
    the surplus above their min of its own team's jobs and, of another team's, only the GPUs that
    team holds above its guarantee. A team below its guarantee takes back (shrink, then whole jobs)
    what jobs of its priority in other teams borrowed, up to the GPUs it lacks: a reclaim. Never from
    a job of higher priority. No claimant: the cluster shrank, every job is a victim."""

    def __init__(self, d: _Decider, claimant: Job | None, top: int):
        self.d, self.claimant, self.top = d, claimant, top
        self.borrowed = Counter({t: d._borrowed(t) for t in d.usage})
        self.room = d.quotas.get(claimant.team, 0) - d.usage[claimant.team] if claimant is not None else 0
        self.reclaim = self.room > 0

    def copy(self) -> _Budget:
        b = object.__new__(_Budget)
        b.d, b.claimant, b.top, b.reclaim, b.room = self.d, self.claimant, self.top, self.reclaim, self.room
        b.borrowed = Counter(self.borrowed)
        return b

    def victims(self) -> list[Job]:
        """Running jobs the claimant may take from, in the order it takes them: lowest priority first."""
        c = self.claimant
        out = []
        for v in self.d.running():
            if c is not None and v.priority > c.priority:
                break
            if v is c:
                continue
            if c is None or v.priority < c.priority:
                out.append(v)
            elif v.priority == c.priority:
                if v.team == c.team:
                    if v.priority <= self.top:
                        out.append(v)
                elif self.borrowed[v.team] > 0 and (v.priority <= self.top or self.reclaim):
                    out.append(v)
        return out

    def _quota_bound(self, v: Job) -> bool:
        c = self.claimant
        return c is not None and v.team != c.team and v.priority >= c.priority

    def limit(self, v: Job) -> int | None:
        """GPUs the claimant may still shrink from `v`'s team (None: no limit)."""
        if not self._quota_bound(v):
            return None
        return self.borrowed[v.team] if v.priority <= self.top else min(self.borrowed[v.team], self.room)

    def evictable(self, v: Job, size: int) -> bool:
        c = self.claimant
        if c is None or v.priority < c.priority:
            return True
        # At its own priority only a reclaim evicts, and only a job all of whose GPUs its team
        # borrowed: a team left below its guarantee would take them back at once (a cycle).
        return (v.team != c.team and v.priority == c.priority and self.reclaim and self.room > 0
                and 0 < size <= self.borrowed[v.team])

    def take(self, v: Job, n: int, evicting: bool = False) -> None:
        if not self._quota_bound(v):
            return
        self.borrowed[v.team] -= n
        if evicting or v.priority > self.top:
            self.room -= n

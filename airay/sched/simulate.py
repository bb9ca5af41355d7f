"""The scheduler's policies on a fleet, simulated over a job trace: completion times, waits, lost GPU-hours.

An event-driven model (like airay.simulate's for goodput): jobs arrive as the trace says, the
policy (airay.sched.policy.decide, the function the scheduler actor calls) re-decides every
job's size at each arrival and completion, and the simulator carries the decision out:

- A job's work is gpus x duration_s GPU-seconds (the trace's size and run time); at w workers it
  progresses at gpus x (w / gpus)^scaling GPU-seconds per second: linear in w by default
  (scaling 1), as airay.simulate assumes (the global batch is fixed; fewer GPUs take longer per
  step); scaling < 1 makes a large world less efficient than several small ones.
- A resize (shrink or grow of a running job) idles its new world for `resize_s` (default airay's
  measured warm recovery, airay/measured.json): a planned shrink keeps the survivors warm and
  replays no step.
- A preempted job loses the work since its last periodic checkpoint (one every
  `checkpoint_interval_s` of its training time) under the evict policy (Kueue evicts without
  asking for a checkpoint), and none under shrink and goodput (airay's scheduler checkpoints
  before it preempts). When readmitted it restarts cold: `cold_restart_s` (airay's measured cold
  start) idles its world first. A job's first start costs the same under every policy and is not
  modelled.

Reported per policy: mean and p99 job completion time (submit to finish), the highest-priority
jobs' mean and p99 wait (submit to first running), GPU utilisation (GPU-seconds of training, resizes
and restarts left out, / the fleet's, from the first submission to the last), lost GPU-hours (work rolled back by
preemptions + GPU time idled by resizes and restarts), and counts of resizes and preemptions.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

import numpy as np

from airay.sched.policy import POLICIES, Cluster, Job, Policy, decide
from airay.sched.trace import TraceJob, generate
from airay.sched.trace import quotas as team_quotas
from airay.simulate import MEASURED_COLD_RESTART_S, MEASURED_WARM_RECOVERY_S


@dataclass(frozen=True)
class Settings:
    gpus: int = 1024
    gpus_per_node: int = 8
    resize_s: float = MEASURED_WARM_RECOVERY_S
    cold_restart_s: float = MEASURED_COLD_RESTART_S
    checkpoint_interval_s: float = 1800.0  # training time between periodic checkpoints (a choice)
    horizon_s: float = 3600.0  # the goodput policy's expected life of a grow (a choice)
    scaling: float = 1.0

    def cluster(self) -> Cluster:
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})")
        return Cluster(self.gpus // self.gpus_per_node, self.gpus_per_node)


@dataclass
class QueueResult:
    policy: str
    gpus: int
    jobs: int
    mean_jct_s: float
    p99_jct_s: float
    high_priority: int  # the priority whose waits are reported (the trace's highest)
    high_jobs: int
    high_wait_mean_s: float
    high_wait_p99_s: float
    wait_mean_s: float  # every job's
    utilisation: float
    lost_gpu_h: float
    lost_work_gpu_h: float  # rolled back by preemptions
    lost_idle_gpu_h: float  # idled by resizes and cold restarts
    resizes: int
    preemptions: int
    makespan_s: float
    resize_s: float

    def as_dict(self) -> dict:
        return asdict(self)


class _Run:
    """One job's state in the simulation."""

    __slots__ = ("spec", "work", "size", "progress", "last", "paused_until", "clock", "since_clock",
                 "since_work", "since_gpu_s", "version", "started", "restart", "finished")

    def __init__(self, spec: TraceJob):
        self.spec = spec
        self.work = spec.work_gpu_s
        self.size = 0
        self.progress = 0.0  # GPU-seconds of work done (kept: what a restart resumes from, and after)
        self.last = spec.submit_s
        self.paused_until = 0.0
        self.clock = 0.0  # training seconds so far: checkpoints fall at its multiples of the interval
        self.since_clock = self.since_work = self.since_gpu_s = 0.0  # since the last checkpoint
        self.version = 0
        self.started: float | None = None
        self.restart = False
        self.finished: float | None = None


class _QueueSim:
    def __init__(self, jobs: list[TraceJob], settings: Settings, policy: str, quotas: dict[str, int] | None):
        self.s = settings
        self.cluster = settings.cluster()
        self.policy = Policy(policy, resize_s=settings.resize_s, horizon_s=settings.horizon_s)
        self.quotas = dict(quotas or {})
        too_big = [j.job_id for j in jobs if -(-j.min_size // j.multiple) * j.multiple > settings.gpus]
        if too_big:
            raise ValueError(f"jobs larger than the fleet's {settings.gpus} GPUs even at min_gpus: {too_big[:5]}")
        self.runs = {j.job_id: _Run(j) for j in jobs}
        self.window = (min(j.submit_s for j in jobs), max(j.submit_s for j in jobs))
        self.busy = self.lost_work = self.lost_idle = 0.0
        self.resizes = self.preemptions = 0
        self.events: list[tuple[float, int, str, int]] = []  # (time, 0 completion / 1 arrival, id, version)
        for j in jobs:
            heapq.heappush(self.events, (j.submit_s, 1, j.job_id, 0))
        self.active: dict[str, _Run] = {}

    def rate(self, r: _Run) -> float:
        g = r.spec.gpus
        return g * (r.size / g) ** self.s.scaling if self.s.scaling != 1.0 else float(r.size)

    def advance(self, r: _Run, t: float) -> None:
        a, r.last = r.last, t
        if r.size == 0 or t <= a:
            return
        start = max(a, r.paused_until)
        d = max(0.0, t - start)
        self.lost_idle += r.size * (t - a - d)
        if d == 0:
            return
        lo, hi = max(start, self.window[0]), min(t, self.window[1])
        if hi > lo:
            self.busy += r.size * (hi - lo)
        rate = self.rate(r)
        interval = self.s.checkpoint_interval_s
        crossed = int((r.clock + d) // interval) > int(r.clock // interval)
        r.clock += d
        r.progress += rate * d
        if crossed:  # a checkpoint inside this stretch: only what follows it is at risk
            tail = r.clock % interval
            r.since_clock, r.since_work, r.since_gpu_s = tail, rate * tail, r.size * tail
        else:
            r.since_clock += d
            r.since_work += rate * d
            r.since_gpu_s += r.size * d

    def schedule_completion(self, r: _Run, t: float) -> None:
        r.version += 1
        if r.size > 0:
            done = max(t, r.paused_until) + (r.work - r.progress) / self.rate(r)
            heapq.heappush(self.events, (done, 0, r.spec.job_id, r.version))

    def decide(self, t: float) -> None:
        jobs, alloc = [], {}
        for jid, r in self.active.items():
            sp = r.spec
            jobs.append(Job(jid, sp.team, sp.priority, sp.min_size, sp.gpus, sp.multiple, sp.submit_s,
                            sp.min_size < sp.gpus, max(0.0, r.work - r.progress)))
            if r.size:
                alloc[jid] = r.size
        d = decide(self.cluster, jobs, alloc, self.quotas, self.policy, explain=False)
        for jid in d.preempted:
            r = self.active[jid]
            self.preemptions += 1
            if self.policy.name == "evict":  # no checkpoint first: back to the last periodic one
                r.progress -= r.since_work
                r.clock -= r.since_clock
                self.lost_work += r.since_gpu_s
            r.since_clock = r.since_work = r.since_gpu_s = 0.0
            r.size, r.restart = 0, True
            self.schedule_completion(r, t)
        for jid, new in d.targets.items():
            r = self.active[jid]
            if new == r.size:
                continue
            if r.size == 0:  # a start, or a restart from its checkpoint
                if r.started is None:
                    r.started = t
                r.paused_until = t + (self.s.cold_restart_s if r.restart else 0.0)
                r.restart = False
            else:
                self.resizes += 1
                r.paused_until = max(r.paused_until, t) + self.s.resize_s
            r.size = new
            self.schedule_completion(r, t)

    def run(self) -> QueueResult:
        while self.events:
            t, changed = self.events[0][0], False
            while self.events and self.events[0][0] == t:
                _, kind, jid, version = heapq.heappop(self.events)
                r = self.runs[jid]
                if kind == 1:
                    self.active[jid] = r
                elif version == r.version and jid in self.active:
                    self.advance(r, t)
                    r.progress = r.work
                    r.size, r.finished = 0, t
                    del self.active[jid]
                else:
                    continue  # a completion a later decision moved
                changed = True
            if not changed:
                continue
            for r in self.active.values():
                self.advance(r, t)
            self.decide(t)
        unfinished = [j for j, r in self.runs.items() if r.finished is None]
        if unfinished:
            raise RuntimeError(f"simulation ended with jobs never finished: {unfinished[:5]}")
        return self.result()

    def result(self) -> QueueResult:
        runs = list(self.runs.values())
        jct = np.array([r.finished - r.spec.submit_s for r in runs])
        wait = np.array([r.started - r.spec.submit_s for r in runs])
        top = max(r.spec.priority for r in runs)
        high = np.array([r.started - r.spec.submit_s for r in runs if r.spec.priority == top])
        span = self.window[1] - self.window[0]
        return QueueResult(
            policy=self.policy.name, gpus=self.s.gpus, jobs=len(runs), mean_jct_s=float(jct.mean()),
            p99_jct_s=float(np.percentile(jct, 99)), high_priority=top, high_jobs=len(high),
            high_wait_mean_s=float(high.mean()), high_wait_p99_s=float(np.percentile(high, 99)),
            wait_mean_s=float(wait.mean()),
            utilisation=self.busy / (self.s.gpus * span) if span > 0 else float("nan"),
            lost_gpu_h=(self.lost_work + self.lost_idle) / 3600.0, lost_work_gpu_h=self.lost_work / 3600.0,
            lost_idle_gpu_h=self.lost_idle / 3600.0, resizes=self.resizes, preemptions=self.preemptions,
            makespan_s=max(r.finished for r in runs) - self.window[0], resize_s=self.s.resize_s)


def simulate_queue(jobs: list[TraceJob], settings: Settings = Settings(), policy: str = "shrink",
                   quotas: dict[str, int] | None = None) -> QueueResult:
    """One policy over one trace on one fleet; `quotas`: team -> guaranteed GPUs."""
    if not jobs:
        raise ValueError("the trace has no jobs")
    return _QueueSim(jobs, settings, policy, quotas).run()


def compare(gpu_counts: list[int], policies: tuple[str, ...] = POLICIES, trace: list[TraceJob] | None = None,
            jobs: int = 1200, seed: int = 0, load: float = 0.9, quotas: dict[str, int] | None = None,
            **settings) -> list[dict]:
    """Every policy on every fleet size: a given trace, or one generated per fleet (its arrival rate
    scaled to the fleet: airay.sched.trace.generate) with the generated teams' quotas."""
    rows = []
    for gpus in gpu_counts:
        run_jobs = trace if trace is not None else generate(jobs, gpus, seed, load)
        run_quotas = quotas if quotas is not None else ({} if trace is not None else team_quotas(gpus))
        for policy in policies:
            rows.append(simulate_queue(run_jobs, Settings(gpus=gpus, **settings), policy, run_quotas).as_dict())
    return rows


def table(rows: list[dict]) -> str:
    """The rows as a text table, each with its mean JCT against the evict policy's on the same fleet."""
    base = {(r["gpus"], r.get("seed")): r["mean_jct_s"] for r in rows if r["policy"] == "evict"}
    out = [f"{'gpus':>5} {'policy':>8} {'resize s':>8} {'mean JCT h':>10} {'p99 JCT h':>9} {'vs evict':>8} "
           f"{'hi wait m':>9} {'p99':>6} {'wait m':>7} {'util':>5} {'lost GPU-h':>10} {'preempt':>7} {'resizes':>7}"]
    for r in rows:
        b = base.get((r["gpus"], r.get("seed")))
        ratio = f"{r['mean_jct_s'] / b:.3f}" if b else "-"
        out.append(f"{r['gpus']:>5} {r['policy']:>8} {r['resize_s']:>8.3g} {r['mean_jct_s'] / 3600:>10.2f} "
                   f"{r['p99_jct_s'] / 3600:>9.1f} {ratio:>8} {r['high_wait_mean_s'] / 60:>9.1f} "
                   f"{r['high_wait_p99_s'] / 60:>6.1f} {r['wait_mean_s'] / 60:>7.1f} {r['utilisation']:>5.3f} "
                   f"{r['lost_gpu_h']:>10.1f} {r['preemptions']:>7.0f} {r['resizes']:>7.0f}")
    return "\n".join(out)

"""The scheduler's queue: every job it knows, their targets and why, as plain data kept on disk.

`Queue` is what the scheduler actor (airay.sched.actor) holds and persists after every change;
it calls `airay.sched.policy.decide` for the sizes and keeps no Ray object, so it is tested and
restored without Ray. A job's life: `queued` (target 0) -> `running` (target > 0: its driver
places and trains at that size, and carries a lowered target out as a planned shrink) -> `done`,
`failed` or `lost` (its driver stopped reporting). A running job given target 0 (preempted to make
room) goes back to `queued`, checkpointed by its driver, and is readmitted by a later decision.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from airay.sched.policy import POLICIES, Cluster, Job, decide

LIVE = ("queued", "running")
ENDED = ("done", "failed", "lost")


@dataclass
class QueuedJob:
    id: str
    name: str
    team: str = "default"
    priority: int = 0
    min_workers: int = 1
    max_workers: int = 1
    world_size_multiple: int = 1
    submit_ts: float = 0.0
    state: str = "queued"
    target: int = 0  # the size the scheduler gives it now (0: none)
    current: int = 0  # the size its driver last reported
    step: int = 0
    max_steps: int | None = None
    run_dir: str = ""
    reason: str = "waiting for the first decision"
    seen_ts: float = 0.0  # when its driver last reported
    preemptions: int = 0

    def as_policy_job(self) -> Job:
        # The goodput policy's horizon: the work left is not known in GPU-seconds here (a step's
        # time is the driver's to measure), so its horizon_s alone counts.
        return Job(self.id, self.team, self.priority, self.min_workers, self.max_workers, self.world_size_multiple,
                   self.submit_ts, self.min_workers < self.max_workers)

    def row(self) -> dict:
        return asdict(self)


@dataclass
class Queue:
    jobs: dict[str, QueuedJob] = field(default_factory=dict)
    quotas: dict[str, int] = field(default_factory=dict)  # team -> guaranteed workers
    policy: str = "shrink"
    capacity: int = 0  # workers the cluster held at the last decision
    lost_after_s: float = 600.0  # a live job whose driver has not reported this long is dropped

    # ---- changes (each followed by decide() and a save in the actor) ------------------------

    def submit(self, spec: dict, now: float) -> QueuedJob:
        """Add a job, or return it when its id is known (a driver that retries, or is restarted
        with the same run directory, keeps its place)."""
        job = self.jobs.get(spec["id"])
        if job is not None and job.state in LIVE:
            job.seen_ts = now
            return job
        known = {f.name for f in fields(QueuedJob)}
        bad = sorted(set(spec) - known)
        if bad:
            raise ValueError(f"unknown job field(s) {bad}")
        job = QueuedJob(**{**spec, "submit_ts": now, "seen_ts": now, "state": "queued", "target": 0})
        job.as_policy_job().check()
        self.jobs[job.id] = job
        return job

    def report(self, job_id: str, current: int, step: int, now: float) -> QueuedJob:
        job = self._job(job_id)
        job.current, job.step, job.seen_ts = current, step, now
        return job

    def finish(self, job_id: str, status: str, now: float) -> QueuedJob:
        job = self._job(job_id)
        job.state = status if status in ENDED else "failed"
        job.target, job.current, job.seen_ts = 0, 0, now
        job.reason = f"ended: {status}"
        return job

    def set(self, quotas: dict[str, int] | None = None, policy: str | None = None) -> None:
        if policy is not None:
            if policy not in POLICIES:
                raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
            self.policy = policy
        for team, n in (quotas or {}).items():
            if n < 0:
                raise ValueError(f"quota of team {team!r} must be >= 0, got {n}")
            if n == 0:
                self.quotas.pop(team, None)
            else:
                self.quotas[team] = int(n)

    def _job(self, job_id: str) -> QueuedJob:
        if job_id not in self.jobs:
            raise KeyError(f"no job {job_id!r} in the queue")
        return self.jobs[job_id]

    # ---- the decision -----------------------------------------------------------------------

    def decide(self, capacity: int, now: float) -> list[str]:
        """Every live job's target for a cluster of `capacity` workers; returns the ids whose
        target changed. Jobs whose drivers went silent are dropped first (their capacity is
        given out again). Quotas above the cluster are scaled down to it, in proportion."""
        for job in self.live():
            if now - job.seen_ts > self.lost_after_s:
                job.state, job.target, job.reason = "lost", 0, f"its driver did not report for {self.lost_after_s:g}s"
        self.capacity = capacity
        live = self.live()
        if not live:
            return []
        alloc = {j.id: j.target for j in live if j.state == "running"}
        decision = decide(Cluster(nodes=max(0, capacity), gpus_per_node=1), [j.as_policy_job() for j in live],
                          alloc, self._fitted_quotas(capacity), self.policy)
        changed = []
        for job in live:
            target = decision.targets.get(job.id, 0)
            if target != job.target:
                changed.append(job.id)
            if job.id in decision.preempted and job.state == "running":
                job.preemptions += 1
            reason = decision.reasons.get(job.id, job.reason)
            # A job shrunk for another keeps saying so while it stays at that size (a later
            # decision sees it at that size and only says that the rest is held).
            if not (target == job.target and "shrunk for" in job.reason and "held by" in reason):
                job.reason = reason
            job.target = target
            job.state = "running" if target > 0 else "queued"
        return changed

    def _fitted_quotas(self, capacity: int) -> dict[str, int]:
        total = sum(self.quotas.values())
        if total <= capacity:
            return dict(self.quotas)
        return {team: n * capacity // total for team, n in self.quotas.items()}

    def live(self) -> list[QueuedJob]:
        return [j for j in self.jobs.values() if j.state in LIVE]

    # ---- on disk ----------------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {"jobs": [j.row() for j in self.jobs.values()], "quotas": self.quotas, "policy": self.policy,
                "capacity": self.capacity, "lost_after_s": self.lost_after_s}

    @classmethod
    def from_dict(cls, data: dict) -> Queue:
        return cls({j["id"]: QueuedJob(**j) for j in data.get("jobs", [])}, dict(data.get("quotas", {})),
                   data.get("policy", "shrink"), data.get("capacity", 0), data.get("lost_after_s", 600.0))

    def save(self, path: Path) -> None:
        """Atomically: a scheduler killed mid-write finds the previous state, never half of one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".state-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Queue:
        return cls.from_dict(json.loads(path.read_text())) if path.exists() else cls()

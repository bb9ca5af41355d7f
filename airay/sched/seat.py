"""A driver's place in the cluster's queue: its job id, the target it was last given, and why.

The controller asks `poll()` once a round; a lowered target it carries out as a planned shrink,
a raised one as a grow, 0 as a suspend (checkpoint, release every worker, wait to be readmitted).
The job id is kept in the run directory (`queue.json`), so a driver restarted on the same run
directory (airay.supervisor, or a re-run) keeps the job's place instead of queueing again.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from airay.config import JobConfig
from airay.events import RunRecorder

SEAT_FILE = "queue.json"


def job_spec(cfg: JobConfig, run_dir: Path) -> dict:
    """What the scheduler is told about this job (airay.sched.queue.QueuedJob's fields)."""
    seat = run_dir / SEAT_FILE
    job_id = json.loads(seat.read_text())["id"] if seat.exists() else f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    sc = cfg.scaling
    return {"id": job_id, "name": cfg.name, "team": cfg.queue.team, "priority": cfg.queue.priority,
            "min_workers": sc.min_workers, "max_workers": sc.max_workers,
            "world_size_multiple": sc.world_size_multiple, "max_steps": cfg.max_steps, "run_dir": str(run_dir)}


class QueueSeat:
    def __init__(self, cfg: JobConfig, recorder: RunRecorder, client=None):
        from airay.sched.actor import QueueClient

        self.spec = job_spec(cfg, recorder.run_dir)
        self.job_id = self.spec["id"]
        (recorder.run_dir / SEAT_FILE).write_text(json.dumps({"id": self.job_id}))
        self.client = client if client is not None else QueueClient(self.spec)
        self.rec = recorder
        self.target: int | None = None  # None until the scheduler first answers
        self.reason = ""
        self.unreachable = False
        self.preemptions = 0  # as the scheduler counts them; those carried out (acknowledged)
        self.acknowledged = 0

    def submit(self) -> bool:
        reply = self.client.submit()
        if reply is not None:
            self.rec.event("queue_submitted", job_id=self.job_id, team=self.spec["team"],
                           priority=self.spec["priority"])
        return self._take(reply, 0)

    def poll(self, current: int, step: int) -> int | None:
        """The target now (the last one known when the scheduler does not answer in time)."""
        self._take(self.client.report(current, step), step)
        return self.target

    @property
    def preempted(self) -> bool:
        """The scheduler preempted the job (evicted it, perhaps readmitting it at once at another
        size) since the driver last started its world: it restarts from a checkpoint."""
        return self.preemptions > self.acknowledged

    def acknowledge(self) -> None:
        self.acknowledged = self.preemptions

    def finish(self, status: str) -> None:
        self.client.finish(status)

    def _take(self, reply: dict | None, step: int) -> bool:
        if reply is None:
            if not self.unreachable:  # said once, until it answers again
                self.unreachable = True
                self.rec.event("queue_unreachable", step=step, job_id=self.job_id, target=self.target)
            return False
        self.unreachable = False
        if reply["target"] != self.target or reply["reason"] != self.reason:
            self.rec.event("queue_target", step=step, job_id=self.job_id, target=reply["target"],
                           previous=self.target, state=reply["state"], reason=reply["reason"])
        self.target, self.reason = reply["target"], reply["reason"]
        self.preemptions = reply.get("preemptions", 0)
        return True

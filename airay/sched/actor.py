"""The scheduler on the cluster: one detached Ray actor that owns the queue, and its client.

The actor (`Scheduler`, named `airay-scheduler` in namespace `airay`) lives on the head node with
no CPU of its own, is restarted by Ray when it dies (`max_restarts=-1`) and writes the queue to
disk after every change (airay.sched.queue), so a restart loses no queued or running job. The
first job that asks for it creates it. Drivers (`QueueClient`) submit their job, report their
size and step every round, read back their target, and say when they end; every call has a
deadline and every method is idempotent, so a call Ray retries across a restart does no harm.

Capacity is counted in workers: the cluster's GPUs where it has any, else its CPUs (one worker
per GPU, or per CPU slot), over the alive nodes, at every decision (an autoscaled cluster's new
nodes count at once).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import ray

from airay.sched.queue import Queue

NAME, NAMESPACE = "airay-scheduler", "airay"
STATE_ENV = "AIRAY_SCHEDULER_STATE"  # where the queue is kept; default: the Ray session's directory
CALL_TIMEOUT_S = 15.0


def worker_slots(nodes: list[dict]) -> int:
    """Workers the alive nodes hold: their GPUs where the cluster has any, else their CPUs."""
    alive = [n["Resources"] for n in nodes if n.get("Alive")]
    key = "GPU" if any(r.get("GPU", 0) for r in alive) else "CPU"
    return int(sum(r.get(key, 0) for r in alive))


def default_state_path() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV])
    session = ray._private.worker.global_worker.node.get_session_dir_path()
    return Path(session) / "airay_scheduler" / "state.json"


class Scheduler:
    """The queue, decided and saved after every change. Its methods are called by drivers and
    by `airay queue`; each returns plain data."""

    def __init__(self, state_path: str | None = None):
        self.path = Path(state_path) if state_path else default_state_path()
        self.queue = Queue.load(self.path)
        now = time.time()
        for job in self.queue.live():  # a restarted scheduler does not count its own absence against drivers
            job.seen_ts = now
        self.started = now

    def submit(self, spec: dict) -> dict:
        job = self.queue.submit(spec, time.time())
        self._decide(force_save=True)
        return job.row()

    def report(self, job_id: str, current: int, step: int) -> dict:
        job = self.queue.report(job_id, current, step, time.time())
        self._decide()
        return job.row()

    def finish(self, job_id: str, status: str) -> dict:
        job = self.queue.finish(job_id, status, time.time())
        self._decide(force_save=True)
        return job.row()

    def configure(self, quotas: dict[str, int] | None = None, policy: str | None = None) -> dict:
        self.queue.set(quotas, policy)
        self._decide(force_save=True)
        return self.snapshot()

    def snapshot(self) -> dict:
        return {**self.queue.to_dict(), "state_path": str(self.path), "started": self.started}

    def _decide(self, force_save: bool = False) -> None:
        states = {j.id: j.state for j in self.queue.jobs.values()}
        changed = self.queue.decide(worker_slots(ray.nodes()), time.time())
        if force_save or changed or states != {j.id: j.state for j in self.queue.jobs.values()}:
            self.queue.save(self.path)


def head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return None


def scheduler(create: bool = True, state_path: str | None = None):
    """The cluster's scheduler actor (created when missing and `create`), else None."""
    try:
        return ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        if not create:
            return None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    head = head_node_id()
    options = {"scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=True)} if head else {}
    return ray.remote(Scheduler).options(
        name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
        max_task_retries=-1, num_cpus=0, **options).remote(state_path)


class QueueClient:
    """A driver's side: its job in the queue. Calls that do not answer within their deadline
    return None (the driver keeps the last target it was given and asks again next round)."""

    def __init__(self, spec: dict, timeout_s: float = CALL_TIMEOUT_S):
        self.spec, self.timeout_s = spec, timeout_s
        self.job_id = spec["id"]
        self.actor = None

    def _call(self, method: str, *args):
        try:
            if self.actor is None:
                self.actor = scheduler()
            return ray.get(getattr(self.actor, method).remote(*args), timeout=self.timeout_s)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            return None

    def submit(self) -> dict | None:
        return self._call("submit", self.spec)

    def report(self, current: int, step: int) -> dict | None:
        return self._call("report", self.job_id, current, step)

    def finish(self, status: str) -> dict | None:
        return self._call("finish", self.job_id, status)

"""The driver's state machine: start → run rounds → (recover | grow) → finish, or fail cleanly.

Steps are numbered from 0; a checkpoint "at step N" holds the state before step N runs, so
training resumes at step N. Each state is one method; `run` is the loop that moves between
them. Decisions come from airay.policy and airay.health; actors live in airay.worker_group.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import ray

from airay import policy
from airay.checkpoint import CheckpointInfo, Checkpointer
from airay.config import JobConfig
from airay.events import RunRecorder
from airay.feeder import DataLog, Feeder, Stream
from airay.health import RoundVerdict, classify_round
from airay.local_cluster import LocalCluster
from airay.placement import default_worker_resources
from airay.worker_group import WorkerGroup, node_died


# How long to wait for Ray to declare a node dead when an actor became unreachable. With the
# local cluster's health checks (airay.local_cluster) that takes ~1.5 s; a real cluster's default
# checks take longer, and then the loss is recorded as worker_failed (the recovery is the same).
NODE_VERDICT_WAIT_S = 3.0


class RunFailed(RuntimeError):
    pass


class State(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    GROWING = "growing"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Result:
    status: str
    final_step: int
    final_loss: float | None
    restarts: int
    world_sizes: list[int]
    goodput: float
    wall_s: float
    run_dir: str
    checkpoint: str | None = None
    error: str | None = None
    resizes: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _PendingResize:
    """A resize whose recovery_s is measured at the first completed step of the new world."""

    t0: float
    old_world_size: int
    new_world_size: int
    reason: str
    resumed_step: int
    parts: dict[str, float]


class Controller:
    def __init__(self, config: JobConfig, recorder: RunRecorder, local: LocalCluster | None,
                 stream: Stream | None = None, dataset=None):
        self.cfg = config
        self.rec = recorder
        self.local = local
        self.plans = policy.batch_plans(config.global_batch_size, config.micro_batch_size,
                                        config.scaling.min_workers, config.scaling.max_workers)
        root = config.checkpoint.path or str(recorder.run_dir / "checkpoints")
        self.ckpt = Checkpointer(root, config.zero_stage, config.checkpoint.keep_last, recorder)
        self.group: WorkerGroup | None = None
        # A streamed dataset's feeder buffers a round plus what workers prefetch beyond it.
        self.feeder = Feeder(stream, config.max_steps, config.steps_per_round + config.data.prefetch_steps + 1,
                             config.data.readers, dataset) if stream is not None else None
        self.data_log = DataLog(recorder, config.data.record_sample_ids)
        self.state = State.STARTING
        self.step = 0
        self.restarts = 0
        self.world_sizes: list[int] = []
        self.resizes: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        self.step_times: dict[int, float] = {}
        self.fired: set[int] = set()
        self.pending_resize: _PendingResize | None = None
        self.verdict: RoundVerdict | None = None  # the failure being recovered from
        self.t_detect = 0.0  # when it was first noticed
        self.detection_s: float | None = None  # injected fault -> noticed, when the fault was ours
        self.t_start = time.time()

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> Result:
        self.rec.event("run_started", run_dir=str(self.rec.run_dir), max_steps=self.cfg.max_steps,
                       global_batch_size=self.cfg.global_batch_size)
        error = None
        try:
            while self.state not in (State.FINISHED, State.FAILED):
                self.state = {State.STARTING: self._starting, State.RUNNING: self._running,
                              State.RECOVERING: self._recovering, State.GROWING: self._growing}[self.state]()
        except Exception as exc:  # every failure ends as a recorded run_failed, never a leak
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RunFailed) else str(exc)
            self.state = State.FAILED
        finally:
            self.data_log.close()
            if self.feeder is not None:
                self.feeder.close()
            if self.group is not None:
                self.group.shutdown()
        return self._result(error)

    # ---- states ----------------------------------------------------------------------------

    def _starting(self) -> State:
        sc = self.cfg.scaling
        if self.feeder is not None:  # the data pipeline starts up while workers do
            latest = self.ckpt.latest()
            self.feeder.seek(latest.step if latest else 0)
        per_worker = sc.resources_per_worker or default_worker_resources(ray.cluster_resources())
        self.group = WorkerGroup(self.cfg.model_dump(mode="json"), per_worker, sc.placement_strategy,
                                 self.cfg.timeouts.survivor_drain_s)
        self.rec.event("placement", resources_per_worker=per_worker, strategy=sc.placement_strategy)
        deadline = time.time() + self.cfg.timeouts.capacity_wait_s
        size = None
        while size is None:
            capacity = self.group.capacity()
            fit_now = policy.choose_world_size(capacity, sc.min_workers, sc.max_workers)
            # Ray's per-node resource view lags by up to a second (e.g. right after another run
            # released its bundles), so ask for the full world first and let GCS decide.
            for candidate in dict.fromkeys([sc.max_workers, fit_now]):
                if candidate is not None and self.group.reserve(candidate, timeout_s=3.0):
                    size = candidate
                    break
            if size is not None:
                break
            if time.time() >= deadline:
                raise RunFailed(
                    f"only {capacity} worker(s) of {per_worker} fit the cluster, scaling.min_workers is "
                    f"{sc.min_workers}; waited timeouts.capacity_wait_s={self.cfg.timeouts.capacity_wait_s}s. "
                    "Add nodes, lower scaling.min_workers or scaling.resources_per_worker.")
            time.sleep(1.0)
        if not self.group.wait_for_standby(size, timeout_s=self.cfg.timeouts.capacity_wait_s + 120):
            raise RunFailed(f"{size} workers were placed but did not start within the timeout")
        ckpt = self.ckpt.latest()
        if ckpt is not None:
            self.rec.event("resuming", step=ckpt.step, path=str(ckpt.path))
        return State.RUNNING if self._form(size, ckpt) else State.RECOVERING

    def _running(self) -> State:
        if self.step >= self.cfg.max_steps:
            return self._finish()
        self.ckpt.poll()
        if self.step % self.cfg.timeouts.grow_check_every_n_steps == 0 and self._can_grow():
            return State.GROWING
        faults = [c for c in self.cfg.chaos if c.at_step not in self.fired]
        end = policy.next_round_end(self.step, self.cfg.max_steps, self.cfg.steps_per_round,
                                    self.cfg.checkpoint.every_n_steps, [c.at_step for c in faults])
        if self.pending_resize is not None:
            end = self.step + 1  # one step, so recovery_s ends at the first step of the new world
        die_at, after_launch = self._inject(self.step, [c for c in faults if c.at_step == self.step])
        feed = self.feeder.steps(self.step, end, extra=self.cfg.data.prefetch_steps) if self.feeder else None
        t_launch = time.time()
        outcomes, values = self.group.train(self.step, end, die_at, after_launch, feed)
        if not self._ok(outcomes, fault_ts=t_launch if die_at or after_launch else None):
            return State.RECOVERING
        self._record_steps(self.step, end, values)
        self.step = end
        if self.step % self.cfg.checkpoint.every_n_steps == 0 or self.step == self.cfg.max_steps:
            if not self._checkpoint():
                return State.RECOVERING
        return State.RUNNING

    def _recovering(self) -> State:
        """Drop lost ranks, shrink to the survivors (or wait for min_workers), reload, go on."""
        verdict, group = self.verdict, self.group
        self.restarts += 1
        if self.restarts > self.cfg.max_failures:
            raise RunFailed(f"{self.restarts} failures exceed max_failures={self.cfg.max_failures}; last: "
                            f"{verdict.message or verdict.lost_ranks}")
        old = len(group.active)
        for rank in verdict.lost_ranks:
            m = group.member(rank)
            outcome = verdict.outcomes[rank]
            # "Unavailable" (not "died") means Ray lost contact with the actor's node: give its
            # health check a moment to tell a dead node from a dead process (NODE_VERDICT_WAIT_S).
            suspect = "unavailable" in outcome.error.lower()
            kind = "node_lost" if node_died(m.node_id, NODE_VERDICT_WAIT_S if suspect else 0.0) else "worker_failed"
            self.rec.event(kind, step=self.step, rank=rank, node_id=m.node_id, outcome=outcome.kind,
                           error=outcome.error, detection_s=self.detection_s)
        if verdict.kind == "comm_error":
            self.rec.event("worker_failed", step=self.step, rank=None, outcome="comm_error", error=verdict.message)
        group.drop(list(verdict.lost_ranks))
        group.leave_all()
        t_drained = time.time()
        sc = self.cfg.scaling
        group.poll_pending()
        decision = policy.decide_recovery(len(group.active), len(group.standby), sc.min_workers, sc.max_workers)
        if decision.action == "wait":
            need = sc.min_workers - len(group.active)
            self.rec.event("waiting_for_capacity", step=self.step, have=len(group.active), need=sc.min_workers,
                           timeout_s=self.cfg.timeouts.capacity_wait_s)
            if not group.wait_for_standby(need, self.cfg.timeouts.capacity_wait_s):
                raise RunFailed(
                    f"world fell to {len(group.active)} worker(s), below scaling.min_workers={sc.min_workers}, "
                    f"and no capacity returned within timeouts.capacity_wait_s={self.cfg.timeouts.capacity_wait_s}s")
            decision = policy.decide_recovery(len(group.active), len(group.standby), sc.min_workers, sc.max_workers)
        new = decision.new_world_size
        t_ckpt = time.time()
        ckpt = self.ckpt.latest()
        self.rec.event("resize_started", step=self.step, old_world_size=old, new_world_size=new, reason="failure",
                       checkpoint_step=ckpt.step if ckpt else None)
        parts = {"drain_s": t_drained - self.t_detect, "checkpoint_wait_s": time.time() - t_ckpt}
        if not self._form(new, ckpt, t0=self.t_detect, old=old, reason="failure", parts=parts):
            return State.RECOVERING
        return State.RUNNING

    def _growing(self) -> State:
        """Capacity came back: checkpoint this step, re-form bigger, reload it, go on (no step lost)."""
        old = len(self.group.active)
        new = policy.should_grow(old, len(self.group.standby), self.cfg.scaling.max_workers)
        t0 = time.time()
        self.rec.event("resize_started", step=self.step, old_world_size=old, new_world_size=new, reason="grow")
        if self.ckpt.last_saved_step != self.step and not self._checkpoint():
            return State.RECOVERING
        ckpt = self.ckpt.latest()
        parts = {"checkpoint_s": time.time() - t0}
        return State.RUNNING if self._form(new, ckpt, t0=t0, old=old, reason="grow", parts=parts) \
            else State.RECOVERING

    def _finish(self) -> State:
        if self.ckpt.last_saved_step != self.step:
            if not self._checkpoint():
                return State.RECOVERING
        self.ckpt.wait()
        return State.FINISHED

    # ---- actions -------------------------------------------------------------------------------

    def _form(self, size: int, ckpt: CheckpointInfo | None, t0: float | None = None, old: int | None = None,
              reason: str = "start", parts: dict[str, float] | None = None) -> bool:
        """Form a world of `size`, load `ckpt` (or start at step 0). False: a rank was lost meanwhile."""
        t_form = time.time()
        if self.feeder is not None:
            self.feeder.seek(ckpt.step if ckpt else 0)
        outcomes, timings = self.group.form(size, self.plans[size], load_universal=bool(ckpt and ckpt.load_tag == "universal"))
        if not self._ok(outcomes):
            return False
        t_load = time.time()
        if ckpt is not None:
            outcomes, values = self.group.load(str(ckpt.path), ckpt.load_tag)
            if not self._ok(outcomes):
                return False
            self.step = values[0]["step"]
            if self.feeder is not None:
                self.feeder.check_position(values[0].get("data_position"), self.step)
            self.rec.event("checkpoint_loaded", step=self.step, path=str(ckpt.path), world_size=size,
                           saved_world_size=ckpt.world_size, load_s=time.time() - t_load)
        else:
            self.step = 0
        self.world_sizes.append(size)
        self.ckpt.last_saved_step = ckpt.step if ckpt else None
        if t0 is not None:
            self.pending_resize = _PendingResize(t0, old, size, reason, self.step, {
                **(parts or {}), "reform_s": t_load - t_form, "reload_s": time.time() - t_load, **timings})
        self.rec.event("world_formed", step=self.step, world_size=size, plan=asdict(self.plans[size]),
                       **{k: round(v, 4) for k, v in timings.items()},
                       workers=[{k: m.info.get(k) for k in ("node_id", "pid", "device", "gpu_ids", "backend")}
                                for m in self.group.active])
        return True

    def _ok(self, outcomes, fault_ts: float | None = None) -> bool:
        """True if every rank's call succeeded. A user-code error fails the run; any other
        failure is kept for _recovering (with its detection time; `fault_ts`: when our own
        chaos struck, for detection_s)."""
        verdict = classify_round(outcomes)
        if verdict.kind == "user_error":
            raise RunFailed(verdict.message)
        if verdict.kind == "ok":
            return True
        self.verdict = verdict
        self.t_detect = self.group.first_failure_ts or time.time()
        self.detection_s = self.t_detect - fault_ts if fault_ts is not None else None
        return False

    def _checkpoint(self) -> bool:
        outcomes = self.ckpt.save(self.group, self.step,
                                  self.feeder.position(self.step) if self.feeder is not None else None)
        return self._ok(outcomes)

    def _can_grow(self) -> bool:
        group, max_w = self.group, self.cfg.scaling.max_workers
        for m in group.poll_pending():
            self.rec.event("worker_ready", step=self.step, node_id=m.node_id, start_s=time.time() - m.started)
        while group.start_failures:
            self.rec.event("worker_start_failed", step=self.step, error=group.start_failures.pop(0))
        want = max_w - len(group.active) - len(group.standby) - len(group.pending)
        if want > 0:
            fit = min(want, group.capacity() - len(group.standby))
            if fit > 0:
                group.reserve(fit, timeout_s=5.0)  # new capacity: start workers there in the background
        return policy.should_grow(len(group.active), len(group.standby), max_w) is not None

    def _inject(self, step: int, faults) -> tuple[dict[int, list[int]], Any]:
        """Chaos at the start of `step`: returns the ranks told to die and an after-launch hook."""
        die_at: dict[int, list[int]] = {}
        removals = []
        world = len(self.group.active)
        for fault in faults:
            self.fired.add(fault.at_step)
            if fault.rank >= world and fault.fault != "add_node":
                self.rec.event("fault_skipped", step=step, fault=fault.fault, rank=fault.rank,
                               reason=f"world size is {world}")
                continue
            self.rec.event("fault_injected", step=step, fault=fault.fault, rank=fault.rank)
            if fault.fault == "kill_worker":
                die_at.setdefault(fault.rank, []).append(step)
            elif fault.fault == "remove_node":
                removals.append(self.group.member(fault.rank).node_id)
            elif fault.fault == "add_node":
                node = self.local.add_node()
                self.rec.event("node_added", step=step, node_id=node)

        def remove_nodes():
            for node_id in removals:
                self.local.remove_node(node_id)

        return die_at, (remove_nodes if removals else None)

    def _record_steps(self, start: int, end: int, values: list[list[dict]]) -> None:
        world = len(values)
        gbs = self.cfg.global_batch_size
        for i, step in enumerate(range(start, end)):
            per_rank = [v[i] for v in values]
            loss = sum(r["loss_sum"] for r in per_rank) / gbs
            step_time = max(r["step_time_s"] for r in per_rank)
            self.losses[step] = loss
            self.step_times[step] = step_time
            self.rec.metric(step=step, loss=loss, world_size=world, global_batch_size=gbs,
                            samples_per_s=gbs / step_time if step_time > 0 else 0.0, step_time_s=step_time,
                            data_wait_s=max(r["data_wait_s"] for r in per_rank), ts=time.time())
        self.data_log.record(start, values)
        if self.pending_resize is not None:
            p = self.pending_resize
            self.pending_resize = None
            record = self.rec.event("resize_finished", step=start, old_world_size=p.old_world_size,
                                    new_world_size=p.new_world_size, recovery_s=time.time() - p.t0,
                                    resumed_step=p.resumed_step, reason=p.reason,
                                    **{k: round(v, 4) for k, v in p.parts.items()})
            self.resizes.append(record)
        elapsed = time.time() - self.t_start
        done = end
        eta = elapsed / max(1, done) * (self.cfg.max_steps - done)
        self.rec.progress(f"[airay] step {done}/{self.cfg.max_steps} loss {self.losses[end - 1]:.4f} "
                          f"world {world} samples/s {gbs / self.step_times[end - 1]:.1f} eta {eta:.0f}s")

    def _result(self, error: str | None) -> Result:
        wall = time.time() - self.t_start
        ok = self.state == State.FINISHED
        final = self.ckpt.latest() if ok else None
        result = Result(status="finished" if ok else "failed", final_step=self.step,
                        final_loss=self.losses.get(self.step - 1), restarts=self.restarts,
                        world_sizes=self.world_sizes, goodput=sum(self.step_times.values()) / wall if wall else 0.0,
                        wall_s=wall, run_dir=str(self.rec.run_dir), checkpoint=str(final.path) if final else None,
                        error=error, resizes=self.resizes)
        if ok:
            self.rec.event("run_finished", step=self.step, final_loss=result.final_loss, restarts=self.restarts,
                           goodput=result.goodput, wall_s=wall)
        else:
            self.rec.event("run_failed", step=self.step, error=error)
        self.rec.write_result(asdict(result))
        return result

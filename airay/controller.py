"""The driver's state machine: start → run rounds → (recover | grow) → finish, or fail cleanly.

Steps are numbered from 0; a checkpoint "at step N" holds the state before step N runs, so
training resumes at step N. Each state is one method; `run` is the loop that moves between
them. Decisions come from airay.policy and airay.health; actors live in airay.worker_group.
"""

from __future__ import annotations

import enum
import gc
import math
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from airay import goodput, placement, policy
from airay.chaos_hook import ChaosHook
from airay.checkpoint.layout import CheckpointInfo, job_identity
from airay.checkpoint.loading import CheckpointIncompatible, CheckpointUnavailable
from airay.checkpoint.manager import Checkpointer
from airay.checkpoint.storage import mask_secrets
from airay.checkpoint.tiers import memory_base
from airay.config import JobConfig
from airay.events import RunRecorder, read_jsonl
from airay.data.pipeline import DataLog, Feeder, Stream
from airay.health import DATA_ERRORS, Failure, LocalTimeWindow, RankOutcome, RoundVerdict, classify_round, \
    find_stragglers, merge_pipelined, node_mates, summarize_failures
from airay.local_cluster import LocalCluster
from airay.observe import mlflow_tracking
from airay.observe.console import Progress
from airay.sched.seat import QueueSeat
from airay.telemetry import Pace, Telemetry
from airay.worker_group import WorkerGroup


# How long to wait for Ray to declare a node dead when an actor became unreachable. With the
# local cluster's health checks (airay.local_cluster) that takes ~1.5 s; a real cluster's default
# checks take longer, and then the loss is recorded as worker_failed (the recovery is the same).
NODE_VERDICT_WAIT_S = 3.0

# An exception airay's own code raised on a rank (health.INTERNAL_ERRORS) is retried this many
# times in a run (a state that a re-formed world clears); the next one fails the run with it.
INTERNAL_ERROR_RETRIES = 1


class RunFailed(RuntimeError):
    pass


class State(enum.Enum):
    QUEUED = "queued"  # waiting for the cluster's scheduler to admit the job (config.queue)
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    GROWING = "growing"
    SHRINKING = "shrinking"  # a planned shrink: the scheduler lowered the job's target
    PREEMPTED = "preempted"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Result:
    status: str
    final_step: int
    final_loss: float | None
    restarts: int
    world_sizes: list[int]
    goodput: float  # time on steps that were kept / wall time (airay.goodput)
    wall_s: float
    run_dir: str
    checkpoint: str | None = None
    error: str | None = None
    resizes: list[dict[str, Any]] = field(default_factory=list)
    time_lost_s: dict[str, float] = field(default_factory=dict)  # per cause, see airay.goodput.CAUSES
    durable_step: int | None = None  # the newest step committed to durable storage
    traceback: str | None = None  # where the driver failed, when it was not a decision of the run


@dataclass
class _Round:
    """A round of steps [start, end) launched on every rank; `refs`: its calls."""

    start: int
    end: int
    refs: list
    t_launch: float
    struck: bool  # our chaos strikes in it (detection_s is measured from t_launch)


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
                 stream: Stream | None = None, dataset=None, launch: dict[str, float] | None = None,
                 driver_attempt: int | None = None, previous_exit: str | None = None, group_factory=WorkerGroup,
                 queue_client=None):
        self.cfg = config
        self.launch = launch or {}  # when the user launched the run, and the cluster's start (airay.api.fit)
        self.rec = recorder
        self.local = local
        self.sizes = config.world_sizes  # allowed world sizes, smallest first (whole model replicas)
        self.plans = config.batch_plans()
        ck = config.checkpoint
        root = ck.path or str(recorder.run_dir / "checkpoints")
        self.job = job_identity(config.name, config.model.model_dump(mode="json"), config.zero_stage,
                                config.model_parallel_size)
        self.memory_base = str(memory_base(ck.memory_path, root))
        self.ckpt = Checkpointer(root, config.zero_stage, ck.keep_last, recorder, self.job, self.memory_base,
                                 ck.memory_keep_last, ck.upload_retries, config.health.max_checkpoint_failures,
                                 ck.memory_budget_fraction,
                                 int(ck.memory_budget_gb * 1e9) if ck.memory_budget_gb is not None else None,
                                 model_parallel=config.tensor_parallel_size)  # the checkpoint's slices
        self.group: WorkerGroup | None = None
        # Under the cluster's scheduler (config.queue) the job's sizes are capped by the target it
        # gives; `queue_client` stands in for the scheduler actor in unit tests.
        self.seat = QueueSeat(config, recorder, queue_client) if config.queue is not None else None
        self.group_factory = group_factory  # WorkerGroup; unit tests script one without Ray (tests/fake_group.py)
        # A streamed dataset's feeder buffers a round (two when rounds are pipelined: the one
        # running and the next) plus what workers prefetch beyond it.
        rounds = 2 if config.pipeline_rounds else 1
        self.feeder = Feeder(stream, config.max_steps, rounds * config.steps_per_round + config.data.prefetch_steps + 1,
                             config.data.readers, dataset) if stream is not None else None
        self.data_log = DataLog(recorder, config.data.record_sample_ids)
        self.state = State.STARTING
        self.step = 0
        self.restarts = 0
        self.world_sizes: list[int] = []
        self.resizes: list[dict[str, Any]] = []
        self.losses: dict[int, float] = {}
        self.step_times: dict[int, float] = {}
        self.kept_step_s = 0.0  # sum of step_times, kept as it changes (read every step)
        self.failures: list[Failure] = []  # every failure, for the budget and the summary
        self.incidents: list[float] = []  # when each recovery began (the budget's sliding window)
        self.node_failures: dict[str, int] = {}
        self.user_retries = 0
        self.internal_retries = 0
        self.stragglers: set[int] = set()  # ranks reported as stragglers in the current world
        self.local_times = LocalTimeWindow(config.health.straggler_window_steps)
        self.pending_resize: _PendingResize | None = None
        self.verdict: RoundVerdict | None = None  # the failure being recovered from
        self.t_detect = 0.0  # when it was first noticed
        self.detection_s: float | None = None  # injected fault -> noticed, when the fault was ours
        self.t_start = time.time()
        self.telemetry = Telemetry(config.name, recorder.run_dir)
        where = mlflow_tracking.wanted(config)  # an MLflow run for this run (airay.observe.mlflow_tracking)
        self.tracker = mlflow_tracking.MlflowTracker(where, recorder.run_dir, recorder) if where else None
        self._last_round_end: float | None = None  # for the ETA: when the last round ended
        self.pace = Pace()
        self.preempt_deadline: float | None = None  # set by SIGTERM (request_preemption)
        # Pipelined rounds: the round queued on the ranks behind the one being gathered, if any.
        # Whatever the driver must do between two rounds (grow, preempt, release preempted
        # ranks) waits until no round is in flight.
        self.inflight: _Round | None = None
        self.grow_wanted = False  # capacity is ready, the round in flight is gathered first
        self.preempted_seen = False  # ranks got SIGTERM; the round in flight is gathered first
        # Chaos at the named points (airay.chaos_hook); faults an earlier driver of this run
        # directory injected (it was killed and restarted) are not injected again.
        self.earlier_events = read_jsonl(recorder.run_dir / "events.jsonl")  # of earlier drivers of this run dir
        self.chaos = ChaosHook(config.chaos, recorder, local, root, self.earlier_events)
        # Under `airay run` a driver that dies is restarted (airay.supervisor): which attempt this is.
        self.supervised = driver_attempt is not None
        self.driver_attempt, self.previous_exit = driver_attempt or 0, previous_exit
        self.traceback: str | None = None  # of an exception that ended the run without a decision
        self.warned_unpickle = False  # checkpoints are pickles: said once, at the first load
        self.failed_phase = "round"  # the call the failure being recovered from struck in

    def request_preemption(self, signal_name: str = "SIGTERM") -> None:
        """The driver is told to go (a spot reclaim): checkpoint at the end of the round in
        flight and exit cleanly within checkpoint.preemption_grace_s. Safe from a signal handler:
        it only sets the deadline that the loop reads between rounds."""
        if self.preempt_deadline is None:
            self.preempt_deadline = time.time() + self.cfg.checkpoint.preemption_grace_s
            self.preempt_signal = signal_name

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> Result:
        # Wall time (and goodput) is measured from this event, as airay.goodput does from the file.
        # From the launch when known: the driver's imports and a local cluster's start are waited for too.
        restart = {}
        if self.driver_attempt:
            self.rec.event("driver_restarted", attempt=self.driver_attempt, previous_exit=self.previous_exit,
                           max_driver_restarts=self.cfg.health.max_driver_restarts)
            restart = {"driver_restart": self.driver_attempt}
        started = self.rec.event("run_started", run_dir=str(self.rec.run_dir), max_steps=self.cfg.max_steps,
                                 global_batch_size=self.cfg.global_batch_size, **restart,
                                 **{k: round(v, 4) for k, v in self.launch.items()})
        if self.tracker is not None:  # the resolved spec, credentials masked as in config.yaml
            self.tracker.start(yaml.safe_load(mask_secrets(self.cfg.to_yaml())))
        # A restarted driver continues its run: wall time from the run's start (airay.goodput.run_spans).
        spans = goodput.run_spans(self.earlier_events, []) if restart else []
        self.t_start = spans[-1][0] if spans else goodput.run_start(started)
        error = None
        # The driver's heap is mostly what its imports made (Ray ~75,000 objects, with torch, which
        # the spec's model factory imports, ~210,000) and each full collection scans all of it:
        # ~120 ms, every few rounds at 4,096 ranks, whose step records are many young objects
        # (benchmarks/driver_scale.py). Frozen for the run, collections scan only what the run
        # made; collectable again after it (no collection first: it would cost start-up ~0.1 s,
        # and garbage frozen with the heap is collected after the run).
        gc.freeze()
        if self.seat is not None:
            self.state = State.QUEUED
        try:
            while self.state not in (State.FINISHED, State.FAILED, State.PREEMPTED):
                self.state = {State.QUEUED: self._queued, State.STARTING: self._starting,
                              State.RUNNING: self._running, State.RECOVERING: self._recovering,
                              State.GROWING: self._growing, State.SHRINKING: self._shrinking}[self.state]()
        except Exception as exc:  # every failure ends as a recorded run_failed, never a leak
            error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RunFailed) else str(exc)
            # A decision (RunFailed) carries its reason; anything else is a driver bug: its traceback.
            self.traceback = None if isinstance(exc, RunFailed) else traceback.format_exc()
            self.state = State.FAILED
        finally:
            self.data_log.close()
            if self.feeder is not None:
                self.feeder.close()
            if self.group is not None:
                # A failed run still commits the checkpoints its ranks have written (bounded), and
                # records the ones it leaves unfinished.
                self.ckpt.settle(timeout_s=60.0 if self.state == State.FAILED else 0.0)
                try:
                    # A finished run's last checkpoint is durable: its memory tier goes. Otherwise
                    # the newest memory steps stay, for a re-run on these nodes to resume from.
                    self.group.end_memory(remove=self.state == State.FINISHED, keep=self.ckpt.memory_steps)
                except Exception as exc:  # the cluster is going away: the tiers go with its nodes
                    self.rec.event("checkpoint_cleanup_failed", error=f"{type(exc).__name__}: {exc}")
                self.group.shutdown()
            if self.seat is not None:  # after the shutdown: the scheduler gives out what was released
                self.seat.finish("done" if self.state == State.FINISHED else "failed")
            self.chaos.close()
            self.telemetry.close()
            gc.unfreeze()
        return self._result(error)

    # ---- states ----------------------------------------------------------------------------

    def _allowed(self) -> list[int]:
        """The world sizes the run may take now: all of scaling's, or under the scheduler those
        up to the target it gives."""
        target = self.seat.target if self.seat is not None else None
        return [s for s in self.sizes if not target or s <= target] or self.sizes[:1]

    def _queued(self) -> State:
        """Wait in the cluster's queue until the scheduler gives the job a size (config.queue)."""
        deadline = time.time() + self.cfg.queue.max_wait_s
        submitted = self.seat.submit()
        while not self.seat.target:
            if time.time() >= deadline:
                raise RunFailed(f"the job waited queue.max_wait_s={self.cfg.queue.max_wait_s:g}s in the cluster's "
                                f"queue without being admitted ({self.seat.reason or 'the scheduler did not answer'}); "
                                "raise queue.priority or queue.max_wait_s, or see `airay queue`")
            time.sleep(1.0)
            submitted = submitted or self.seat.submit()
            if submitted:
                self.seat.poll(0, self.step)
        self.seat.acknowledge()  # a preemption before this start is what this start carries out
        return State.STARTING

    def _starting(self) -> State:
        sc = self.cfg.scaling
        if self.feeder is not None:  # the data pipeline starts up while workers do
            latest = self.ckpt.latest()
            self.feeder.seek(latest.step if latest else 0)
        per_worker = sc.resources_per_worker or self.group_factory.default_resources()
        # Under the scheduler, placement groups are as small as the job may shrink by: a planned
        # shrink gives back whole groups (airay.placement.group_sizes).
        mp = self.cfg.model_parallel_size
        unit = math.lcm(sc.world_size_multiple, mp) if self.seat is not None else 0
        strategy = placement.strategy_for(sc.placement_strategy, mp)  # a model-parallel group shares a node
        self.group = self.group_factory(self.cfg.model_dump(mode="json"), per_worker, strategy,
                                        self.cfg.timeouts.survivor_drain_s, self.memory_base, self.job,
                                        self.cfg.timeouts.phase_timeout_s, unit=unit, mp=mp)
        self.rec.event("placement", resources_per_worker=per_worker, strategy=strategy)
        # Room for the whole world, as a standing request the autoscaler acts on (a launcher
        # cluster that starts small grows; a lost node is replaced), withdrawn when the run ends.
        sizes = self._allowed()
        self.group.demand(sizes[-1])
        deadline = time.time() + self.cfg.timeouts.capacity_wait_s
        size = None
        while size is None:
            capacity = self.group.capacity()
            fit_now = policy.choose_world_size(capacity, sizes)
            # Ray's per-node resource view lags by up to a second (e.g. right after another run
            # released its bundles), so ask for the full world first and let GCS decide.
            for candidate in dict.fromkeys([sizes[-1], fit_now]):
                placed = len(self.group.pending) + len(self.group.standby)
                if candidate is not None and candidate > placed:
                    # The first world joins as soon as its workers are up: no warm-up engine.
                    if self.group.reserve(candidate - placed, timeout_s=3.0, warm=False):
                        self.rec.event("workers_placed", workers=len(self.group.pending) + len(self.group.standby))
                size = policy.choose_world_size(len(self.group.pending) + len(self.group.standby), sizes)
                if size is not None:
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
        self.group.ensure_stores()  # the nodes' memory tiers: what an earlier run left there counts too
        self.ckpt.check_budget(self.group)  # the tiers' budgets, from the nodes' memory (memory_budget)
        candidates = self.ckpt.candidates(self.group)
        if candidates:
            self.rec.event("resuming", step=candidates[0].step, path=candidates[0].path, tier=candidates[0].tier)
        return State.RUNNING if self._form(size, candidates) else State.RECOVERING

    def _running(self) -> State:
        if self.step >= self.cfg.max_steps:
            return self._finish()  # no round is ever launched past max_steps: none is in flight
        self.ckpt.poll()
        self._check_checkpoints()
        every = self.cfg.timeouts.grow_check_every_n_steps
        # The scheduler lowered the job's target below what it holds (its world, and workers
        # standing by or starting): a planned shrink once no round is in flight.
        group = self.group
        shrink = self.seat is not None and self.seat.poll(len(group.active), self.step) is not None \
            and (self.seat.target < len(group.active) + len(group.standby) + len(group.pending) or self.seat.preempted)
        # A resize is done at its first step: a grow before it would replace its record
        # (resize_finished, recovery_s) with the grow's, and the recovery would go unreported.
        raised = self.seat is not None and (self.seat.target or 0) > len(group.active)  # by the scheduler
        grow = not shrink and (self.step % every == 0 or self.grow_wanted or raised) and self._can_grow() \
            and self.pending_resize is None
        if self.inflight is None:
            self.grow_wanted = False
            if self.preempt_deadline is not None:
                return self._preempt()
            if shrink:
                return State.SHRINKING
            if grow:
                return State.GROWING
            current = self._launch_round(self.step, self._round_end(self.step))
        else:
            current, self.inflight = self.inflight, None
            self.grow_wanted = grow
        queue_end = None if grow or shrink or self.preempt_deadline is not None or self.preempted_seen \
            else self._pipelined_end(current)
        if queue_end is not None:
            self.inflight = self._launch_round(current.end, queue_end)
        timeouts = self.cfg.timeouts
        # While the round runs, the last save is committed and the next one's room made (poll).
        outcomes, values = self.group.collect(current.refs, hang_timeout_s=timeouts.hang_timeout_s,
                                              first_step_timeout_s=timeouts.first_step_s, idle=self.ckpt.poll)
        if not self._round_ok(outcomes, current):
            return State.RECOVERING
        self._check_stragglers(current.start, values)
        self._record_steps(current.start, current.end, values)
        self.step = current.end
        if self.step % self.cfg.checkpoint.interval == 0 or self.step == self.cfg.max_steps:
            # (never with a round in flight: policy.can_pipeline)
            if not self._checkpoint():
                return State.RECOVERING
            self._check_checkpoints()
        preempted = [rank for rank, v in enumerate(values) if v and v[-1].get("preempted")]
        if preempted:
            if self.inflight is not None:
                self.preempted_seen = True  # they run the queued round too; released after it
                return State.RUNNING
            self.preempted_seen = False
            return self._release_preempted(preempted)
        return State.RUNNING

    def _round_end(self, start: int) -> int:
        """Where the round from `start` ends (policy.next_round_end)."""
        if self.pending_resize is not None:
            return start + 1  # one step, so recovery_s ends at the first step of the new world
        return policy.next_round_end(start, self.cfg.max_steps, self.cfg.steps_per_round,
                                     self.cfg.checkpoint.interval, self.chaos.round_starts())

    def _launch_round(self, start: int, end: int) -> _Round:
        """Launch the round [start, end). Data faults strike whatever round holds their step:
        the round is re-run from its start."""
        faults, after_launch, struck = self.chaos.round(start, end, self.group, self.ckpt)
        feed = self.feeder.steps(start, end, extra=self.cfg.data.prefetch_steps,
                                 timeout_s=self.cfg.data.pipeline_timeout_s) if self.feeder else None
        struck = self.chaos.feed(feed, start, end, self.group, self.plans) or struck
        t_launch = time.time()
        refs = self.group.launch(start, end, faults, feed)
        if after_launch is not None:
            after_launch()
        return _Round(start, end, refs, t_launch, struck)

    def _pipelined_end(self, current: _Round) -> int | None:
        """The end of the round after `current` when it may be queued now, before `current` is
        gathered: the driver has nothing to do at its end (no checkpoint, no resize to time, no
        fault). None: gather `current` first."""
        if not self.cfg.pipeline_rounds or self.pending_resize is not None or current.struck:
            return None
        if not policy.can_pipeline(current.end, self.cfg.max_steps, self.cfg.checkpoint.interval):
            return None
        end = self._round_end(current.end)
        if self.feeder is not None and not self.feeder.ready(current.end, end):
            return None  # never wait for data with a round unwatched: it is launched after the gather
        return end if self.chaos.quiet(current.start, end) else None

    def _round_ok(self, outcomes: list[RankOutcome], current: _Round) -> bool:
        """_ok for a round; when it failed with the next round queued behind it, that round is
        settled first (woken, waited for) and what it lost is lost too (merge_pipelined)."""
        if self.inflight is not None and any(o.kind != "ok" for o in outcomes):
            queued, self.inflight = self.inflight, None
            refs = [None if o.infra else ref for o, ref in zip(outcomes, queued.refs)]
            behind = self.group.settle(refs)
            merged = merge_pipelined(outcomes, behind)
            self.rec.event("queued_round_dropped", step=queued.start, end=queued.end,
                           lost_ranks=[o.rank for o, m in zip(outcomes, merged) if m is not o])
            outcomes = merged
        return self._ok(outcomes, fault_ts=current.t_launch if current.struck else None)

    def _release_preempted(self, ranks: list[int]) -> State:
        """Ranks got SIGTERM (their node is being reclaimed): checkpoint this step (memory tier
        if there is one: it lives on the driver's node), then let them go like lost ranks, so
        the world shrinks and resumes at this very step: no step is lost."""
        if self.ckpt.last_saved_step != self.step and not self._checkpoint(durable=False):
            return State.RECOVERING
        self.ckpt.wait(uploads=False)  # this step in memory is what the shrunk world loads
        for rank in ranks:
            self.rec.event("worker_preempted", step=self.step, rank=rank, node_id=self.group.member(rank).node_id,
                           checkpoint_step=self.ckpt.last_saved_step)
        outcomes = tuple(RankOutcome(r, "died", error="preempted (SIGTERM)", cause="Preempted") if r in ranks
                         else RankOutcome(r, "ok") for r in range(len(self.group.active)))
        self.verdict, self.failed_phase = RoundVerdict("lost", tuple(ranks), outcomes=outcomes), "round"
        self.t_detect, self.detection_s = time.time(), None
        return State.RECOVERING

    def _recovering(self) -> State:
        """Drop lost ranks, shrink to the survivors (or wait for min_workers), reload, go on."""
        verdict, group = self.verdict, self.group
        self.preempted_seen = False  # a rank still under SIGTERM says so again in its next round
        if verdict.kind == "data_lost":
            return self._rerun_after_data_loss()
        self.restarts += 1
        self.incidents.append(self.t_detect)
        old = len(group.active)
        hangs = {h["rank"]: h for h in group.hangs}
        # Whether each lost rank's node died, asked once per node (an 8-GPU node loses 8 ranks):
        # "Unavailable" (not "died") means Ray lost contact with the actor's node, so its health
        # check gets a moment (NODE_VERDICT_WAIT_S) to tell a dead node from a dead process.
        lost = [r for r in verdict.lost_ranks if verdict.outcomes[r].kind != "hung"]
        suspects = {group.member(r).node_id for r in lost
                    if verdict.outcomes[r].kind == "died" and "unavailable" in verdict.outcomes[r].error.lower()}
        dead_nodes = group.dead_nodes({group.member(r).node_id for r in lost}, suspects, NODE_VERDICT_WAIT_S)
        # Ranks Ray's memory monitor killed (or that ran out of memory): their nodes' figures go
        # in the event, and the memory tier gives memory back before their replacements start.
        oom_nodes = sorted({group.member(r).node_id for r in verdict.lost_ranks
                            if verdict.outcomes[r].fault == "oom" and group.member(r).node_id})
        figures = {f["node_id"]: f for f in group.node_memory(oom_nodes)} if oom_nodes else {}
        nodes = [m.node_id for m in group.active]
        drop = list(verdict.lost_ranks)
        for rank in verdict.lost_ranks:
            m = group.member(rank)
            outcome = verdict.outcomes[rank]
            if outcome.kind == "hung":
                # Its node's other ranks go with it (airay.health.node_mates): one failure, the hung rank's.
                mates = [r for r in node_mates(rank, nodes) if r not in drop]
                drop += mates
                self.rec.event("hang_detected", step=self.step, rank=rank, node_id=m.node_id, phase=self.failed_phase,
                               detection_s=self.detection_s, stalled_s=hangs[rank]["stalled_s"],
                               heartbeat=hangs[rank]["heartbeat"], progress=hangs[rank]["progress"],
                               deadline_s=hangs[rank].get("deadline_s"), evicted_ranks=mates, error=outcome.error)
                kind = "hung"
            else:
                lost_node = m.node_id in dead_nodes
                kind = "node_lost" if lost_node else outcome.fault
                memory = {"node_memory": figures[m.node_id]} if m.node_id in figures else {}
                self.rec.event("node_lost" if lost_node else "worker_failed", step=self.step, rank=rank,
                               node_id=m.node_id, phase=self.failed_phase, outcome=outcome.fault, error=outcome.error,
                               detection_s=self.detection_s, **memory)
            self.failures.append(Failure(self.t_detect, kind, rank, m.node_id, self.step))
        self._count_incident({group.member(r).node_id for r in verdict.lost_ranks})
        if oom_nodes:
            self.ckpt.relieve_memory(group, oom_nodes)
        if verdict.kind in ("comm_error", "user_error", "internal_error"):
            # No rank is lost: the same world re-forms (its workers kept) and reloads.
            node = group.member(verdict.rank).node_id if verdict.rank is not None else None
            self.rec.event("worker_failed", step=self.step, rank=verdict.rank, node_id=node, phase=self.failed_phase,
                           outcome=verdict.kind, error=verdict.message)
            self.failures.append(Failure(self.t_detect, verdict.kind, verdict.rank, node, self.step))
        self._check_budget()
        exclude = policy.nodes_to_exclude(self.node_failures, self.cfg.health.exclude_node_after_failures,
                                          group.excluded)
        if exclude:
            room = group.room_without(set(exclude))
            if room < self.sizes[0]:
                raise RunFailed(
                    f"node(s) {', '.join(n[:8] for n in exclude)} reached health.exclude_node_after_failures="
                    f"{self.cfg.health.exclude_node_after_failures} failures; excluding them leaves room for {room} "
                    f"worker(s) on the cluster's other nodes, below scaling.min_workers={self.cfg.scaling.min_workers}. "
                    "Add nodes, or raise health.exclude_node_after_failures (0: never exclude). "
                    f"Failures:\n{summarize_failures(self.failures)}")
        for node in exclude:
            on_node = group.exclude(node)
            self.rec.event("node_excluded", step=self.step, node_id=node, failures=self.node_failures[node],
                           evicted_ranks=[r for r in on_node if r not in drop])
            drop += [r for r in on_node if r not in drop]
        group.drop(sorted(drop))
        if exclude:
            released = group.release_vacant_groups()
            if released:
                self.rec.event("placement_released", step=self.step, groups=released, reason="node_excluded")
        group.leave_all()
        t_drained = time.time()
        sc = self.cfg.scaling
        group.poll_pending()
        decision = policy.decide_recovery(len(group.active), group.formable() - len(group.active), self._allowed())
        if decision.action == "wait":
            need = self.sizes[0] - len(group.active)
            self.rec.event("waiting_for_capacity", step=self.step, have=len(group.active), need=self.sizes[0],
                           timeout_s=self.cfg.timeouts.capacity_wait_s)
            self._reserve_free_capacity()  # e.g. an excluded node's workers are replaced elsewhere
            if not group.wait_for_standby(need, self.cfg.timeouts.capacity_wait_s):
                raise RunFailed(
                    f"world fell to {len(group.active)} worker(s), below scaling.min_workers={sc.min_workers}, "
                    f"and no capacity returned within timeouts.capacity_wait_s={self.cfg.timeouts.capacity_wait_s}s")
            decision = policy.decide_recovery(len(group.active), group.formable() - len(group.active), self._allowed())
        new = decision.new_world_size
        t_ckpt = time.time()
        candidates = self.ckpt.candidates(self.group)
        self.rec.event("resize_started", step=self.step, old_world_size=old, new_world_size=new, reason="failure",
                       checkpoint_step=candidates[0].step if candidates else None)
        parts = {"drain_s": t_drained - self.t_detect, "checkpoint_wait_s": time.time() - t_ckpt}
        if not self._form(new, candidates, t0=self.t_detect, old=old, reason="failure", parts=parts):
            return State.RECOVERING
        return State.RUNNING

    def _count_incident(self, nodes: set[str | None]) -> None:
        """One failure toward exclusion per node this incident struck (policy.incident_nodes);
        none when it struck most of the world's nodes at once (the cause is the cluster's)."""
        world = {m.node_id for m in self.group.active}
        counted, cluster_wide = policy.incident_nodes(nodes, world)
        if cluster_wide:
            self.rec.event("incident_not_counted", step=self.step, nodes=len({n for n in nodes if n}),
                           world_nodes=len(world),
                           reason="it struck most of the world's nodes at once: a cause of the cluster's or the "
                                  "job's, not of a node (no node's exclusion count grows)")
        for node in counted:
            self.node_failures[node] = self.node_failures.get(node, 0) + 1

    def _rerun_after_data_loss(self) -> State:
        """A block of the round could not be fetched: the data failed, no rank did. Keep every
        worker, restart the pipeline (its other blocks are not trusted either), re-form the same
        world and reload the newest checkpoint: the round is re-run on exactly its samples."""
        group, size = self.group, len(self.group.active)
        self.restarts += 1
        self.incidents.append(self.t_detect)
        for o in self.verdict.outcomes:
            if o.kind == "errored" and o.cause in DATA_ERRORS:
                node = group.member(o.rank).node_id
                self.rec.event("data_block_lost", step=o.step, rank=o.rank, node_id=node, error=o.error,
                               round_start=self.step, detection_s=self.detection_s)
                self.failures.append(Failure(self.t_detect, "data_lost", o.rank, node, o.step))
        self._check_budget()  # a block that is lost again and again ends the run, never loops
        group.leave_all()
        t_drained = time.time()
        candidates = self.ckpt.candidates(self.group)
        self.feeder.restart(candidates[0].step if candidates else 0)
        self.rec.event("resize_started", step=self.step, old_world_size=size, new_world_size=size, reason="failure",
                       cause="data_lost", checkpoint_step=candidates[0].step if candidates else None)
        parts = {"drain_s": t_drained - self.t_detect, "checkpoint_wait_s": time.time() - t_drained}
        if not self._form(size, candidates, t0=self.t_detect, old=size, reason="failure", parts=parts):
            return State.RECOVERING
        return State.RUNNING

    def _growing(self) -> State:
        """Capacity came back: checkpoint this step, re-form bigger, reload it, go on (no step lost)."""
        old = len(self.group.active)
        new = policy.should_grow(old, self.group.formable() - old, self._allowed())
        t0 = time.time()
        self.rec.event("resize_started", step=self.step, old_world_size=old, new_world_size=new, reason="grow")
        if self.ckpt.last_saved_step != self.step and not self._checkpoint():
            return State.RECOVERING
        candidates = self.ckpt.candidates(self.group)
        parts = {"checkpoint_s": time.time() - t0}
        return State.RUNNING if self._form(new, candidates, t0=t0, old=old, reason="grow", parts=parts) \
            else State.RECOVERING

    def _shrinking(self) -> State:
        """A planned shrink (the scheduler lowered the target): checkpoint this step in memory,
        give back whole placement groups, highest ranks first, re-form the rest and load the
        step: no failure, no replayed step. Target 0 (preempted by a job of higher priority):
        a durable checkpoint, every worker released, back to the queue until readmitted."""
        group, old, target = self.group, len(self.group.active), self.seat.target
        if target == 0 or self.seat.preempted:  # evicted (and requeued, or readmitted at once): a restart
            return self._suspend()
        idle = group.release_idle()  # workers standing by or starting beyond the target go first
        if idle:
            self.rec.event("placement_released", step=self.step, groups=idle, reason="scheduler")
        new = policy.choose_world_size(target, self.sizes)
        if new is None:  # below the job's smallest size: it cannot run at all
            return self._suspend()
        if new >= old:
            return State.RUNNING
        t0 = time.time()
        ranks = group.releasable(old - new)
        if len(ranks) != old - new:  # cannot happen with the scheduler's placement groups (unit)
            raise RunFailed(f"the scheduler lowered the job to {new} workers, and its placement groups cannot give "
                            f"back {old - new} (they hold whole groups of more bundles)")
        self.rec.event("resize_started", step=self.step, old_world_size=old, new_world_size=new, reason="scheduler",
                       released_ranks=ranks, target=target, why=self.seat.reason)
        if self.ckpt.last_saved_step != self.step and not self._checkpoint(durable=False):
            return State.RECOVERING
        self.ckpt.wait(uploads=False)  # this step in memory is what the shrunk world loads
        t_saved = time.time()
        self.rec.event("placement_released", step=self.step, groups=group.release(ranks), reason="scheduler")
        group.leave_all()
        candidates = self.ckpt.candidates(group)
        parts = {"checkpoint_s": t_saved - t0, "drain_s": time.time() - t_saved}
        return State.RUNNING if self._form(new, candidates, t0=t0, old=old, reason="scheduler", parts=parts) \
            else State.RECOVERING

    def _suspend(self) -> State:
        """Preempted by the scheduler: a durable checkpoint of this step, every worker and
        placement group released, then back in the queue; readmitted, the job starts again from
        that checkpoint (at whatever size it is then given)."""
        self.rec.event("preemption_requested", step=self.step, signal="scheduler", grace_s=None, why=self.seat.reason)
        if not self._durable_now():
            return State.RECOVERING
        self.group.end_memory(remove=False, keep=self.ckpt.memory_steps)
        self.group.shutdown()
        self.group = None
        self.rec.event("suspended", step=self.step, checkpoint_step=self.ckpt.last_durable_step, why=self.seat.reason,
                       target=self.seat.target)
        return State.QUEUED

    def _preempt(self) -> State:
        """Emergency checkpoint of this step to durable storage, then a clean exit; re-running the
        job resumes from it."""
        t0 = time.time()
        self.rec.event("preemption_requested", step=self.step, signal=self.preempt_signal,
                       grace_s=self.cfg.checkpoint.preemption_grace_s)
        if not self._durable_now():
            return State.RECOVERING  # a rank was lost meanwhile: recover, then checkpoint again
        self.rec.event("preempted", step=self.step, checkpoint_step=self.ckpt.last_durable_step,
                       checkpoint_s=time.time() - t0, within_grace=time.time() <= self.preempt_deadline)
        return State.PREEMPTED

    def _durable_now(self) -> bool:
        """This step committed to durable storage before the job lets its workers go (a
        preemption, by a signal or by the scheduler). False: a rank was lost meanwhile."""
        saved = self.ckpt.last_saved_step == self.step and self.ckpt.last_saved_durable
        if not saved and not self._checkpoint(durable=True):
            return False
        self.ckpt.wait()  # the commit's outcome (retried on failure)
        self._check_checkpoints()
        self._require_durable("preemption")
        return True

    def _finish(self) -> State:
        if self.ckpt.last_saved_step != self.step:
            if not self._checkpoint():
                return State.RECOVERING
        self.ckpt.wait()
        self._check_checkpoints()
        self._require_durable("final")
        if self.cfg.checkpoint.export_hf:
            self._export_final()
        return State.FINISHED

    def _export_final(self) -> None:
        """The final checkpoint as a Hugging Face model folder (checkpoint.export_hf), written by a
        task on a training node, not here: consolidating a model takes its full size in memory.
        A failed export leaves the run finished (its checkpoint is durable) and says why."""
        from airay.checkpoint.layout import step_name
        from airay.checkpoint.manager import error_text

        t0, out = time.time(), f"{self.ckpt.root}/hf"
        try:
            self.group.export(f"{self.ckpt.root}/{step_name(self.step)}", out, self.cfg.model.factory,
                              self.cfg.model.kwargs, self.cfg.seed,
                              timeout_s=self.cfg.timeouts.phase_timeout_s)
        except Exception as exc:
            self.rec.event("export_failed", step=self.step, path=out, error=error_text(exc))
            return
        self.rec.event("exported", step=self.step, path=out, format="hf", export_s=time.time() - t0)

    def _require_durable(self, which: str) -> None:
        """The final and the preemption checkpoint are what the user keeps: a run whose one did
        not reach durable storage (after its retries) has not finished; it fails and says why."""
        if self.ckpt.last_durable_step != self.step:
            raise RunFailed(f"the {which} checkpoint (step {self.step}) did not reach durable storage: "
                            f"{self.ckpt.errors.get(self.step, 'it was not committed')}. {self.ckpt.durable_text()}")

    def _check_checkpoints(self) -> None:
        """A run that cannot checkpoint ends (health.max_checkpoint_failures): everything it
        trained from then on would be lost with its next fault."""
        if self.ckpt.fatal is not None:
            raise RunFailed(self.ckpt.fatal)

    # ---- actions -------------------------------------------------------------------------------

    def _form(self, size: int, candidates: list[CheckpointInfo], t0: float | None = None, old: int | None = None,
              reason: str = "start", parts: dict[str, float] | None = None) -> bool:
        """Form a world of `size` and load the newest of `candidates` that has a good copy of every
        file (or start at step 0). False: a rank was lost meanwhile."""
        t_form = time.time()
        if self.feeder is not None:
            self.feeder.seek(candidates[0].step if candidates else 0)
        faults, t_call = self.chaos.call("form", self.step, size), time.time()
        # With a checkpoint to load, the ranks build their models without weights (the load
        # overwrites every one); should no candidate load after all, the world forms again with them.
        outcomes, timings = self.group.form(size, self.plans[size], faults, init_weights=not candidates)
        if not self._ok(outcomes, t_call if faults else None, "form"):
            return False
        for found in self.group.foreign_tiers:
            self.rec.event("checkpoint_ignored", tier="memory", path=found["path"], node_id=found["node_id"],
                           job=found["found"], reason="another job's memory tier on this path: cleared, not loaded")
        self.group.foreign_tiers = []
        t_load = time.time()
        ckpt = self._load(size, candidates)
        if ckpt is False:
            return False
        if ckpt is None and candidates:  # every candidate was rejected: weights from the factory
            return self._form(size, [], t0, old, reason, parts)
        if ckpt is None:
            self.step = 0
        if self.feeder is not None and ckpt is not None and ckpt.step != candidates[0].step:
            self.feeder.seek(ckpt.step)  # a newer candidate had no good copy of some file
        self.world_sizes.append(size)
        self.stragglers = set()
        self.local_times = LocalTimeWindow(self.cfg.health.straggler_window_steps)
        self.ckpt.last_saved_step = ckpt.step if ckpt else None
        self.ckpt.last_saved_durable = bool(ckpt and ckpt.tier == "durable")
        if ckpt is not None and ckpt.tier == "memory":  # kept by the memory tier's retention from now on
            self.ckpt.memory_steps = sorted(set(self.ckpt.memory_steps) | {ckpt.step})
        if t0 is not None:
            self.pending_resize = _PendingResize(t0, old, size, reason, self.step, {
                **(parts or {}), "reform_s": t_load - t_form, "reload_s": time.time() - t_load, **timings})
        self.rec.event("world_formed", step=self.step, world_size=size, plan=asdict(self.plans[size]),
                       **{k: round(v, 4) for k, v in timings.items()},
                       workers=[{**{k: m.info.get(k) for k in ("node_id", "pid", "device", "gpu_ids", "backend",
                                                               "timeline")},
                                 **{k: m.joined.get(k) for k in ("local_rank", "cuda_visible_devices", "cuda_device",
                                                                 "engine_device", "build_rss",
                                                                 "engine_outlived_leave")}}
                                for m in self.group.active])
        return True

    def _load(self, size: int, candidates: list[CheckpointInfo]) -> CheckpointInfo | None | bool:
        """Load the newest candidate every rank finds good copies of; a candidate some file of
        which has no good copy anywhere is rejected and the next tried. Returns what was loaded,
        None (nothing to load), or False (a rank was lost meanwhile)."""
        durable_steps = {c.step for c in candidates if c.tier == "durable"}
        if candidates and not self.warned_unpickle:
            self.warned_unpickle = True
            self.rec.event("checkpoint_trust", path=str(self.ckpt.root))
        for ckpt in candidates:
            t0 = time.time()
            faults = self.chaos.call("load", ckpt.step, size)
            outcomes, values = self.group.load(ckpt, self.ckpt.durable.location if ckpt.step in durable_steps else None,
                                               faults)
            failed = [o for o in outcomes if o.kind != "ok"]
            if failed and all(o.kind == "errored" and o.cause == CheckpointUnavailable.__name__ for o in failed):
                self.ckpt.reject(ckpt, failed[0].error, self.group)
                continue
            refused = [o for o in failed if o.cause == CheckpointIncompatible.__name__]
            if refused and not any(o.infra for o in failed):
                raise RunFailed(f"the checkpoint {ckpt.path} cannot be loaded at world size {size}: {refused[0].error}")
            if not self._ok(outcomes, t0 if faults else None, "load"):
                return False
            self.step = values[0]["step"]
            if self.feeder is not None:
                self.feeder.check_position(values[0].get("data_position"), self.step)
            for rank, v in enumerate(values):
                for bad in v["bad"]:  # a copy that failed its checksum, and the next that served
                    self.rec.event("checkpoint_rejected", step=ckpt.step, tier=ckpt.tier, rank=rank, file=bad["file"],
                                   copy=bad["copy"], reason=bad["reason"], fell_back=True)
            copies = {k: sum(v["copies"][k] for v in values) for k in ("local", "peer", "durable")}
            self.rec.event("checkpoint_loaded", step=self.step, path=ckpt.path, tier=ckpt.tier, world_size=size,
                           saved_world_size=ckpt.world_size, resharded=values[0]["resharded"], copies=copies,
                           load_s=time.time() - t0, fetch_s=max(v["fetch_s"] for v in values),
                           reshard_s=max(v["reshard_s"] for v in values), bytes_read=sum(v["bytes"] for v in values),
                           bytes_needed=sum(v.get("bytes_needed", v["bytes"]) for v in values),
                           partial_files=sum(v.get("partial_files", 0) for v in values),
                           read_vs_needed=max(v["bytes"] / max(1, v.get("bytes_needed", v["bytes"])) for v in values))
            return ckpt
        return None

    def _ok(self, outcomes, fault_ts: float | None = None, phase: str = "round") -> bool:
        """True if every rank's call succeeded. A user-code error fails the run, and so does an
        error of airay's own code the second time; any other failure is kept for _recovering
        (with its detection time; `fault_ts`: when our own chaos struck, for detection_s;
        `phase`: the call that failed: round, form, load, save)."""
        verdict = classify_round(outcomes)
        if verdict.kind == "ok":
            return True
        self.failed_phase = phase
        if verdict.kind == "user_error":
            if self.user_retries >= self.cfg.health.retry_user_errors:
                raise RunFailed(verdict.message + "\n(an error in user code is not retried: fix the code, "
                                "or set health.retry_user_errors to allow retries)")
            self.user_retries += 1  # opted in (health.retry_user_errors); bounded, never a loop
        if verdict.kind == "internal_error":
            if self.internal_retries >= INTERNAL_ERROR_RETRIES:
                raise RunFailed(verdict.message + f"\n(an error in airay's own code, not in yours, in the {phase}; "
                                f"airay retried {self.internal_retries} time(s) from the last checkpoint and it came "
                                "back: please report it with this traceback)")
            self.internal_retries += 1
        self.verdict = verdict
        self.t_detect = self.group.first_failure_ts or time.time()
        self.detection_s = self.t_detect - fault_ts if fault_ts is not None else None
        return False

    def _check_budget(self) -> None:
        """Give up when failures crowd the window; else back off before a recurring recovery."""
        h, now = self.cfg.health, time.time()
        n = policy.failures_in_window(self.incidents, now, h.failure_window_s)
        if policy.budget_exceeded(self.incidents, now, h.failure_window_s, self.cfg.max_failures):
            raise RunFailed(f"{n} failures within health.failure_window_s={h.failure_window_s:g}s exceed "
                            f"max_failures={self.cfg.max_failures}; raise max_failures or fix the cause. "
                            f"Failures:\n{summarize_failures(self.failures)}")
        wait = policy.restart_backoff_s(n, h.restart_backoff_s, h.max_backoff_s)
        if wait > 0:
            self.rec.event("restart_backoff", step=self.step, wait_s=wait, failures_in_window=n)
            time.sleep(wait)

    def _check_stragglers(self, start: int, values: list[list[dict]]) -> None:
        """Report (once per rank and world) a rank whose own work per step is much slower, judged
        over the last health.straggler_window_steps steps."""
        h = self.cfg.health
        local = self.local_times.add([[v["local_s"] for v in per_rank] for per_rank in values])
        if local is None:
            return
        new = [r for r in find_stragglers(local, h.straggler_factor, h.straggler_min_excess_s)
               if r not in self.stragglers]
        if not new:
            return
        medians = sorted(sorted(ts)[len(ts) // 2] for ts in local)  # once, however many ranks straggle
        for rank in new:
            self.stragglers.add(rank)
            self.rec.event("straggler_detected", step=start, rank=rank, node_id=self.group.member(rank).node_id,
                           local_s=sorted(local[rank])[len(local[rank]) // 2], median_local_s=medians[len(medians) // 2])

    def _checkpoint(self, durable: bool | None = None) -> bool:
        """Save this step: to durable storage on its interval and at the end, else to memory."""
        if durable is None:
            durable = self.step % self.cfg.checkpoint.every_n_steps == 0 or self.step == self.cfg.max_steps
        faults, t_call = self.chaos.call("save", self.step, len(self.group.active)), time.time()
        outcomes = self.ckpt.save(self.group, self.step,
                                  self.feeder.position(self.step) if self.feeder is not None else None, durable, faults)
        return self._ok(outcomes, t_call if faults else None, "save")

    def _can_grow(self) -> bool:
        group = self.group
        for m in group.poll_pending():
            self.rec.event("worker_ready", step=self.step, node_id=m.node_id, start_s=time.time() - m.started)
        while group.start_failures:
            self.rec.event("worker_start_failed", step=self.step, error=group.start_failures.pop(0))
        self._reserve_free_capacity()
        ready_for = time.time() - min((m.ready_ts for m in group.standby), default=time.time())
        return policy.grow_now(len(group.active), group.formable() - len(group.active), len(group.pending), ready_for,
                               self.cfg.timeouts.grow_settle_s, self._allowed())

    def _reserve_free_capacity(self) -> None:
        """Start workers (in the background) on free capacity, up to max_workers in all."""
        group = self.group
        want = self._allowed()[-1] - len(group.active) - len(group.standby) - len(group.pending)
        if want > 0:
            fit = min(want, group.capacity() - len(group.standby))
            if fit > 0:
                group.reserve(fit, timeout_s=5.0)

    def _record_steps(self, start: int, end: int, values: list[list[dict]]) -> None:
        world = len(values)
        gbs = self.cfg.global_batch_size
        now = time.time()
        records = []
        for i, step in enumerate(range(start, end)):
            per_rank = [v[i] for v in values]
            loss = sum(r["loss_sum"] for r in per_rank) / gbs
            # The step took as long as its slowest rank; its split is that rank's, so the parts add up.
            slowest = max(per_rank, key=lambda r: r["step_time_s"])
            step_time = slowest["step_time_s"]
            tokens = sum(r.get("tokens", 0) for r in per_rank)
            self.losses[step] = loss
            self.kept_step_s += step_time - self.step_times.get(step, 0.0)  # a replayed step replaces its time
            self.step_times[step] = step_time
            metric = dict(step=step, loss=loss, world_size=world, global_batch_size=gbs,
                          samples_per_s=gbs / step_time if step_time > 0 else 0.0, step_time_s=step_time,
                          data_wait_s=slowest["data_wait_s"], compute_s=slowest.get("compute_s"),
                          comm_s=slowest.get("comm_s"),
                          checkpoint_wait_s=max(r.get("checkpoint_wait_s", 0.0) for r in per_rank),
                          tokens_per_s=tokens / step_time if tokens and step_time > 0 else None,
                          # When the step ended (its slowest rank), not when the round came back.
                          ts=max(r.get("end_ts", now) for r in per_rank))
            self.rec.metric(**metric)
            records.append(metric)
            self.ckpt.note_wait(step, metric["checkpoint_wait_s"])
            goodput_so_far = self.kept_step_s / max(1e-9, now - self.t_start)
            self.telemetry.step(metric, self.restarts, goodput_so_far)
        self.data_log.record(start, values)
        if self.tracker is not None:
            self.tracker.steps(records, self.restarts, goodput_so_far)
        resized = self.pending_resize is not None
        if resized:
            p = self.pending_resize
            self.pending_resize = None
            record = self.rec.event("resize_finished", step=start, old_world_size=p.old_world_size,
                                    new_world_size=p.new_world_size, recovery_s=time.time() - p.t0,
                                    resumed_step=p.resumed_step, reason=p.reason,
                                    **{k: round(v, 4) for k, v in p.parts.items()})
            self.resizes.append(record)
        # The ETA's pace: the wall between round ends (the driver's time included), not counting a
        # round whose world was just formed (its recovery is not the pace of the steps to come).
        last, self._last_round_end = self._last_round_end, now
        self.pace.round(end - start, now - last if last is not None else step_time * (end - start), world,
                        steady=last is not None and not resized)
        self.rec.progress(Progress(end, self.cfg.max_steps, loss, metric["tokens_per_s"], metric["samples_per_s"],
                                   world, self.pace.eta_s(self.cfg.max_steps - end), self.ckpt.last_durable_step))

    def _result(self, error: str | None) -> Result:
        end = time.time()
        wall = end - self.t_start
        ok = self.state == State.FINISHED
        final = self.ckpt.latest() if self.state in (State.FINISHED, State.PREEMPTED) else None
        run_dir = self.rec.run_dir
        g = goodput.compute(read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "metrics.jsonl"), end_ts=end)
        status = "finished" if ok else "preempted" if self.state == State.PREEMPTED else "failed"
        if status == "failed" and self.traceback is not None and self.supervised:
            status = "driver_failed"  # a driver bug, not a decision: its supervisor restarts it
        result = Result(status=status, final_step=self.step,
                        final_loss=self.losses.get(self.step - 1), restarts=self.restarts,
                        world_sizes=self.world_sizes, goodput=g.goodput,
                        wall_s=wall, run_dir=str(run_dir), checkpoint=str(final.path) if final else None,
                        error=error, resizes=self.resizes, time_lost_s={k: round(v, 4) for k, v in g.lost_s.items()},
                        durable_step=self.ckpt.last_durable_step, traceback=self.traceback)
        if status == "preempted":
            pass  # the `preempted` event says it; the run is not over
        elif ok:
            self.rec.event("run_finished", step=self.step, final_loss=result.final_loss, restarts=self.restarts,
                           goodput=result.goodput, wall_s=wall, time_lost_s=result.time_lost_s,
                           durable_step=result.durable_step)
        else:
            self.rec.event("run_failed" if status == "failed" else "driver_failed", step=self.step, error=error,
                           traceback=self.traceback, durable_step=result.durable_step)
        self.rec.write_result(asdict(result))
        if self.tracker is not None:
            self.tracker.finish(asdict(result), status)
        return result

"""Goodput of a long run on a large fleet, simulated: which recovery policy, which checkpoint interval.

A discrete-event model of one training job on `nodes` nodes of `gpus_per_node` GPUs. Each GPU
fails as a Poisson process (per-GPU MTBF); a failure takes its whole node down until a
replacement arrives `replacement_s` later. Work is committed only when a checkpoint completes,
so a failure loses everything since the last one. Policies:

- shrink: re-form at once on the surviving nodes (`warm_recovery_s`, airay's measured warm
  recovery), train at the reduced size, and grow back at the next checkpoint boundary once a
  replacement is up (another `warm_recovery_s`, no work lost: airay checkpoints before growing).
- wait: wait for the replacement, then re-form at full size (`warm_recovery_s`).
- restart: wait for the replacement, then restart every process cold (`cold_restart_s`).

Goodput = GPU-seconds of committed training / (all GPUs x wall time). Throughput is taken as
linear in the number of live GPUs (the global batch is fixed; fewer GPUs take longer per step).
Failures can strike during recoveries and checkpoints too, as they do on real fleets; that is
what makes the restart policy match Daly's closed form exactly (see `daly_goodput`).
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import asdict, dataclass, replace
from importlib.resources import files

import numpy as np

POLICIES = ("shrink", "wait", "restart")

# airay's own numbers: airay/measured.json, written by benchmarks/run.py from the stored run of
# benchmarks/recovery.py (benchmarks/results/recovery.json: median warm recovery_s, median cold
# start of the same checkpoint), with that run's command and date. Never edited by hand.
MEASURED = json.loads(files("airay").joinpath("measured.json").read_text())
MEASURED_WARM_RECOVERY_S: float = MEASURED["warm_recovery_s"]
MEASURED_COLD_RESTART_S: float = MEASURED["cold_restart_s"]


@dataclass(frozen=True)
class Fleet:
    gpus: int = 4096
    gpus_per_node: int = 8
    mtbf_gpu_hours: float = 50_000.0  # per GPU: a 4096-GPU fleet then fails every ~12 h
    replacement_s: float = 1800.0  # a failed node is back (repaired or replaced) after this long
    min_fraction: float = 0.5  # shrink: below this share of nodes alive, wait for replacements

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def fleet_mtbf_s(self) -> float:
        """Mean time between failures of the whole fleet at full size."""
        return self.mtbf_gpu_hours * 3600.0 / self.gpus


@dataclass(frozen=True)
class Costs:
    checkpoint_s: float = 30.0  # training time blocked per checkpoint
    warm_recovery_s: float = MEASURED_WARM_RECOVERY_S
    cold_restart_s: float = MEASURED_COLD_RESTART_S


@dataclass
class SimResult:
    policy: str
    gpus: int
    interval_s: float
    goodput: float
    failures: int
    lost_work_share: float  # of all GPU time: committed-then-lost work
    recovery_share: float  # in recoveries, waits and grows
    checkpoint_share: float
    degraded_share: float  # GPUs idle on dead nodes while the shrunk world trains on

    def as_dict(self) -> dict:
        return asdict(self)


def young_daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's optimum checkpoint interval (work time between checkpoints); Young's sqrt(2CM)
    with Daly's first correction, valid for C < 2M."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    return math.sqrt(2 * checkpoint_s * mtbf_s) - checkpoint_s


def daly_goodput(interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Exact expected goodput of checkpoint/restart under exponential failures (Daly 2006): one
    segment of `interval_s` work plus its checkpoint takes M e^{R/M} (e^{(tau+C)/M} - 1) on average."""
    m = mtbf_s
    return interval_s / (m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m))


class _Sim:
    def __init__(self, fleet: Fleet, costs: Costs, policy: str, interval_s: float, seed: int,
                 failure_times: tuple[float, ...] | None = None):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if fleet.gpus % fleet.gpus_per_node:
            raise ValueError(f"gpus ({fleet.gpus}) must be a multiple of gpus_per_node ({fleet.gpus_per_node})")
        self.f, self.c, self.policy, self.tau = fleet, costs, policy, interval_s
        self.rng = np.random.default_rng(seed)
        self.t = 0.0
        self.alive = fleet.nodes
        self.world = fleet.nodes  # nodes in the training world
        self.returns: list[float] = []  # heap of times failed nodes come back
        self.failures = 0
        self.gpu_s = {"useful": 0.0, "lost": 0.0, "recovery": 0.0, "checkpoint": 0.0}
        self.per_node_rate = fleet.gpus_per_node / (fleet.mtbf_gpu_hours * 3600.0)
        # A given schedule replaces the random failures (to replay a measured run).
        self.schedule = sorted(failure_times) if failure_times is not None else None

    # A phase is `d` seconds of wall time; it ends early at the first failure of a live node.
    def _phase(self, d: float) -> tuple[float, bool]:
        self._collect_returns()
        hit = self._next_failure_in()
        if hit < d:
            if self.schedule is not None:
                self.schedule.pop(0)
            self.t += hit
            self.alive -= 1
            self.failures += 1
            heapq.heappush(self.returns, self.t + self.f.replacement_s)
            return hit, True
        self.t += d
        return d, False

    def _next_failure_in(self) -> float:
        if self.schedule is not None:
            while self.schedule and self.schedule[0] < self.t:
                self.schedule.pop(0)  # struck while no node was up to fail: nothing to take down
            return self.schedule[0] - self.t if self.schedule and self.alive > 0 else math.inf
        rate = self.alive * self.per_node_rate
        return self.rng.exponential(1.0 / rate) if rate > 0 else math.inf

    def _collect_returns(self) -> None:
        while self.returns and self.returns[0] <= self.t:
            heapq.heappop(self.returns)
            self.alive += 1

    def _charge(self, kind: str, seconds: float, nodes: int) -> None:
        self.gpu_s[kind] += seconds * nodes * self.f.gpus_per_node

    def _recover(self, end: float) -> None:
        """After a failure: (wait, then) re-form. Repeats if another failure strikes meanwhile."""
        need = self.f.nodes if self.policy != "shrink" else math.ceil(self.f.min_fraction * self.f.nodes)
        cost = self.c.cold_restart_s if self.policy == "restart" else self.c.warm_recovery_s
        while self.t < end:
            self._collect_returns()
            if self.alive < need:  # wait for the next node back (failures may strike meanwhile)
                wait = min(self.returns[0], end) - self.t
                spent, _ = self._phase(wait)
                self._charge("recovery", spent, self.f.nodes)
                continue
            spent, failed = self._phase(min(cost, end - self.t))
            self._charge("recovery", spent, self.f.nodes)
            if not failed:
                self.world = self.alive if self.policy == "shrink" else self.f.nodes
                return

    def run(self, duration_s: float) -> SimResult:
        end = duration_s
        while self.t < end:
            # One segment: train `tau` seconds, then checkpoint; committed only if both complete.
            world = self.world
            spent, failed = self._phase(min(self.tau, end - self.t))
            if not failed and self.t < end:
                c_spent, failed = self._phase(min(self.c.checkpoint_s, end - self.t))
                spent += c_spent
            if failed:
                self._charge("lost", spent, world)
                self._recover(end)
                continue
            self._charge("useful", min(self.tau, spent), world)
            self._charge("checkpoint", max(0.0, spent - self.tau), world)
            if self.policy == "shrink":
                self._collect_returns()
                if self.alive > self.world and self.t < end:  # grow at the checkpoint boundary
                    g_spent, failed = self._phase(min(self.c.warm_recovery_s, end - self.t))
                    self._charge("recovery", g_spent, self.f.nodes)
                    if failed:
                        self._recover(end)
                    else:
                        self.world = self.alive
        total = self.f.gpus * self.t
        useful = self.gpu_s["useful"]
        accounted = sum(self.gpu_s.values())
        return SimResult(self.policy, self.f.gpus, self.tau, useful / total, self.failures,
                         self.gpu_s["lost"] / total, self.gpu_s["recovery"] / total,
                         self.gpu_s["checkpoint"] / total, max(0.0, (total - accounted) / total))


def simulate(fleet: Fleet, costs: Costs, policy: str, interval_s: float | None = None,
             days: float = 14.0, seed: int = 0, failure_times: list[float] | None = None) -> SimResult:
    """One simulated run of `days`; `interval_s` None means Daly's optimum for the fleet.
    `failure_times` (seconds from the start) replaces the random failures: one node fails at each."""
    tau = interval_s if interval_s is not None else young_daly_interval(costs.checkpoint_s, fleet.fleet_mtbf_s)
    if tau <= 0:
        raise ValueError(f"checkpoint interval must be > 0 s, got {tau}")
    times = tuple(failure_times) if failure_times is not None else None
    return _Sim(fleet, costs, policy, tau, seed, times).run(days * 86400.0)


def replay_measured(measured: dict, ckpt_every: int) -> SimResult:
    """The simulator's goodput for a run measured here (benchmarks/raytrain.py's `measured`): the
    same world, faults at the same moments, its measured step, checkpoint, recovery and
    replacement times; shrink-and-continue, as airay does. Comparable with the run's window
    goodput (kept steps at full-world step time / time from the first world formed to the end)."""
    fleet = Fleet(gpus=measured["full_world"], gpus_per_node=1,
                  replacement_s=measured["replacement_s"] if measured["replacement_s"] is not None else math.inf,
                  min_fraction=0.5)
    # resize_finished's recovery_s ends with the first step at the new size: kept work, not lost.
    costs = Costs(checkpoint_s=measured["blocking_s"],
                  warm_recovery_s=max(0.0, measured["recovery_s"] - measured["step_s"]))
    return simulate(fleet, costs, "shrink", interval_s=ckpt_every * measured["step_s"],
                    days=measured["window_s"] / 86400.0, failure_times=measured["fault_offsets_s"])


def predicted_goodput(measured: dict, ckpt_every: int) -> float:
    """replay_measured's goodput in airay.goodput's definition: the measured start-up (launch ->
    first world formed, which the simulator does not model) added to the wall time."""
    sim = replay_measured(measured, ckpt_every)
    return sim.goodput * measured["window_s"] / (measured["window_s"] + measured["startup_s"])


def compare(gpu_counts: list[int], fleet: Fleet, costs: Costs, interval_s: float | None = None,
            days: float = 14.0, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Median goodput per (fleet size, policy) over `repeats` seeds."""
    rows = []
    for gpus in gpu_counts:
        f = replace(fleet, gpus=gpus)
        for policy in POLICIES:
            runs = [simulate(f, costs, policy, interval_s, days, seed + i) for i in range(repeats)]
            good = sorted(r.goodput for r in runs)
            med = runs[[r.goodput for r in runs].index(good[len(good) // 2])]
            rows.append({**med.as_dict(), "goodput_min": good[0], "goodput_max": good[-1],
                         "fleet_mtbf_h": f.fleet_mtbf_s / 3600.0})
    return rows

"""docs/FAULTS.md from the fault matrix's measured results.

    AIRAY_FAULT_RESULTS=fault_results.json python -m pytest -q tests/test_fault_matrix.py
    python -m airay.faults_doc fault_results.json > docs/FAULTS.md

MATRIX is the documented outcome of each fault; tests/test_fault_matrix.py asserts every case
ends that way, and tests/test_faults_doc.py checks docs/FAULTS.md lists exactly these cases.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    fault: str  # what the spec's chaos entry (and health fields) say
    detected: str
    action: str
    outcome: str  # recovered | failed fast | continued


MATRIX: dict[str, Row] = {
    "kill_worker": Row(
        "`kill_worker` (SIGKILL a rank mid-step)",
        "the rank's train call fails with RayActorError (actor died)",
        "survivors abort their collectives, the world shrinks, reloads the last checkpoint, regrows when the "
        "replacement in the same bundle is ready",
        "recovered"),
    "kill_node": Row(
        "`remove_node` (a node's raylet and processes die; `add_node` later)",
        "RayActorError 'unavailable', then Ray's health check declares the node dead (`node_lost`)",
        "shrink to the survivors; Ray re-places the dead node's bundles on free capacity; regrow",
        "recovered"),
    "hang_sleep": Row(
        "`hang_worker` `hang_mode: sleep` (a blocking call inside the step)",
        "heartbeat (control thread) answers but the rank's progress (step, micro-batch, phase) stands "
        "still for `timeouts.hang_timeout_s` while it is the furthest behind (`hang_detected`, heartbeat true)",
        "ray.kill the hung actor and its node's other ranks (`evicted_ranks`), then recover like a crash",
        "recovered"),
    "hang_sigstop": Row(
        "`hang_worker` `hang_mode: sigstop` (the whole process stops)",
        "heartbeat stops answering and progress stands still for `hang_timeout_s` (`hang_detected`, heartbeat false)",
        "ray.kill the stopped actor and its node's other ranks, then recover like a crash",
        "recovered"),
    "all_ranks_stall": Row(
        "`stall_collective` (`collective: k`: a rank blocks just before its k-th collective call of the step; its "
        "peers enter that call and wait inside it, so every rank stands still at one point, as under NCCL when one "
        "GPU or link stops)",
        "every rank's progress stands still for `timeouts.hang_timeout_s`; the heartbeats' collective counts (calls "
        "entered and left in the phase; torch's per-group counters where every rank reports them) show one rank "
        "never entered the call the others wait in: it alone is the furthest behind (`hang_detected`, heartbeat "
        "true, `evicted_ranks`)",
        "ray.kill it and its node's other ranks (one failure), shrink to the other nodes, reload the last "
        "checkpoint, regrow when the replacements in the same bundles are ready",
        "recovered"),
    "raise_in_user_code": Row(
        "`raise_in_user_code` (the loss function raises)",
        "the rank's call raises UserCodeError (the worker wraps exceptions from model, loss and data code)",
        "fail the run at once with the rank and the user's traceback (`run_failed`); no restart",
        "failed fast"),
    "raise_with_retry": Row(
        "`raise_in_user_code` with `health.retry_user_errors: 1`",
        "as above",
        "retry from the last checkpoint, at most `retry_user_errors` times; then fail fast",
        "recovered"),
    "oom_worker": Row(
        "`oom_worker` (address space capped just above use, allocate until MemoryError)",
        "the rank's call raises MemoryError: an infrastructure fault (`worker_failed`, outcome oom)",
        "replace the worker (fresh process), recover like a crash",
        "recovered"),
    "corrupt_checkpoint": Row(
        "`corrupt_checkpoint` (flip bytes in every copy of a file of the newest checkpoint, then kill `rank`)",
        "the ranks that read the file find its CRC-32 differs from the manifest's in every copy "
        "(`checkpoint_rejected`, per tier)",
        "drop its memory copies, set the durable one aside (rejected_step_N), load the previous good "
        "checkpoint, replay from there",
        "recovered"),
    "slow_worker": Row(
        "`slow_worker` (a rank sleeps `delay_s` per step for `steps` steps)",
        "a rank's median local step time (data + forward, before collectives) over its last "
        "`health.straggler_window_steps` steps > `health.straggler_factor` x the others' (`straggler_detected`)",
        "report it and train on (no restart)",
        "continued"),
    "bad_node": Row(
        "two `kill_worker` faults on ranks of the same node, `health.exclude_node_after_failures: 2`",
        "per-node failure count reaches the threshold (`node_excluded`)",
        "kill the node's workers, keep it out of placement (label selector `ray.io/node-id: !in(...)` on new "
        "placement groups), regrow on other nodes",
        "recovered"),
    "kill_in_save": Row(
        "`kill_worker` `during: save` (a rank dies inside a checkpoint save)",
        "its save call fails (actor died); the step is not committed (`checkpoint_failed`, tier memory)",
        "recover like a crash from the checkpoint before; the unfinished step's files are never committed",
        "recovered"),
    "kill_in_form": Row(
        "`kill_worker` `during: form` (a rank dies while a world forms)",
        "its join fails (actor died); ranks waiting for it in the rendezvous are woken (their store "
        "connections shut down) instead of waiting for the collective timeout",
        "drop it and form the world again with the others",
        "recovered"),
    "kill_in_load": Row(
        "`kill_worker` `during: load` (a rank dies inside the checkpoint load)",
        "its load call fails (actor died); the others' load collectives fail with it",
        "drop it, form the world again, load again",
        "recovered"),
    "hang_in_save": Row(
        "`hang_worker` `during: save` (a rank blocks inside a save)",
        "its progress inside the save stands still for `timeouts.phase_timeout_s` while it is the furthest "
        "behind (`hang_detected`, phase save)",
        "ray.kill it and its node's other ranks, recover like a crash from the checkpoint before",
        "recovered"),
    "kill_driver": Row(
        "`kill_driver` (the driver process is SIGKILLed at a round start)",
        "`airay run`'s supervisor: the driver process ended by a signal; detect = until the new driver "
        "records `driver_restarted`",
        "kill what the driver left in its session, start a new driver on the same run directory (at most "
        "`health.max_driver_restarts` times); it resumes from the newest checkpoint; recover = kill to its world",
        "recovered"),
    "broken_storage": Row(
        "`break_storage` (every write to the durable checkpoint directory fails)",
        "uploads fail (NotADirectoryError); each is retried `checkpoint.upload_retries` times "
        "(`checkpoint_retry`), then `checkpoint_failed` with the newest durable step",
        "train on with memory-tier checkpoints; `health.max_checkpoint_failures` consecutive failures, or a "
        "final or preemption checkpoint that is not durable, fail the run with the reason and the newest "
        "durable step",
        "failed"),
    "failure_budget": Row(
        "two `kill_worker` faults with `max_failures: 1`",
        "more than `max_failures` failures within `health.failure_window_s`",
        "fail the run with a summary of the failures (kinds, ranks, nodes, steps)",
        "failed fast"),
}


@dataclass(frozen=True)
class Tested:
    fault: str
    detected: str
    action: str
    outcome: str
    where: str  # the tests (and benchmarks) that run it


# Faults run by other tests than the matrix (their own clusters, or no cluster: a scripted group
# or the classifier alone): what airay does, and where it is checked.
ELSEWHERE: dict[str, Tested] = {
    "memory_pressure": Tested(
        "the memory tier outgrows the node (large checkpoints, several kept steps and their peer copies "
        "in /dev/shm beside the workers)",
        "each save is planned against every node's tier budget (`checkpoint.memory_budget_fraction` of its "
        "RAM or `memory_budget_gb`, capped by /dev/shm's room; `memory_budget`, `checkpoint_budget`); a rank "
        "Ray's memory monitor kills: `worker_failed` outcome `oom` with its node's memory figures",
        "drop the oldest kept steps, then the peer copies of steps being uploaded, then the new step's peer "
        "copies to nodes that would overflow, then skip the save; "
        "after an out-of-memory loss halve that machine's budget and prune every tier to its newest step "
        "before the replacement starts (`memory_tier_reduced`)",
        "continued",
        "`tests/test_checkpoint_tiers.py` (tiers measured on disk), `tests/test_controller.py`, "
        "`benchmarks/memory_pressure.py` (issue 28's 100M-parameter scenario)"),
    "cluster_wide_incident": Tested(
        "`kill_worker` on ranks of most nodes at once (a cause of the cluster's: memory pressure, a storage "
        "outage, a bad driver)",
        "one incident (a failed round, save, join or load) struck over half the world's nodes "
        "(`incident_not_counted`); an incident otherwise counts once per node, however many ranks it took",
        "recover; no node's count toward `health.exclude_node_after_failures` grows; an exclusion that "
        "would leave too little room for `scaling.min_workers` ends the run at once with the reason",
        "recovered",
        "`tests/test_checkpoint_tiers.py`, `tests/test_controller.py`"),
    "device_error": Tested(
        "`device_error` (a device-side assert on the rank's GPU: an out-of-range index in a CUDA tensor; on "
        "CPU, `torch.AcceleratorError` with CUDA's message)",
        "the rank's call raises GPUError: the worker names CUDA's error wherever it surfaces (loss, backward, "
        "optimizer step, join, save, load) (`worker_failed`, outcome gpu_error)",
        "kill the rank's process (its CUDA context is never reused), start a replacement in its bundle, "
        "recover like a crash from the last checkpoint, regrow",
        "recovered",
        "`tests/test_fault_matrix.py` (device_error test), `tests/test_failures.py` (each class by message and "
        "type), `benchmarks/gpu_errors.py` (a real device-side assert; not yet run on a GPU)"),
    "nccl_error": Tested(
        "NCCL's own failure on one rank (ncclSystemError / ncclInternalError, no peer named)",
        "NCCLError on that rank while the others report a peer's failure (`worker_failed`, outcome "
        "nccl_error); every rank reporting one is the network's (comm_error)",
        "replace that rank as for a GPU error; otherwise re-form the same world",
        "recovered",
        "`tests/test_failures.py`, `tests/test_controller.py`"),
    "raise_in_airay": Tested(
        "`raise_in_airay` (airay's own code raises an IndexError inside the step)",
        "the rank's call raises InternalError: innermost frame in airay, not a collective's, not one of "
        "airay's named outcomes (`worker_failed`, outcome internal_error, with rank and traceback)",
        "re-form the same world and reload the last checkpoint, once per run; the second time fail the run "
        "with the rank, the phase and the traceback (`run_failed`), before the failure budget",
        "recovered, then failed fast",
        "`tests/test_fault_matrix.py` (device_error test), `tests/test_controller.py`"),
    "memory_monitor": Tested(
        "Ray's memory monitor kills a rank (its node ran low on memory)",
        "OutOfMemoryError / ActorDiedError saying \"killed due to the node running low on memory\" "
        "(`worker_failed`, outcome oom, with the node's memory figures)",
        "halve that machine's memory-tier budget and prune the tiers, replace the worker, recover like a crash",
        "recovered",
        "`tests/test_failures.py`, `tests/test_controller.py`"),
}


def _num(v, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _path(results: dict) -> str:
    """The results file the command wrote (its AIRAY_FAULT_RESULTS=...)."""
    return results["command"].split("=", 1)[1].split()[0]


def render(results: dict) -> str:
    cases = results["cases"]
    lines = [
        "# Fault matrix",
        "",
        "What airay does for each fault, as `tests/test_fault_matrix.py` runs it against a real multi-node "
        "Ray cluster (`ray.cluster_utils`, 3 nodes x 2 CPUs on one machine; 4 workers, tiny GPT, ZeRO-2, "
        f"{results['max_steps']} steps, checkpoint every {results['every_n_steps']}, "
        f"`timeouts.hang_timeout_s: {results['hang_timeout_s']}`). Every recovered run's committed losses "
        "equal the fault-free run's at every step (rtol 1e-4).",
        "",
        "Times are seconds measured in that run on this machine "
        f"({results['machine']}): **detect** = from the fault striking to airay noticing it (for a hang "
        "this includes `hang_timeout_s`); **recover** = `recovery_s`, from detection to the first completed "
        "step of the new world; for failed-fast faults, **detect** is the time to `run_failed`.",
        "",
        f"Generated by `{results['command']}` then `python -m airay.faults_doc {_path(results)} > docs/FAULTS.md` "
        f"({results['date']}). Rows from one run show that run's world sizes: kill_worker and "
        "corrupt_checkpoint are one run (a kill at step 6, the corruption and a kill at step 12), so are the "
        "two hang modes (steps 6 and 13), oom_worker with the retried user error (steps 6 and 12), and the "
        "faults outside a round: kills in a save, then in the join and the load of the recovery that follows "
        "(one recovery, its time on the load row), and a hang in a later save.",
        "",
        "| fault | detected by | airay does | outcome | world sizes | resumed step | detect s | recover s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in MATRIX.items():
        c = cases.get(name)
        if c is None:
            raise ValueError(f"results lack case '{name}': run the whole tests/test_fault_matrix.py")
        lines.append(f"| {row.fault} | {row.detected} | {row.action} | {c['outcome']} | "
                     f"{c.get('world_sizes') or '-'} | {_num(c.get('resumed_step'), '{}')} | "
                     f"{_num(c.get('detect_s'))} | {_num(c.get('recover_s'))} |")
    lines += [
        "",
        "## Tested elsewhere",
        "",
        "Faults other tests run (their own clusters, a scripted worker group, or the classifier alone); no "
        "times here, see each test.",
        "",
        "| fault | detected by | airay does | outcome | tested by |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {t.fault} | {t.detected} | {t.action} | {t.outcome} | {t.where} |" for t in ELSEWHERE.values()]
    lines += [
        "",
        "Notes:",
        "",
        "- `timeouts.hang_timeout_s` (default 60) must exceed the slowest phase of a step (one micro-batch's "
        "forward, backward or optimizer step; progress is reported per phase, not per step) and be below "
        "`timeouts.collective_timeout_s` (checked when the spec loads), so the hung rank is named before "
        "its peers' collectives time out. Joins, saves and loads report their progress too: a rank without "
        "progress for `timeouts.phase_timeout_s` (default 600) in one of them is hung. Every driver wait on "
        "the ranks is bounded by one of the two; commits and uploads by their own deadlines. Detection takes hang_timeout_s plus up to two heartbeat polls "
        "(every min(1 s, hang_timeout_s / 4)): the driver reads a heartbeat one poll after asking for it.",
        "- A rank is hung when its progress (step, micro-batch, phase, and the collective calls it entered and left "
        "in that phase) stood still for `hang_timeout_s` (`timeouts.first_step_timeout_s` in its first step of a new "
        "world) and either its heartbeat stopped answering (of several, the first to stop) or it is the furthest "
        "behind: the others wait for it in a collective. When one rank stalls its collective (`stall_collective`; "
        "one GPU or link under NCCL), every rank stands still at one step, micro-batch and phase, and the collective "
        "counts name the rank that never entered the call the others wait in. Only if every rank stands at exactly "
        "the same place, the same collective entered by all, are all hung (a deadlock). A hung rank's node goes "
        "with it: its other ranks are replaced too (`evicted_ranks` of `hang_detected`), counted as one failure.",
        "- Infrastructure faults (actor or node death, hang, MemoryError / Ray OutOfMemoryError or a kill by Ray's "
        "memory monitor, a CUDA error, lost objects) recover; exceptions in user code fail fast unless `health.retry_user_errors` allows a bounded number "
        "of retries. Every recovery counts against `max_failures` within `health.failure_window_s`; "
        "`health.restart_backoff_s` adds a doubling wait for recurring failures.",
        "- Exceptions on a rank are named where they are raised (`airay/worker/failures.py`, by type, message and "
        "whose code raised them). A CUDA error (device-side assert, illegal address, ECC error, failed launch; "
        "`torch.AcceleratorError`) is infrastructure wherever it surfaces, in the loss, the backward, the optimizer "
        "step, a join, save or load (`worker_failed`, outcome `gpu_error`): the process is killed and replaced, its "
        "CUDA context never reused. NCCL's own failure (a system or internal error) is its rank's (`nccl_error`) only "
        "when it stands out: no other rank lost and not every rank reporting one. A peer's failure seen through NCCL "
        "(remote error, connection closed or reset, an aborted communicator, the watchdog's timeout) stays a "
        "communication error. An exception raised in airay's own code (`internal_error`) is retried once from the "
        "last checkpoint on the same world, then fails the run with the rank and the traceback. A rank killed by "
        "Ray's memory monitor is outcome `oom`. The chaos faults `device_error` (a real device-side assert on a CUDA "
        "device, simulated elsewhere) and `raise_in_airay` are run by `tests/test_fault_matrix.py` and on a GPU by "
        "`benchmarks/gpu_errors.py`; their rows are in the table of faults tested elsewhere.",
        "- An excluded node's placement groups are released once no worker of the run holds them "
        "(`placement_released`); a group with bundles on other nodes too keeps the excluded node's bundle "
        "until those are vacant (Ray cannot release one bundle of a group); new placement groups avoid the "
        "node by label selector.",
        "- Data faults (`lose_data_block`: a rank's rows of a step come from a block whose owner died; "
        "`stall_data_block`: from one that never arrives) are run by `tests/test_data_stream.py` on streamed "
        "parquet data: the fetch fails (ObjectLostError, or no block within `data.fetch_timeout_s`), the "
        "driver records `data_block_lost`, restarts the pipeline and re-runs the round on the same world "
        "from the newest checkpoint; no worker is replaced, samples and losses equal the fault-free run's.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m airay.faults_doc RESULTS.json > docs/FAULTS.md")
    with open(argv[0]) as f:
        sys.stdout.write(render(json.load(f)))


if __name__ == "__main__":
    main()

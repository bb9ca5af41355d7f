"""Each fault of the chaos spec against a real multi-node Ray cluster, with its documented outcome.

One cluster (3 raylets x 2 CPUs: 4 workers on two nodes, one node spare) serves the module; a
fault-free run is the baseline every recovered run's committed losses must equal (rtol 1e-4, the
tolerance argued in tests/test_elastic.py). Kill and node-loss recovery at length, ZeRO-3 and the
min_workers floor are covered by tests/test_elastic.py; here each fault runs once, short.

Measured detect/recover times go to the JSON named by AIRAY_FAULT_RESULTS (docs/FAULTS.md is
generated from it: python -m airay.faults_doc). The outcome of each case is airay.faults_doc.MATRIX's.
"""

import json
import os
import platform
import time

import pytest

from airay import JobConfig, fit
from airay.events import committed_losses, read_jsonl
from airay.faults_doc import MATRIX
from tests.conftest import assert_released, ray_cluster

pytestmark = pytest.mark.cluster

RTOL = 1e-4
STEPS = 20
EVERY = 5
HANG_TIMEOUT_S = 4.0


def spec(run_dir, chaos=(), **overrides):
    data = {
        "name": run_dir.name,
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": 0.05}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2}},
        "global_batch_size": 24, "micro_batch_size": 4, "max_steps": STEPS, "steps_per_round": 5,
        "scaling": {"min_workers": 2, "max_workers": 4},
        "checkpoint": {"every_n_steps": EVERY},
        "timeouts": {"capacity_wait_s": 30, "hang_timeout_s": HANG_TIMEOUT_S, "collective_timeout_s": 30,
                     "survivor_drain_s": 10},
        "chaos": list(chaos),
        "run_dir": str(run_dir),
    }
    data.update(overrides)
    return JobConfig.from_dict(data)


def events(result, *types):
    return [e for e in read_jsonl(f"{result.run_dir}/events.jsonl") if e["type"] in types]


@pytest.fixture(scope="module")
def cluster():
    with ray_cluster(nodes=3, cpus_per_node=2) as lc:
        yield lc


@pytest.fixture(scope="module")
def results():
    out = {"cases": {}}
    yield out["cases"]
    path = os.environ.get("AIRAY_FAULT_RESULTS")
    if path:
        out.update(max_steps=STEPS, every_n_steps=EVERY, hang_timeout_s=HANG_TIMEOUT_S,
                   machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   command=f"AIRAY_FAULT_RESULTS={path} python -m pytest -q tests/test_fault_matrix.py")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


@pytest.fixture(scope="module")
def baseline(cluster, tmp_path_factory):
    # No forward delay: it paces the faulty runs (a sleep), it does not change the math.
    result = fit(spec(tmp_path_factory.mktemp("base") / "baseline", model={"factory": "airay.models.tiny_gpt:build"}),
                 echo=False, local_cluster=cluster)
    assert result.status == "finished" and result.world_sizes == [4] and result.restarts == 0
    losses = committed_losses(result.run_dir)
    assert sorted(losses) == list(range(STEPS)) and losses[STEPS - 1] < losses[0] - 0.3  # it trained
    assert_released()
    return losses


def run(cluster, tmp_path, name, chaos, **overrides):
    result = fit(spec(tmp_path / name, chaos, **overrides), echo=False, local_cluster=cluster)
    assert_released()
    return result


def record(results, name, result, detect_s, outcome, failure_index=0):
    """Check the documented outcome and keep the measured times for docs/FAULTS.md."""
    assert outcome == MATRIX[name].outcome
    failures = [r for r in result.resizes if r["reason"] == "failure"][failure_index:]
    results[name] = {"outcome": outcome, "world_sizes": result.world_sizes, "detect_s": detect_s,
                     "recover_s": failures[0]["recovery_s"] if failures else None,
                     "resumed_step": failures[0]["resumed_step"] if failures else None,
                     "restarts": result.restarts, "wall_s": result.wall_s}


def assert_recovered(result, baseline, world_sizes_start=(4,), steps=STEPS):
    """Finished, shrank as expected (regrowth depends on how fast a replacement warms up on this
    busy machine; tests/test_elastic.py checks it on longer runs) and trained exactly like the
    fault-free run."""
    assert result.status == "finished" and result.final_step == steps, result.error
    assert tuple(result.world_sizes[:len(world_sizes_start)]) == tuple(world_sizes_start)
    losses = committed_losses(result.run_dir)
    assert sorted(losses) == list(range(steps))
    for step, loss in baseline.items():
        assert losses[step] == pytest.approx(loss, rel=RTOL), step


def test_kill_worker_then_corrupt_checkpoint(cluster, tmp_path, baseline, results):
    """A crash resumes from the newest checkpoint; after the step-10 checkpoint is corrupted, the
    next crash is rejected it (checksums) and resumes from step 5 instead."""
    result = run(cluster, tmp_path, "kill-corrupt", [{"fault": "kill_worker", "at_step": 6, "rank": 1},
                                                      {"fault": "corrupt_checkpoint", "at_step": 12, "rank": 1}])
    assert_recovered(result, baseline, (4, 3))
    kill, corrupt = events(result, "worker_failed")
    assert (kill["rank"], kill["outcome"], kill["step"]) == (1, "died", 6)
    assert (corrupt["rank"], corrupt["outcome"], corrupt["step"]) == (1, "died", 12)
    # Every copy of a file of step 10 is bad: its memory copies and its durable copy are given up.
    rejected = events(result, "checkpoint_rejected")
    assert {e["tier"] for e in rejected} == {"memory", "durable"}
    assert all(e["step"] == 10 and "crc32" in e["reason"] for e in rejected)
    loaded = [e["step"] for e in events(result, "checkpoint_loaded")]
    failures = [r for r in result.resizes if r["reason"] == "failure"]
    assert [r["resumed_step"] for r in failures] == [5, 5]  # the second fell back past step 10
    assert loaded[0] == 5 and 5 in loaded[1:] and 10 not in loaded
    record(results, "kill_worker", result, kill["detection_s"], "recovered")
    record(results, "corrupt_checkpoint", result, corrupt["detection_s"], "recovered", failure_index=1)


def test_kill_node(cluster, tmp_path, baseline, results):
    result = run(cluster, tmp_path, "node", [{"fault": "remove_node", "at_step": 6, "rank": 0},
                                              {"fault": "add_node", "at_step": 8}])
    assert_recovered(result, baseline, (4, 2))  # ranks 0 and 1 share the lost node
    lost = events(result, "node_lost")
    assert sorted(e["rank"] for e in lost) == [0, 1] and len({e["node_id"] for e in lost}) == 1
    record(results, "kill_node", result, min(e["detection_s"] for e in lost), "recovered")


def test_hangs_are_detected_killed_and_recovered(cluster, tmp_path, baseline, results):
    """A blocking call inside the step (heartbeat answers, progress stands still), then a stopped
    process (heartbeat silent). Each hung rank's node goes with it: the first hang leaves the
    other node's two ranks (ranks 0 and 1 from then on, whether or not the replacements have
    rejoined by step 13), and the second stops one of them."""
    result = run(cluster, tmp_path, "hang", [{"fault": "hang_worker", "at_step": 6, "rank": 1, "hang_mode": "sleep"},
                                              {"fault": "hang_worker", "at_step": 13, "rank": 1,
                                               "hang_mode": "sigstop"}])
    assert_recovered(result, baseline, (4, 2))  # ranks 0 and 1 share a node
    sleep, stop = events(result, "hang_detected")
    assert (sleep["rank"], sleep["step"], sleep["heartbeat"], sleep["evicted_ranks"]) == (1, 6, True, [0])
    assert (stop["rank"], stop["step"], stop["heartbeat"]) == (1, 13, False)  # a stopped process cannot answer
    assert sleep["node_id"] != stop["node_id"] and stop["evicted_ranks"] == [0]
    for hang in (sleep, stop):
        assert hang["stalled_s"] >= HANG_TIMEOUT_S and hang["detection_s"] >= HANG_TIMEOUT_S
    assert events(result, "worker_failed") == []  # the peers' aborted collectives are not failures
    record(results, "hang_sleep", result, sleep["detection_s"], "recovered")
    record(results, "hang_sigstop", result, stop["detection_s"], "recovered", failure_index=1)


def test_a_hang_of_every_rank_at_one_collective_replaces_only_the_node_that_stalled_first(cluster, tmp_path, baseline,
                                                                                         results):
    """At step 6 rank 1 stops just before its 2nd collective call of the step (stall_collective);
    its peers enter that collective and wait inside it. Every rank's step, micro-batch and phase
    then stand still at one point, as under NCCL when one GPU stops; the collective counts in the
    heartbeats show rank 1 never entered the call the others wait in: it alone is hung, and its
    node (rank 0 beside it) is replaced. The run trains on with the other node's two ranks."""
    result = run(cluster, tmp_path, "stall", [{"fault": "stall_collective", "at_step": 6, "rank": 1, "collective": 2}])
    assert_recovered(result, baseline, (4, 2))
    (hang,) = events(result, "hang_detected")
    assert (hang["rank"], hang["step"], hang["heartbeat"], hang["evicted_ranks"]) == (1, 6, True, [0])
    entered, left = hang["progress"]["collectives"]
    assert entered == left and hang["progress"]["step"] == 6  # stopped between two calls of step 6
    assert hang["stalled_s"] >= HANG_TIMEOUT_S and hang["deadline_s"] == HANG_TIMEOUT_S  # not a first step
    assert events(result, "worker_failed") == []  # the peers' aborted collectives are not failures
    (failure,) = [r for r in result.resizes if r["reason"] == "failure"]
    assert (failure["old_world_size"], failure["new_world_size"]) == (4, 2)
    assert [e["rank"] for e in events(result, "fault_injected")] == [1]
    record(results, "all_ranks_stall", result, hang["detection_s"], "recovered")


def test_user_code_error_fails_fast_with_rank_and_traceback(cluster, tmp_path, results):
    result = run(cluster, tmp_path, "raise", [{"fault": "raise_in_user_code", "at_step": 6, "rank": 1}])
    assert result.status == "failed" and result.restarts == 0 and result.world_sizes == [4]
    assert "user code failed on rank 1" in result.error and "ChaosError: chaos raise_in_user_code at step 6" \
        in result.error
    assert "Traceback" in result.error and "retry_user_errors" in result.error
    assert events(result, "resize_started") == []
    t_fault = events(result, "fault_injected")[0]["ts"]
    record(results, "raise_in_user_code", result, events(result, "run_failed")[0]["ts"] - t_fault, "failed fast")


def test_out_of_memory_recovers_and_user_error_is_retried_when_the_spec_opts_in(cluster, tmp_path, baseline,
                                                                                 results):
    result = run(cluster, tmp_path, "oom-retry", [{"fault": "oom_worker", "at_step": 6, "rank": 1},
                                                   {"fault": "raise_in_user_code", "at_step": 12, "rank": 0}],
                 health={"retry_user_errors": 1})
    assert_recovered(result, baseline, (4, 3))
    oom, user = events(result, "worker_failed")
    assert (oom["rank"], oom["outcome"], oom["step"]) == (1, "oom", 6) and "MemoryError" in oom["error"]
    assert (user["outcome"], user["step"]) == ("user_error", 12) and "rank 0" in user["error"]
    assert result.restarts == 2
    record(results, "oom_worker", result, oom["detection_s"], "recovered")
    t_raise = events(result, "fault_injected")[1]["ts"]
    record(results, "raise_with_retry", result, user["ts"] - t_raise, "recovered", failure_index=1)


def test_slow_worker_is_reported_as_straggler_and_training_goes_on(cluster, tmp_path, baseline, results):
    # Four ranks on two loaded cores: a rank's step now and then runs 0.2 s over the median on its own
    # (seen in CI: rank 0, 0.34 s against 0.11 s, before any fault), so the threshold is raised above
    # that noise and the injected delay well above the threshold.
    result = run(cluster, tmp_path, "slow", [{"fault": "slow_worker", "at_step": 6, "rank": 2, "delay_s": 0.6,
                                              "steps": 4}], health={"straggler_min_excess_s": 0.3})
    assert result.status == "finished" and result.world_sizes == [4] and result.restarts == 0
    (straggler,) = events(result, "straggler_detected")
    assert straggler["rank"] == 2 and 6 <= straggler["step"] < 10 and straggler["local_s"] >= 0.6
    assert committed_losses(result.run_dir) == pytest.approx(baseline, rel=RTOL)
    t_fault = events(result, "fault_injected")[0]["ts"]
    record(results, "slow_worker", result, straggler["ts"] - t_fault, "continued")


def test_bad_node_is_excluded_and_the_world_regrows_elsewhere(cluster, tmp_path, baseline, results):
    # Ranks are grouped by node: 0 and 1 share a node. Killing rank 0 twice (the second time it is
    # the former rank 1, renumbered after the first shrink) fails that node twice. min_workers 3
    # makes the run wait for workers on the spare node rather than race their warm-up.
    result = run(cluster, tmp_path, "badnode", [{"fault": "kill_worker", "at_step": 2, "rank": 0},
                                                 {"fault": "kill_worker", "at_step": 4, "rank": 0}],
                 health={"exclude_node_after_failures": 2}, scaling={"min_workers": 3, "max_workers": 4})
    assert_recovered(result, baseline, (4, 3))
    failed = events(result, "worker_failed")
    assert len(failed) == 2 and failed[0]["node_id"] == failed[1]["node_id"]
    bad = failed[0]["node_id"]
    (excluded,) = events(result, "node_excluded")
    assert excluded["node_id"] == bad and excluded["failures"] == 2 and excluded["step"] == 4
    formed = events(result, "world_formed")
    first = {w["node_id"] for w in formed[0]["workers"]}
    later = [f for f in formed if f["ts"] > excluded["ts"]]
    assert later and all(bad not in [w["node_id"] for w in f["workers"]] for f in later)
    assert len(later[0]["workers"]) >= 3  # regrown past the two survivors ...
    assert {w["node_id"] for w in later[0]["workers"]} - first  # ... on the node that was spare
    record(results, "bad_node", result, failed[1]["detection_s"], "recovered")


def test_failure_budget_fails_cleanly_with_a_summary(cluster, tmp_path, results):
    result = run(cluster, tmp_path, "budget", [{"fault": "kill_worker", "at_step": 3, "rank": 1},
                                                {"fault": "kill_worker", "at_step": 8, "rank": 1}],
                 max_failures=1, health={"failure_window_s": 600})
    assert result.status == "failed"
    assert "2 failures within health.failure_window_s=600s exceed max_failures=1" in result.error
    assert "died x2: ranks [1]" in result.error and "steps [3, 8]" in result.error
    assert events(result, "run_failed")[0]["error"] == result.error
    t_fault = events(result, "fault_injected")[-1]["ts"]
    record(results, "failure_budget", result, events(result, "run_failed")[0]["ts"] - t_fault, "failed fast")


def test_a_device_error_replaces_its_process_and_airays_own_error_fails_after_one_retry(cluster, tmp_path):
    """Not (yet) a row of docs/FAULTS.md, which a full measured run regenerates. Rank 1's device
    fails at step 3 (a device-side assert: on this CPU, torch.AcceleratorError with CUDA's message,
    raised where the loss runs): infrastructure, its process is killed and replaced. At step 6
    airay's own code raises on rank 0: the same world re-forms and reloads step 5; at step 8 it
    raises again: the run fails with the rank and the traceback, before the failure budget."""
    import ray

    result = run(cluster, tmp_path, "rank-errors", [{"fault": "device_error", "at_step": 3, "rank": 1},
                                                     {"fault": "raise_in_airay", "at_step": 6, "rank": 0},
                                                     {"fault": "raise_in_airay", "at_step": 8, "rank": 0}])
    assert result.status == "failed" and result.restarts == 2 and result.traceback is None, result.error
    assert "airay's own code failed on rank 0" in result.error
    assert "IndexError: chaos raise_in_airay at step 8 on rank 0" in result.error
    assert "Traceback" in result.error and "airay/chaos.py" in result.error and "please report it" in result.error
    gpu, internal = events(result, "worker_failed")
    assert (gpu["rank"], gpu["outcome"], gpu["step"]) == (1, "gpu_error", 3)
    assert "GPUError" not in gpu["error"] and "AcceleratorError: CUDA error: device-side assert" in gpu["error"]
    assert (internal["rank"], internal["outcome"], internal["step"]) == (0, "internal_error", 6)
    assert [e["step"] for e in events(result, "checkpoint_loaded")][-1] == 5
    # Rank 1's process was killed at its recovery, not at the run's end, and never trained again.
    formed = events(result, "world_formed")
    broken = formed[0]["workers"][1]["pid"]
    assert all(broken not in [w["pid"] for w in f["workers"]] for f in formed[1:])
    (actor,) = [a for a in ray.state.actors().values() if a["Pid"] == broken and a["ActorClassName"] == "TrainWorker"]
    assert actor["State"] == "DEAD" and actor["EndTime"] / 1000 < internal["ts"]


TIMEOUTS = {"capacity_wait_s": 30, "hang_timeout_s": HANG_TIMEOUT_S, "collective_timeout_s": 30,
            "survivor_drain_s": 10, "phase_timeout_s": 12}


def test_kills_and_a_hang_inside_save_form_and_load_are_recovered(cluster, tmp_path, baseline, results):
    """Faults outside a training round. At step 10 a rank is killed inside the save (step 10 is
    not committed: the run resumes from step 5); another inside the join of the world that
    re-forms; another inside the checkpoint load that follows. At step 15 a rank hangs inside
    the save (its heartbeat answers, its progress stands still for timeouts.phase_timeout_s).
    Each becomes a recovery like one in a round, with the phase named; none fails the run."""
    result = run(cluster, tmp_path, "phases", [
        {"fault": "kill_worker", "during": "save", "at_step": 10, "rank": 3},
        {"fault": "kill_worker", "during": "form", "at_step": 10, "rank": 2},
        {"fault": "kill_worker", "during": "load", "at_step": 5, "rank": 1},
        {"fault": "hang_worker", "during": "save", "at_step": 15, "rank": 0}],
        scaling={"min_workers": 1, "max_workers": 4}, timeouts=TIMEOUTS)
    assert_recovered(result, baseline, (4,))
    failed = events(result, "worker_failed")
    assert [(e["phase"], e["rank"], e["outcome"]) for e in failed] == [("save", 3, "died"), ("form", 2, "died"),
                                                                        ("load", 1, "died")]
    assert all(e["detection_s"] is not None and e["detection_s"] < 10 for e in failed)
    (uncommitted,) = [e for e in events(result, "checkpoint_failed") if e["step"] == 10]
    assert "rank 3 died during the save" in uncommitted["error"]
    loaded = [e["step"] for e in events(result, "checkpoint_loaded")]
    assert loaded[0] == 5  # the step-10 save never committed: the one before it
    (hang,) = events(result, "hang_detected")
    assert (hang["phase"], hang["rank"], hang["heartbeat"]) == ("save", 0, True)
    assert hang["stalled_s"] >= TIMEOUTS["phase_timeout_s"]
    # One recovery took the three kills in a row (a resize ends at the first step of its world).
    cascade, after_hang = [r for r in result.resizes if r["reason"] == "failure"][:2]
    for name, e in (("kill_in_save", failed[0]), ("kill_in_form", failed[1]), ("kill_in_load", failed[2]),
                    ("hang_in_save", hang)):
        results[name] = {"outcome": "recovered", "world_sizes": result.world_sizes, "detect_s": e["detection_s"],
                         "recover_s": cascade["recovery_s"] if name == "kill_in_load" else
                         after_hang["recovery_s"] if name == "hang_in_save" else None,
                         "resumed_step": cascade["resumed_step"] if name != "hang_in_save" else after_hang["resumed_step"],
                         "restarts": result.restarts, "wall_s": result.wall_s}
        assert MATRIX[name].outcome == "recovered"


def test_a_durable_storage_that_fails_every_write_fails_the_run_with_the_newest_durable_step(cluster, tmp_path,
                                                                                            baseline, results):
    """From step 7 every write to the checkpoint directory fails (a file takes its place). The
    uploads of the durable steps after it are retried and fail; two in a row
    (health.max_checkpoint_failures) end the run, which says why and which step is the newest durable one. Training itself was
    right all along, and the durable steps written before are intact."""
    from airay.checkpoint.tiers import DurableTier

    result = run(cluster, tmp_path, "storage", [{"fault": "break_storage", "at_step": 7}],
                 checkpoint={"every_n_steps": EVERY, "upload_retries": 1}, health={"max_checkpoint_failures": 2})
    assert result.status == "failed" and result.durable_step == 5
    assert "2 consecutive durable checkpoints failed" in result.error, result.error
    assert "The newest durable checkpoint is step 5" in result.error and "NotADirectoryError" in result.error
    # Step 15 may be superseded by 20 while 10's upload is still being retried (one upload at a
    # time, checkpoint_upload_skipped): the failures are 10 and the next durable step uploaded.
    failed = [e for e in events(result, "checkpoint_failed") if e["tier"] == "durable"]
    assert len(failed) >= 2 and failed[0]["step"] == 10 and failed[1]["step"] in (15, 20)
    assert all(e["newest_durable_step"] == 5 for e in failed) and [e["consecutive"] for e in failed[:2]] == [1, 2]
    retried = events(result, "checkpoint_retry")
    assert [e["step"] for e in retried][:2] == [e["step"] for e in failed[:2]] and all(e["of"] == 1 for e in retried)
    (failure,) = events(result, "run_failed")
    assert failure["error"] == result.error and failure["durable_step"] == 5
    losses = committed_losses(result.run_dir)
    assert losses == pytest.approx({s: baseline[s] for s in losses}, rel=RTOL) and max(losses) >= 14
    durable = DurableTier(str(tmp_path / "storage" / "checkpoints"), {"id": None}).complete()
    assert [c.step for c in durable] == [5]  # restored when the run ended, with what it held
    t_fault = events(result, "fault_injected")[0]["ts"]
    results["broken_storage"] = {"outcome": "failed", "world_sizes": result.world_sizes,
                                 "detect_s": failure["ts"] - t_fault, "recover_s": None, "resumed_step": None,
                                 "restarts": result.restarts, "wall_s": result.wall_s}
    assert MATRIX["broken_storage"].outcome == "failed"


def test_a_killed_driver_is_restarted_and_the_run_finishes(cluster, tmp_path, baseline, results, monkeypatch):
    """`airay run` supervises its driver: SIGKILLed at step 12, it is restarted, the new driver
    resumes from the newest checkpoint (step 10) on the same run directory and finishes, with
    the losses of the fault-free run. The same entrypoint runs under `airay submit` and
    `ray job submit`."""
    import subprocess
    import sys

    run_dir = tmp_path / "driver"
    spec_file = tmp_path / "driver.yaml"
    spec_file.write_text(spec(run_dir, [{"fault": "kill_driver", "at_step": 12}]).to_yaml())
    # Tracked in MLflow (a local file store, no server), and every event on the console (-v).
    store = tmp_path / "mlruns"
    proc = subprocess.run([sys.executable, "-m", "airay.cli", "run", str(spec_file), "-v"], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "RAY_ADDRESS": cluster.address,
                                                       "MLFLOW_TRACKING_URI": str(store)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[airay] the driver died (SIGKILL); restarting it (1 of 3)" in proc.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and result["final_step"] == STEPS and result["durable_step"] == STEPS
    all_events = read_jsonl(run_dir / "events.jsonl")
    (restart,) = [e for e in all_events if e["type"] == "driver_restarted"]
    assert (restart["attempt"], restart["previous_exit"]) == (1, "SIGKILL")
    assert [e["step"] for e in all_events if e["type"] == "resuming"] == [10]
    assert len([e for e in all_events if e["type"] == "fault_injected"]) == 1  # not again after the restart
    losses = committed_losses(run_dir)
    assert sorted(losses) == list(range(STEPS))
    for step, loss in baseline.items():
        assert losses[step] == pytest.approx(loss, rel=RTOL), step
    assert result["time_lost_s"]["driver_restart"] > 0
    assert_released()
    # -v: every event both drivers recorded is on the console, as a line of its own type.
    console = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("[airay] ")]
    for kind in {e["type"] for e in all_events}:
        assert console.count(kind) >= sum(e["type"] == kind for e in all_events), kind
    # One MLflow run across the restart: a loss per committed step, once (the replayed ones too).
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store when told
    client = MlflowClient(str(store))
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(STEPS))
    assert [m.value for m in history] == pytest.approx([losses[s] for s in range(STEPS)], rel=1e-6)
    assert run.data.params["global_batch_size"] == "24"
    assert "result.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    assert run.info.status == "FINISHED" and run.data.tags["airay.status"] == "finished"
    formed = [e for e in all_events if e["type"] == "world_formed" and e["ts"] > restart["ts"]]
    killed = [e for e in all_events if e["type"] == "fault_injected"][0]
    results["kill_driver"] = {"outcome": "recovered", "world_sizes": [e["world_size"] for e in all_events
                                                                      if e["type"] == "world_formed"],
                              "detect_s": restart["ts"] - killed["ts"], "recover_s": formed[0]["ts"] - killed["ts"],
                              "resumed_step": 10,
                              "restarts": 1, "wall_s": result["wall_s"]}
    assert MATRIX["kill_driver"].outcome == "recovered"

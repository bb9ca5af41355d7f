"""MLflow tracking (airay.observe.mlflow_tracking), read back with MlflowClient from a local file
store (no server): the real Controller with the scripted worker group of test_controller.py.
The supervised driver restart on a real cluster is in test_fault_matrix.py."""

import json

import pytest

from airay.observe.mlflow_tracking import flatten, new_steps
from tests.fake_group import step_loss
from tests.test_controller import STEPS, controller

mlflow = pytest.importorskip("mlflow")  # the test extra installs it (airay[mlflow])


def test_the_spec_flattens_to_params_and_a_replayed_step_is_logged_once():
    params = flatten({"name": "x", "deepspeed": {"zero_optimization": {"stage": 3}}, "chaos": [
        {"fault": "kill_worker", "at_step": 6}], "paths": ["a", "b"], "ray_address": None, "big": "y" * 7000})
    assert params["deepspeed.zero_optimization.stage"] == "3" and params["chaos.0.at_step"] == "6"
    assert params["paths"] == '["a", "b"]' and params["ray_address"] == "" and len(params["big"]) == 6000
    records = [{"step": s} for s in (4, 5, 6, 4, 5, 6, 7)]  # a round replayed after a failure
    assert [r["step"] for r in new_steps(records, None)] == [4, 5, 6, 7]
    assert [r["step"] for r in new_steps(records, 6)] == [7]  # a restarted driver: 6 was logged


def test_a_run_and_its_resume_are_one_mlflow_run_with_one_loss_per_step(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", str(store))
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "airay-tests")
    # Rank 1 dies in the third round (steps 10-14): the world shrinks and steps 10.. are replayed.
    ctl, _ = controller(tmp_path, {"train": {3: {1: "died"}}}, pipeline_rounds=False)
    result = ctl.run()
    assert result.status == "finished" and result.restarts == 1
    client = MlflowClient(str(store))
    (experiment,) = [e for e in client.search_experiments() if e.name == "airay-tests"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(STEPS))  # replayed steps not doubled
    assert [m.value for m in history] == pytest.approx([step_loss(s) for s in range(STEPS)])
    assert run.data.params["global_batch_size"] == "24" and run.data.params["scaling.max_workers"] == "4"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "restarts")][-1] == 1.0
    assert run.data.metrics["goodput"] == pytest.approx(result.goodput)
    assert run.data.tags["airay.status"] == "finished" and run.data.tags["airay.resizes"] == str(len(result.resizes))
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"result.json", "run.png"} <= artifacts
    stored = json.loads((tmp_path / "run" / "mlflow.json").read_text())
    assert stored["run_id"] == run.info.run_id

    # The same run directory, run again with more steps: the same MLflow run goes on.
    again, _ = controller(tmp_path, max_steps=STEPS + 5)
    assert again.run().status == "finished"
    (run,) = client.search_runs([experiment.experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == list(range(STEPS + 5))


def test_tracking_that_fails_never_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    ctl, _ = controller(tmp_path)
    assert ctl.run().status == "finished"
    from airay.events import read_jsonl

    failed = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["type"] == "tracking_failed"]
    assert len(failed) == 1 and failed[0]["action"] == "start"

"""`ray job submit` as users run it: a real Ray head started with `ray start --head`, the job
submitted through the real Job API (`airay submit`), followed with `airay logs` and `airay status`."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from airay.config import ConfigError
from airay.submit import prepare

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def airay(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "airay.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture
def ray_head():
    """A Ray head as `ray start --head` makes it, with the dashboard (the Job API lives there)."""
    dash = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    subprocess.run(["ray", "start", "--head", "--num-cpus", "3", "--port", str(free_port()),
                    "--dashboard-port", str(dash), "--include-dashboard", "true", "--disable-usage-stats"],
                   check=True, capture_output=True, timeout=120, env=env)
    try:
        yield f"http://127.0.0.1:{dash}"
    finally:
        subprocess.run(["ray", "stop", "--force"], capture_output=True, timeout=120)


def test_submit_follow_and_read_the_result(ray_head, tmp_path):
    run_dir = tmp_path / "small"
    sub = airay("submit", "jobs/small.yaml", "--address", ray_head, "--run-dir", str(run_dir),
                "--set", "max_steps=12")
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().splitlines()[-1]
    assert job_id and f"airay logs --job {job_id} --follow" in sub.stderr

    logs = airay("logs", "--job", job_id, "--address", ray_head, "--follow")
    assert logs.returncode == 0, logs.stdout[-3000:] + logs.stderr[-3000:]
    progress = [line for line in logs.stdout.splitlines() if line.startswith("[airay] step 12/12 |")]
    assert progress and progress[-1].startswith("[airay] step 12/12 | loss ")
    assert all("\r" not in line and "\x1b" not in line for line in progress)  # not a terminal: plain lines
    for part in ("tokens/s", "world", "eta"):
        assert part in progress[-1]

    status = airay("status", "--job", job_id, "--address", ray_head)
    assert status.returncode == 0 and f"job {job_id}: SUCCEEDED" in status.stdout
    assert "finished, step 12/12" in status.stdout  # the run directory's view, found through the job
    # Every reading command takes --job the same way (its run directory, readable here) and --json.
    status = json.loads(airay("status", "--job", job_id, "--address", ray_head, "--json").stdout)
    assert status["status"] == "SUCCEEDED" and status["run"]["step"] == 12 and status["run"]["run_dir"] == str(run_dir)
    events = airay("logs", "--job", job_id, "--address", ray_head, "--json").stdout.splitlines()
    assert json.loads(events[0])["type"] == "run_started" and json.loads(events[-1])["type"] == "run_finished"
    rows = json.loads(airay("checkpoints", "--job", job_id, "--address", ray_head, "--json").stdout)
    assert rows and rows[0]["step"] == 12 and rows[0]["status"] in ("verified", "committed")
    drawn = airay("plot", "--job", job_id, "--address", ray_head, "--out", str(tmp_path / "p.png"), "--json")
    assert json.loads(drawn.stdout)["path"] == str(tmp_path / "p.png"), drawn.stderr

    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "finished" and result["final_step"] == 12 and result["restarts"] == 1
    assert result["world_sizes"][:2] == [2, 1]  # the worker killed at step 6, on a cluster as it is
    assert 0 < result["goodput"] < 1 and set(result["time_lost_s"]) >= {"startup", "recovery"}


def test_submit_refuses_specs_a_running_cluster_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="cluster=null"):
        prepare("jobs/demo.yaml", ["chaos=[]"], None, str(ROOT))
    with pytest.raises(ConfigError, match="kill_worker faults only"):
        prepare("jobs/demo.yaml", ["cluster=null"], None, str(ROOT))
    outside = tmp_path / "job.yaml"
    outside.write_text((ROOT / "jobs" / "small.yaml").read_text())
    with pytest.raises(ConfigError, match="outside the working directory"):
        prepare(str(outside), [], None, str(ROOT))
    bad = airay("submit", "jobs/small.yaml", "--set", "scaling.max_wrokers=3", timeout=60)
    assert bad.returncode == 2 and "scaling.max_wrokers: unknown field" in bad.stderr
    job = prepare(str(ROOT / "jobs" / "small.yaml"), ["max_steps=8"], "/data/run", str(ROOT))
    assert job["entrypoint"] == "python jobs/train.py --config jobs/small.yaml --set max_steps=8 --run-dir /data/run"
    assert job["runtime_env"]["working_dir"] == str(ROOT) and "runs/" in job["runtime_env"]["excludes"]

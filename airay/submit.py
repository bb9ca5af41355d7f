"""Run jobs on a running Ray cluster through Ray's Job API: `airay submit`, `status --job`, `logs`.

`airay submit JOB.yaml` is `ray job submit --working-dir . -- python jobs/train.py --config
JOB.yaml` with the spec checked first (a bad spec fails here, before anything is uploaded) and
the run directory's uploads trimmed. The project directory is the job's working_dir, so the
cluster imports this checkout's `airay` and the user's model code from it on every node.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

from airay.config import ConfigError, JobConfig

# Not uploaded with the working_dir: run outputs (checkpoints can be large) and VCS data.
EXCLUDES = ["runs/", ".git/", "**/__pycache__/", "*.egg-info/", ".pytest_cache/"]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def entrypoint(spec: str, overrides: list[str], run_dir: str | None) -> str:
    args = ["python", "jobs/train.py", "--config", spec]
    for item in overrides:
        args += ["--set", item]
    if run_dir:
        args += ["--run-dir", run_dir]
    return shlex.join(args)


def prepare(spec: str, overrides: list[str], run_dir: str | None, working_dir: str = ".") -> dict[str, Any]:
    """Check the spec and build the submission: entrypoint and runtime_env. Raises ConfigError."""
    work = Path(working_dir).resolve()
    if not (work / "jobs" / "train.py").is_file():
        raise ConfigError(f"--working-dir {working_dir}: no jobs/train.py there; run from the airay project "
                          "directory or pass --working-dir PROJECT_DIR")
    path = Path(spec).resolve()
    try:
        rel = path.relative_to(work)
    except ValueError:
        raise ConfigError(f"job spec {spec} is outside the working directory {work}, so the cluster would not "
                          "get it; copy it under the project (e.g. jobs/) or pass --working-dir") from None
    config = JobConfig.from_yaml(path, overrides + ([f"run_dir={run_dir}"] if run_dir else []))
    if config.needs_local_cluster:
        raise ConfigError(f"{spec}: chaos remove_node/add_node act on raylets airay starts itself (a local "
                          "cluster); on a running cluster use kill_worker faults only")
    if config.cluster is not None:
        raise ConfigError(f"{spec}: `cluster:` starts a local Ray cluster, which a job on a running cluster "
                          "cannot do; remove it or add --set cluster=null")
    return {"entrypoint": entrypoint(rel.as_posix(), overrides, run_dir),
            "runtime_env": {"working_dir": str(work), "excludes": EXCLUDES,
                            "env_vars": {"PYTHONUNBUFFERED": "1"}},
            "metadata": {"airay_job": config.name},
            "config": config}


def client(address: str | None):
    """The Job API client. A cluster started with `ray start` uses token authentication when a
    token exists (~/.ray/auth_token); the client then sends it, as `ray job submit` does."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    from ray.job_submission import JobSubmissionClient

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    return JobSubmissionClient(address)


def submit(address: str | None, spec: str, overrides: list[str], run_dir: str | None,
           working_dir: str = ".") -> str:
    job = prepare(spec, overrides, run_dir, working_dir)
    return client(address).submit_job(entrypoint=job["entrypoint"], runtime_env=job["runtime_env"],
                                      metadata=job["metadata"])


def last_progress(logs: str) -> str | None:
    """The newest progress line of a job's output (airay.observe.console.progress_text)."""
    lines = [line for line in logs.splitlines() if PROGRESS.match(line)]
    return lines[-1] if lines else None


PROGRESS = re.compile(r"^\[airay\] step \d+/\d+ \| ")
RUN_DIRECTORY = re.compile(r"^\[airay\] run directory (\S+?),? ")  # the console's first line (run_started)


def job_run_dir(address: str | None, job_id: str) -> str:
    """A submitted job's run directory, as its console named it, where this machine can read it."""
    logs = client(address).get_job_logs(job_id)
    found = next((m.group(1) for m in map(RUN_DIRECTORY.match, logs.splitlines()) if m), None)
    if found is None:
        raise ConfigError(f"job {job_id} has not named its run directory yet (its run has not started); "
                          f"`airay logs --job {job_id}` shows its output so far")
    if not (Path(found) / "events.jsonl").is_file():
        raise ConfigError(f"job {job_id}'s run directory {found} is not on this machine (it is where the job's "
                          "driver runs, the cluster's head node): run this there, or give --run-dir a shared path "
                          "at submit")
    return found


def job_status_text(address: str | None, job_id: str) -> tuple[str, str]:
    """(status, a few lines about the job: status, entrypoint, last progress, run directory)."""
    c = client(address)
    info = c.get_job_info(job_id)
    status = str(getattr(info.status, "value", info.status))
    logs = c.get_job_logs(job_id)
    lines = [f"job {job_id}: {status}", f"entrypoint: {info.entrypoint}"]
    progress = last_progress(logs)
    if progress:
        lines.append(progress)
    # the summary: the lines after the last progress line, the run's end
    ends = [i for i, line in enumerate(logs.splitlines()) if line.startswith(("[airay] finished at", "[airay] failed at",
                                                                               "[airay] preempted at"))]
    lines += logs.splitlines()[ends[-1]:] if ends else []
    if info.message and status != "SUCCEEDED":
        lines.append(f"message: {info.message}")
    return status, "\n".join(lines)


def follow_logs(address: str | None, job_id: str, out) -> str:
    """Stream a job's logs to `out` until it ends; returns its final status."""
    import asyncio

    c = client(address)

    async def tail():
        async for chunk in c.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    asyncio.run(tail())
    return str(getattr(c.get_job_status(job_id), "value", c.get_job_status(job_id)))

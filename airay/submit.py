"""Run jobs on a running Ray cluster through Ray's Job API: `airay submit`, `status --job`, `logs`.

`airay submit JOB.yaml` is `ray job submit --working-dir . -- python jobs/train.py --config
JOB.yaml` with the spec checked first (a bad spec fails here, before anything is uploaded) and
the run directory's uploads trimmed. The project directory is the job's working_dir, so the
cluster imports this checkout's `airay` and the user's model code from it on every node.

The job's run directory is chosen at submission (the default runs/NAME-TIMESTAMP is named then)
and recorded in the job's metadata, so `--job ID` finds it: read on this machine where it is
here (an absolute path on a shared filesystem, or a local cluster's unpacked working_dir), else
it is on the cluster.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from airay.config import ConfigError, JobConfig, run_dir_for

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
    run_dir = str(run_dir_for(config.name, config.run_dir))  # named now, so the job's metadata can say it
    if config.needs_local_cluster:
        raise ConfigError(f"{spec}: chaos remove_node/add_node act on raylets airay starts itself (a local "
                          "cluster); on a running cluster use kill_worker faults only")
    if config.cluster is not None:
        raise ConfigError(f"{spec}: `cluster:` starts a local Ray cluster, which a job on a running cluster "
                          "cannot do; remove it or add --set cluster=null")
    return {"entrypoint": entrypoint(rel.as_posix(), overrides, run_dir),
            "runtime_env": {"working_dir": str(work), "excludes": EXCLUDES,
                            "env_vars": {"PYTHONUNBUFFERED": "1"}},
            "metadata": {"airay_job": config.name, "airay_run_dir": run_dir,
                         "airay_checkpoint_path": config.checkpoint.path or ""},
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


def job_run_dir(address: str | None, job_id: str) -> str:
    """A submitted job's run directory, where this machine can read it (see job_run)."""
    job = job_run(address, job_id)
    if job.here is None:
        raise ConfigError(job.not_here())
    return job.here


@dataclass
class JobRun:
    """A submitted job and the run directory it trains in."""

    job_id: str
    status: str  # Ray's: PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED
    entrypoint: str
    message: str | None
    run_dir: str | None  # as the job names it: absolute, or relative to its working directory on the cluster
    here: str | None  # that directory on this machine, where it can be read here
    checkpoint_path: str | None  # the spec's checkpoint.path, where it names one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def not_here(self) -> str:
        """Why the run's files cannot be read here, and what to do."""
        if self.run_dir is None:
            return (f"job {self.job_id} names no run directory (not submitted by `airay submit`, and its "
                    "entrypoint has no --run-dir); give its RUN_DIR instead of --job")
        where = "in the job's working directory on the cluster" if not Path(self.run_dir).is_absolute() \
            else "on the cluster"
        return (f"job {self.job_id}'s run directory {self.run_dir} is {where}, not on this machine (yet); run "
                "this on the cluster's head node with RUN_DIR, or submit with --run-dir on a filesystem this "
                "machine shares")


def job_run(address: str | None, job_id: str) -> JobRun:
    """The job's status and run directory (from the metadata `airay submit` records, else the
    entrypoint's --run-dir). Raises RuntimeError for an unknown job, ConnectionError for a
    dashboard out of reach (Ray's Job API)."""
    info = client(address).get_job_info(job_id)
    meta = info.metadata or {}
    run_dir = meta.get("airay_run_dir") or _option(info.entrypoint, "--run-dir")
    return JobRun(job_id=job_id, status=str(getattr(info.status, "value", info.status)),
                  entrypoint=info.entrypoint, message=info.message, run_dir=run_dir,
                  here=run_dir_here(run_dir, (info.runtime_env or {}).get("working_dir")),
                  checkpoint_path=meta.get("airay_checkpoint_path") or None)


def _option(entrypoint: str, name: str) -> str | None:
    try:
        args = shlex.split(entrypoint or "")
    except ValueError:
        return None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg[len(name) + 1:]
    return None


def run_dir_here(run_dir: str | None, working_dir_uri: str | None) -> str | None:
    """The job's run directory as this machine sees it, or None: an absolute path that is a run
    directory here (a shared filesystem, or this machine's cluster), or a relative one under the
    job's working_dir as Ray unpacked it on this machine (a cluster whose head is this machine:
    RAY_TEMP/session_*/runtime_resources/working_dir_files/_ray_pkg_HASH)."""
    if not run_dir:
        return None
    if Path(run_dir).is_absolute():
        return run_dir if (Path(run_dir) / "events.jsonl").is_file() else None
    if not working_dir_uri:
        return None
    from ray._common.utils import get_default_ray_temp_dir

    package = working_dir_uri.rsplit("/", 1)[-1].removesuffix(".zip")
    sessions = sorted(Path(get_default_ray_temp_dir()).glob("session_2*"), reverse=True)  # newest first
    found = [s / "runtime_resources" / "working_dir_files" / package / run_dir for s in sessions]
    return next((str(p) for p in found if (p / "events.jsonl").is_file()), None)


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

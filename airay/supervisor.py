"""A supervised driver: `airay run` keeps the driver in a child process and restarts it when it dies.

The driver is a single point of failure: a bug, its own OOM or a SIGKILL ends every rank's work.
`airay run` (and so `airay submit` and `ray job submit -- airay run ...`, whose entrypoint it
is) runs the driver as a child process in its own session and waits for it:

- exit 0 (finished, preempted), 1 (the run failed: a decision with its reason) or 2 (bad input):
  the run is over, the supervisor exits with that code;
- anything else (killed by a signal, out of memory, an unhandled driver error: exit
  DRIVER_FAILED_EXIT): whatever the driver left in its session is killed (a local cluster's
  processes), and a new driver starts on the same run directory, up to
  health.max_driver_restarts times. It resumes from the newest checkpoint there (durable, or a
  memory tier the nodes still hold) and records `driver_restarted`.

A driver withdraws its autoscaler request (room for max_workers bundles) when its run ends; one
that died could not. When the supervisor gives up on it (restarts spent, or stopped by a signal),
it withdraws the request itself, so the autoscaler may scale the cluster down again.

SIGTERM and SIGINT are passed to the driver (a preemption notice, Ctrl-C) and end supervision.
The supervisor itself imports nothing heavy: it must outlive what kills the driver.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# The driver's exit code when it failed on an error that was not a decision of the run (a bug):
# EX_SOFTWARE. A restart may get past it (e.g. a transient error talking to the cluster).
DRIVER_FAILED_EXIT = 70
# Exit codes that end the run: finished or preempted, failed (with its reason), bad input.
FINAL_EXITS = (0, 1, 2)
# Environment the supervisor hands each driver.
ATTEMPT_ENV, PREVIOUS_EXIT_ENV, LAUNCHED_ENV = "AIRAY_DRIVER_ATTEMPT", "AIRAY_DRIVER_PREVIOUS_EXIT", "AIRAY_LAUNCHED_TS"


def exit_text(returncode: int) -> str:
    """How a child ended, in words: 'SIGKILL' for -9, 'exit 70', ..."""
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit {returncode}"


def should_restart(returncode: int, attempt: int, max_restarts: int, stopping: bool) -> bool:
    """Pure: restart the driver after it ended with `returncode` on its `attempt` (0 first)?"""
    return returncode not in FINAL_EXITS and not stopping and attempt < max_restarts


def cluster_address(spec: dict) -> str | None:
    """Pure: the Ray cluster a driver of this spec mapping connects to, as its fit() does (the
    spec's ray_address, else RAY_ADDRESS, else "auto": a cluster running on this machine); None
    for a spec whose driver starts its own local cluster (`cluster:`), gone with the driver."""
    if spec.get("cluster"):
        return None
    return spec.get("ray_address") or os.environ.get("RAY_ADDRESS") or "auto"


def supervise(driver_argv: list[str], run_dir: str, max_restarts: int, launched_ts: float | None,
              address: str | None = None) -> int:
    """Run `python -m airay.cli <driver_argv>` until it ends the run; returns its exit code.
    `address`: the driver's Ray cluster (cluster_address), where its autoscaler request stands."""
    attempt, previous = 0, None
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            env = {**os.environ, ATTEMPT_ENV: str(attempt), "PYTHONPATH": _pythonpath()}
            if launched_ts is not None and attempt == 0:
                env[LAUNCHED_ENV] = repr(launched_ts)
            if previous is not None:
                env[PREVIOUS_EXIT_ENV] = previous
            # Its own session: what it starts (a local cluster) is killed with it, and a
            # terminal's Ctrl-C reaches it through us.
            child = subprocess.Popen([sys.executable, "-m", "airay.cli", *driver_argv], env=env,
                                     start_new_session=True)
            rc = child.wait()
            kill_session(child.pid)
            if not should_restart(rc, attempt, max_restarts, bool(stopping)):
                if rc not in FINAL_EXITS:  # the driver died: its request stands until withdrawn here
                    withdraw_request(address)
                if rc not in FINAL_EXITS and not stopping:
                    give_up(run_dir, exit_text(rc), max_restarts)
                    return 1
                return rc
            attempt += 1
            previous = exit_text(rc)
            print(f"[airay] the driver died ({previous}); restarting it ({attempt} of {max_restarts}) to resume "
                  f"from the newest checkpoint in {run_dir}", flush=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _pythonpath() -> str:
    """PYTHONPATH for the driver: this airay's project first (a job's working_dir, or a checkout
    run without installing, as jobs/train.py does), so the driver imports the same code."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root])


def withdraw_request(address: str | None, timeout_s: float = 60.0) -> bool:
    """Withdraw the autoscaler request a dead driver left standing on the cluster at `address`
    (None: nothing to do); whether it was. In a child process, bounded: the supervisor imports
    no Ray, and a cluster that is gone must not keep it from exiting."""
    if address is None:
        return False
    code = ("import sys; from airay.placement import withdraw_request; "
            "sys.exit(0 if withdraw_request(sys.argv[1]) else 3)")
    try:
        proc = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, "PYTHONPATH": _pythonpath()})
    except subprocess.TimeoutExpired:
        print(f"[airay] could not withdraw the run's autoscaler request: no answer from {address} in "
              f"{timeout_s:.0f}s", file=sys.stderr)
        return False
    if proc.returncode == 3:  # "auto" found no cluster on this machine: the driver's own went with it
        return False
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        print(f"[airay] could not withdraw the run's autoscaler request at {address}: {last}", file=sys.stderr)
        return False
    print("[airay] withdrew the run's autoscaler request (the cluster may scale down)", file=sys.stderr)
    return True


def kill_session(sid: int) -> None:
    """SIGKILL every process left in the driver's session (its process group)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # nothing left
    except PermissionError as exc:
        print(f"[airay] could not clean up the driver's processes: {exc}", file=sys.stderr)


def give_up(run_dir: str, why: str, max_restarts: int) -> None:
    """The last driver died too: the run directory says so, as a failed run would."""
    from airay.events import RunRecorder, read_jsonl

    error = (f"the driver died ({why}) after {max_restarts} restarts (health.max_driver_restarts); "
             "re-run the same command to resume from the newest checkpoint")
    recorder = RunRecorder(run_dir, echo=False)
    try:
        durable = [e["step"] for e in read_jsonl(f"{run_dir}/events.jsonl")
                   if e["type"] == "checkpoint_saved" and e.get("tier") == "durable"]
        recorder.event("run_failed", error=error, traceback=None, durable_step=durable[-1] if durable else None)
        recorder.write_result({"status": "failed", "error": error, "run_dir": run_dir, "ts": time.time()})
    finally:
        recorder.close()
    print(f"[airay] failed: {error}", file=sys.stderr)

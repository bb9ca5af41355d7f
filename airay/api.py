"""`airay.fit(config)`: run a job to the end on Ray and return its Result."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from airay.config import ConfigError, JobConfig, resolve_run_dir
from airay.checkpoint.storage import mask_secrets
from airay.controller import Controller, Result
from airay.events import RunRecorder
from airay.data.prepare import prepare, prepare_dataset
from airay.local_cluster import LocalCluster
from airay.observe.ray_output import route_ray_messages


@contextlib.contextmanager
def preemption_signals(controller: Controller):
    """While the run goes on, SIGTERM (a spot reclaim, `ray job stop`, a scheduler's notice)
    asks it to checkpoint and exit cleanly within checkpoint.preemption_grace_s; past the grace
    period the process exits anyway (its last checkpoint is complete: they are atomic).
    Signals can only be caught in the main thread; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    timers = []

    def on_term(signum, frame):
        controller.request_preemption(signal.Signals(signum).name)
        grace = controller.cfg.checkpoint.preemption_grace_s
        timer = threading.Timer(grace, lambda: os._exit(128 + signum))  # the platform's SIGKILL is near
        timer.daemon = True
        timer.start()
        timers.append(timer)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        for timer in timers:  # the run ended within the grace period: a notebook or script goes on
            timer.cancel()


def fit(config: JobConfig, echo: bool = True, local_cluster: LocalCluster | None = None, dataset=None,
        launched_ts: float | None = None, driver_attempt: int | None = None,
        previous_exit: str | None = None, verbose: bool = False) -> Result:
    """Train `config` to max_steps, recovering from lost workers and nodes on the way.

    Connects to the Ray already initialised in this process, else `config.ray_address`, else
    RAY_ADDRESS, else starts one (or the local multi-node cluster of `config.cluster`).
    `local_cluster`: a LocalCluster the caller started (and will shut down), for chaos that
    removes and adds nodes. `dataset`: a ray.data.Dataset to train on (data.source becomes
    "dataset"): its row order must be deterministic, and its operators must run with the CPUs
    the training bundles leave (none on a cluster they fill: give its tasks num_cpus=0).
    Everything fit starts (actors, placement groups, Ray, a local
    cluster) is released on return, also when the run fails.
    `launched_ts`: when the user launched the run (the `airay run` process start; default: this
    call). Wall time, goodput and start-up count from it: every second the user waits.
    `driver_attempt`: set by `airay run`'s supervisor (airay.supervisor): this process is its
    driver, restarted if it dies (attempt 0 first; `previous_exit`: how the last one ended).
    `echo`: show the run (airay.observe.console); `verbose`: every event, not just the story.
    """
    import ray

    launch = {"launched_ts": launched_ts or time.time(), "fit_ts": time.time()}
    if driver_attempt is None and any(c.fault == "kill_driver" for c in config.chaos):
        raise ConfigError("chaos kill_driver kills the driver process: run the job with `airay run` (it restarts "
                          "its driver, health.max_driver_restarts > 0); airay.fit() runs the driver in your process")

    if config.needs_local_cluster and config.cluster is None and local_cluster is None:
        raise ConfigError("chaos remove_node/add_node act on a local cluster: set cluster.local_nodes "
                          "(or pass local_cluster= to airay.fit)")
    if dataset is not None:
        config = JobConfig.from_dict({**config.model_dump(mode="json"), "data": {
            **config.data.model_dump(mode="json"), "source": "dataset"}})
    else:
        config, stream = prepare(config)  # the dataset is checked (and max_steps resolved) before Ray starts
    from airay.observe.mlflow_tracking import wanted

    wanted(config)  # tracking asked for without MLflow installed: said before Ray starts
    run_dir = resolve_run_dir(config)
    recorder = RunRecorder(run_dir, echo=echo, verbose=verbose)
    config = config.model_copy(update={"run_dir": str(run_dir)})
    recorder.write_config(mask_secrets(config.to_yaml()))  # credentials in a storage URI stay out of the run dir
    local = None
    started_ray = False
    restore_ray_messages = route_ray_messages(
        lambda source, line: recorder.event("ray_message", source=source, message=line))
    try:
        if local_cluster is not None:
            if not ray.is_initialized():
                ray.init(address=local_cluster.address, logging_level="WARNING", log_to_driver=echo)
                started_ray = True
        elif config.cluster is not None:
            if ray.is_initialized():
                raise RuntimeError("cluster.local_nodes starts its own Ray cluster; call ray.shutdown() first "
                                   "or remove the cluster section to use the running Ray")
            t0 = time.time()
            local = LocalCluster(config.cluster)
            launch["cluster_s"] = time.time() - t0
            ray.init(address=local.address, logging_level="WARNING", log_to_driver=echo)
            started_ray = True
        elif not ray.is_initialized():
            ray.init(address=config.ray_address or os.environ.get("RAY_ADDRESS") or None,
                     logging_level="WARNING", log_to_driver=echo)
            started_ray = True
        if dataset is not None:  # a Ray dataset is checked once Ray is up, before any actor starts
            config, stream = prepare_dataset(config, dataset)
        controller = Controller(config, recorder, local or local_cluster, stream, dataset, launch,
                                driver_attempt=driver_attempt, previous_exit=previous_exit)
        with preemption_signals(controller):
            return controller.run()
    finally:
        if started_ray:
            ray.shutdown()
        restore_ray_messages()
        recorder.close()
        if local is not None:
            local.shutdown()

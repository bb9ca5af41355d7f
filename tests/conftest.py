import contextlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
import ray

from airay.config import LocalClusterSpec
from airay.events import read_jsonl
from airay.local_cluster import LocalCluster


# Modules whose tests run Ray Data in this process (a run with streamed data, the feeder itself).
# Ray Data's streaming tasks leave one of Ray's C++ I/O threads ("worker.io") in their driver's
# process after ray.shutdown, for good (ray 2.60: one task of num_returns="streaming" is enough:
# /proc/self/task/*/comm lists it, before ray.shutdown and after). A call into Ray from any thread
# while no core worker is up makes Ray end the process at once (exit 1, no report), and each test
# connects and shuts down again: CI's full run of 2026-12-07 ended so, right after
# test_elastic.py's node tests, on a thread created while test_data_scale.py ran ten minutes
# before. These modules run last: no other test runs in a process that holds such a thread.
RAY_DATA_IN_PROCESS = ("test_data_scale.py", "test_data_stream.py")


def pytest_collection_modifyitems(session, config, items):
    last = [item for item in items if item.path.name in RAY_DATA_IN_PROCESS]
    items[:] = [item for item in items if item.path.name not in RAY_DATA_IN_PROCESS] + last


@pytest.fixture(scope="session", autouse=True)
def memory_tiers_the_suite_leaves():
    """A run that fails or loses nodes keeps its newest memory-tier steps for a re-run (by design),
    in the default /dev/shm/airay where its spec sets no memory_path: the ones the suite's runs
    left there go when it ends (hundreds of MB of node memory otherwise); what was there stays."""
    import shutil

    from airay.checkpoint.tiers import default_memory_path

    base = default_memory_path()
    before = set(base.glob("ckpt-*"))
    yield
    for left in set(base.glob("ckpt-*")) - before:
        shutil.rmtree(left, ignore_errors=True)


def live_airay_actors() -> list[str]:
    return [a["ActorClassName"] for a in ray.state.actors().values()
            if a["State"] != "DEAD" and a["ActorClassName"] in ("TrainWorker", "Committer", "MemoryReplica")]


def standing_request() -> list:
    """The bundles of the cluster's request_resources request, where the (v1) autoscaler reads it."""
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def live_placement_groups() -> list[str]:
    return [pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"]


@contextlib.contextmanager
def started_cluster(nodes: int, cpus_per_node: float = 1, **spec):
    """A real multi-node Ray cluster, not connected (shut down after): one a module's tests share,
    each connecting with `connected`. A start costs about 9 s here, most of it CPU."""
    lc = LocalCluster(LocalClusterSpec(local_nodes=nodes, cpus_per_node=cpus_per_node, **spec))
    try:
        yield lc
    finally:
        lc.shutdown()


@contextlib.contextmanager
def connected(lc: LocalCluster, restore_nodes: int | None = None):
    """This process as the driver of `lc` until the block ends. Disconnecting ends every actor it
    owns (a failed test's leftovers die with it); with `restore_nodes`, the cluster first gets
    that many worker nodes back, for a shared cluster a test removed nodes from or added nodes to.
    Before disconnecting: nodes are started on threads, and a thread that reaches Ray's core worker
    after ray.shutdown makes Ray end the whole process ("The core worker has already been
    shutdown ... The process will exit"), which twice ended a full run silently right after
    test_elastic.py's node tests."""
    ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield lc
    finally:
        try:
            if restore_nodes is not None:
                restore_worker_nodes(lc, restore_nodes)
        finally:
            ray.shutdown()


def restore_worker_nodes(lc: LocalCluster, count: int) -> None:
    nodes = list(lc.cluster.worker_nodes)
    for node in nodes[count:]:
        lc.remove_node(node.node_id)
    for _ in range(count - len(nodes)):
        lc.add_node()


@contextlib.contextmanager
def ray_cluster(nodes: int, cpus_per_node: float = 1, **spec):
    """A real multi-node Ray cluster, connected, for a module's tests (shut down after)."""
    with started_cluster(nodes, cpus_per_node, **spec) as lc, connected(lc):
        yield lc


@contextlib.contextmanager
def patched_environ(values: dict[str, str]):
    """`values` in this process's environment while the block runs (Ray processes started meanwhile
    inherit them), the environment as it was after: pytest's MonkeyPatch, usable at any scope."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in values.items():
            mp.setenv(key, value)
        yield


@pytest.fixture(scope="module")
def shared_cluster(request):
    """One cluster for a module's tests: SHARED_NODES nodes of 1 CPU (the module's constant),
    started with the module's SHARED_ENV (if any) in its environment. Tests connect with `cluster`."""
    with patched_environ(getattr(request.module, "SHARED_ENV", {})), \
            started_cluster(nodes=request.module.SHARED_NODES) as lc:
        yield lc


@pytest.fixture
def cluster(shared_cluster, request):
    """The module's shared cluster, connected for one test; its nodes are back after (a test may
    remove or add some)."""
    with connected(shared_cluster, restore_nodes=request.module.SHARED_NODES) as lc:
        yield lc


@pytest.fixture
def local_cluster():
    """Start a real multi-node Ray cluster; after the test, check airay released everything."""
    started = []

    def start(nodes: int = 4, cpus_per_node: float = 1, gpus_per_node: float = 0) -> LocalCluster:
        lc = LocalCluster(LocalClusterSpec(local_nodes=nodes, cpus_per_node=cpus_per_node,
                                           gpus_per_node=gpus_per_node))
        ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)
        started.append(lc)
        return lc

    yield start
    for lc in started:
        ray.shutdown()
        lc.shutdown()


def running_data_executions() -> list[str]:
    """Ray Data executions of this process started and not shut down: one a run leaves runs on
    until the garbage collector shuts it down, whose calls into Ray come whenever it runs (after
    ray.shutdown, Ray's core worker ends the process on such a call)."""
    import gc
    import sys

    if "ray.data" not in sys.modules:  # nothing to scan for (a scan of the heap takes ~0.2 s)
        return []
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    return [o._dataset_id for o in gc.get_objects()
            if isinstance(o, StreamingExecutor) and o._execution_started and not o._shutdown]


# The threads a run's driver starts: the data producer and the MLflow client's queue. (A rank's
# checkpoint writer, "airay-ckpt-writer", lives in its worker; unit tests run one in this process.)
DRIVER_THREADS = ("airay-feeder", "airay-mlflow")


def live_airay_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(DRIVER_THREADS)]


def assert_released():
    """Nothing of a finished run is left: no actor, no placement group, no thread of airay's
    driver and no Ray Data execution running in the driver's process."""
    deadline = time.time() + 10  # actor and PG removal is asynchronous in Ray
    while time.time() < deadline and (live_airay_actors() or live_placement_groups()):
        time.sleep(0.2)
    assert live_airay_actors() == []
    assert live_placement_groups() == []
    assert live_airay_threads() == []
    assert running_data_executions() == []


def signal_rank_after(run_dir: Path, step: int, rank: int, sig: int) -> threading.Thread:
    """Send `sig` to rank `rank`'s process of the run's first world as soon as the metric of
    `step` is written: a crash (SIGKILL) or a spot reclaim (SIGTERM) from outside the run, at no
    round boundary the driver chose (chaos strikes at a round's start)."""
    def watch():  # read_jsonl leaves out a line the driver is still writing
        deadline = time.time() + 300
        while time.time() < deadline:
            if any(m["step"] >= step for m in read_jsonl(Path(run_dir) / "metrics.jsonl")):
                formed = [e for e in read_jsonl(Path(run_dir) / "events.jsonl") if e["type"] == "world_formed"]
                os.kill(formed[0]["workers"][rank]["pid"], sig)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread

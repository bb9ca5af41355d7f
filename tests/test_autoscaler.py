"""The autoscaler adds nodes for the world: Ray's own fake-node autoscaler (real raylets launched
by a real autoscaler, `ray.cluster_utils.AutoscalingCluster`), as a launcher cluster that starts
small.

The cluster starts with one 1-CPU worker node (the autoscaler's min_workers) and may grow to 4.
airay asks for room for max_workers=4 bundles (a standing request the autoscaler acts on); the
world starts at 1 and grows, by the autoscaler's launches alone, to 4. A node is then killed
(processes and raylet, as a spot reclaim): the world shrinks to 3, the request still stands, the
autoscaler replaces the node and the world regrows to 4. When the run ends the request is
withdrawn.
"""

import os
import threading
import time
from pathlib import Path

import psutil
import pytest
import ray

from airay import JobConfig, fit
from airay.events import committed_losses, read_jsonl
from airay.local_cluster import FAST_HEALTH_CHECK
from tests.conftest import assert_released, standing_request

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]


def alive_workers() -> set[str]:
    head = ray.get_runtime_context().get_node_id()
    return {n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head}


def kill_node(node_id: str) -> None:
    """Kill a fake node as a machine dies: its raylet (found by the node id on its command line)
    and the processes under it at once."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "raylet" in cmd and node_id in cmd:
            for child in proc.children(recursive=True):
                child.kill()
            proc.kill()
            return
    raise AssertionError(f"no raylet of node {node_id}")


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def fake_cluster_config(head_resources: dict, worker_node_types: dict) -> dict:
    """A launcher config of fake nodes (real raylets on this machine) whose provider lets a node
    be reclaimed (tests/reclaimable_provider.py). Written out here: AutoscalingCluster reads its
    base from fake_multi_node/example.yaml, which the ray 2.60 wheel does not ship."""
    return {
        "cluster_name": "fake_multinode", "max_workers": 8,
        "provider": {"type": "external", "module": "tests.reclaimable_provider.ReclaimableFakeProvider",
                     "use_node_id_as_ip": True, "disable_node_updaters": True, "disable_launch_config_check": True},
        "available_node_types": {**worker_node_types, "ray.head.default": {
            "resources": head_resources, "node_config": {}, "max_workers": 0}},
        "head_node_type": "ray.head.default", "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": 10,
        "docker": {}, "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }


@pytest.fixture
def autoscaling_cluster():
    from ray.cluster_utils import AutoscalingCluster

    class Cluster(AutoscalingCluster):
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **kwargs):
            return fake_cluster_config(head_resources, worker_node_types)

    cluster = Cluster(head_resources={"CPU": 0}, worker_node_types={
        "cpu_node": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 1, "max_workers": 4}})
    # The monitor process imports the provider from this checkout.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    cluster.start(_system_config=FAST_HEALTH_CHECK, override_env={"PYTHONPATH": path})
    try:
        ray.init("auto", logging_level="WARNING", log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_autoscaler_grows_the_world_and_replaces_a_lost_node(tmp_path, autoscaling_cluster):
    first = wait_for(alive_workers, 60, "the autoscaler's first worker node")
    assert len(first) == 1
    cfg = JobConfig.from_dict({
        "name": "autoscale",
        "model": {"factory": "airay.models.tiny_gpt:build", "kwargs": {"forward_delay_s": 0.1}},
        "loss_fn": "airay.models.tiny_gpt:loss",
        "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "zero_optimization": {"stage": 2}},
        "global_batch_size": 12, "micro_batch_size": 4, "max_steps": 300, "steps_per_round": 5,
        "scaling": {"min_workers": 1, "max_workers": 4},
        "checkpoint": {"every_n_steps": 5},
        "timeouts": {"capacity_wait_s": 60},
        "run_dir": str(tmp_path / "run"),
    })
    out = {}
    runner = threading.Thread(target=lambda: out.update(result=fit(cfg, echo=False)))
    runner.start()
    events = tmp_path / "run" / "events.jsonl"

    def formed():
        return [e for e in read_jsonl(events) if e["type"] == "world_formed"] if events.exists() else []

    wait_for(lambda: formed() and formed()[-1]["world_size"] == 4, 240, "a world of 4")
    # While the run trains, its request stands: room for 4 one-CPU bundles.
    assert standing_request() == [{"CPU": 1.0}] * 4
    grown = alive_workers()
    assert len(grown) == 4 and first < grown  # the first node and three the autoscaler launched
    victim = formed()[-1]["workers"][1]["node_id"]
    kill_node(victim)
    wait_for(lambda: formed()[-1]["world_size"] == 3, 60, "the world to shrink to 3")
    wait_for(lambda: formed()[-1]["world_size"] == 4, 240, "the world to regrow to 4")
    replaced = alive_workers()
    assert victim not in replaced and len(replaced - grown) == 1  # a new node took its place
    runner.join(timeout=600)
    result = out["result"]
    assert result.status == "finished", result.error
    sizes = result.world_sizes
    assert sizes[0] < 4 and 4 in sizes and sizes[-1] == 4
    assert sizes[sizes.index(4):] == [4, 3, 4]  # grew to 4, lost a node, regrew
    lost = [e for e in read_jsonl(events) if e["type"] in ("node_lost", "worker_failed")]
    assert [e["node_id"] for e in lost] == [victim]
    assert sorted(committed_losses(result.run_dir)) == list(range(300))
    assert standing_request() == []  # withdrawn: the autoscaler may scale the nodes down again
    assert_released()

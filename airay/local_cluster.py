"""A real multi-node Ray cluster on one machine (ray.cluster_utils.Cluster).

Each node is its own raylet with its own worker processes: removing one is a real node loss
(its processes die, its sockets close), which is what elasticity is tried against.
"""

from __future__ import annotations

from pathlib import Path

from airay.config import LocalClusterSpec

# Faster node-death detection than Ray's defaults (tuned for real networks, ~30 s): on one
# machine a dead raylet is certain within a second or two.
FAST_HEALTH_CHECK = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
}


class LocalCluster:
    def __init__(self, spec: LocalClusterSpec):
        from ray.cluster_utils import Cluster

        self.spec = spec
        # The head runs GCS and the driver only (0 CPUs): every worker lives on a removable node.
        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 0, "num_gpus": 0, "object_store_memory": spec.object_store_memory,
            "_system_config": FAST_HEALTH_CHECK, "include_dashboard": False})
        self._added = 0
        self._exit_hooks: list = []  # the nodes' own kill hooks (see _add_nodes), dropped at shutdown
        self._add_nodes(spec.local_nodes)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self) -> str:
        return self._add_nodes(1)[0]

    def _add_nodes(self, n: int) -> list[str]:
        """Start `n` nodes at once (each waits about a second for its raylet to register: in
        parallel, the waits overlap). Each gets its own socket names, which Ray would otherwise
        pick by probing the same session directory from every thread at once."""
        import atexit
        from concurrent.futures import ThreadPoolExecutor

        sockets = Path(self.cluster.head_node.get_session_dir_path()) / "sockets"

        def start(i: int):
            return self.cluster.add_node(
                num_cpus=self.spec.cpus_per_node, num_gpus=self.spec.gpus_per_node,
                object_store_memory=self.spec.object_store_memory, wait=False,
                raylet_socket_name=str(sockets / f"airay_raylet.{i}"),
                plasma_store_socket_name=str(sockets / f"airay_plasma.{i}"))

        # Ray's per-node exit hooks install a signal handler, which only the main thread may do:
        # the nodes started here are stopped by this object's own exit hook instead.
        self.cluster._shutdown_at_exit = False
        try:
            with ThreadPoolExecutor(max(1, n)) as pool:
                nodes = list(pool.map(start, range(self._added, self._added + n)))
        finally:
            self.cluster._shutdown_at_exit = True
        self._added += n
        for node in nodes:
            atexit.register(node.kill_all_processes, check_alive=False, allow_graceful=False)
            self._exit_hooks.append(node.kill_all_processes)
        self.cluster.wait_for_nodes()
        return [node.node_id for node in nodes]

    def remove_node(self, node_id: str) -> None:
        """Kill a worker node as a machine dies: its worker processes and its raylet at once."""
        import psutil
        from ray._private import ray_constants

        for node in list(self.cluster.worker_nodes):
            if node.node_id == node_id:
                # The raylet's children (the node's worker processes) first: left alone they
                # would train on for a second or so until they notice their raylet is gone.
                for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
                    try:
                        for child in psutil.Process(info.process.pid).children(recursive=True):
                            child.kill()
                    except psutil.NoSuchProcess:
                        pass
                self.cluster.remove_node(node, allow_graceful=False)
                return
        raise ValueError(f"node {node_id} is not a removable worker node of the local cluster")

    def shutdown(self) -> None:
        import atexit

        self.cluster.shutdown()
        for hook in self._exit_hooks:  # the processes are gone: a long-lived process keeps no hooks for them
            atexit.unregister(hook)
        self._exit_hooks = []

"""Ray's fake-node provider, with nodes that can be reclaimed like spot instances.

The autoscaler's monitor process loads it (provider type `external`). A fake node whose raylet was
killed stays on the stock provider's books for good, so the autoscaler never replaces it; a cloud
provider instead stops listing a reclaimed instance. This one does the same: a node with a dead
process is dropped from its list (and what is left of it killed), and the autoscaler, still asked
for the capacity, launches another.
"""

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider


class ReclaimableFakeProvider(FakeMultiNodeProvider):
    def non_terminated_nodes(self, tag_filters):
        with self.lock:
            for node_id, entry in list(self._nodes.items()):
                node = entry.get("node")
                if node is not None and node.dead_processes():
                    del self._nodes[node_id]
                    node.kill_all_processes(check_alive=False, allow_graceful=False)
        return super().non_terminated_nodes(tag_filters)

"""A node's NodeStore on a real Ray node: it serves calls concurrently (a peer copy waiting for
its next chunk does not hold up a recovery's read or a catalog), and the chunks of one copy land
in order, checked whole, whichever thread runs them."""

import zlib

import pytest
import ray

from airay.checkpoint.actors import start_store

pytestmark = pytest.mark.cluster


def test_a_store_serves_reads_while_a_copy_waits_and_lands_its_chunks_in_order(tmp_path, local_cluster):
    local_cluster(nodes=1)
    node = ray.get_runtime_context().get_node_id()
    store = start_store(node, str(tmp_path / "tier"), {"id": "job", "name": "job"})
    first, second = b"a" * 1000, b"b" * 500
    # The second chunk arrives first: its call waits (on one of the store's threads) for the first.
    late = store.receive.remote(3, "rank0.pt", len(first), second)
    ready, _ = ray.wait([late], timeout=1.0)
    assert ready == []
    # Meanwhile the store answers other calls: its catalog and its memory figures.
    assert ray.get(store.catalog.remote(), timeout=10) == {}  # nothing of the copy written yet
    figures = ray.get(store.memory.remote(), timeout=10)
    assert figures["node_id"] == node and figures["mem_total"] > 0 and figures["tier_bytes"] == 0
    assert ray.get(store.receive.remote(3, "rank0.pt", 0, first), timeout=10) == len(first)
    assert ray.get(late, timeout=10) == len(second)
    crc = zlib.crc32(second, zlib.crc32(first))
    assert ray.get(store.received.remote(3, "rank0.pt", 1500, crc), timeout=10) is True
    assert ray.get(store.read.remote(3, "rank0.pt", 990, 20), timeout=10) == b"a" * 10 + b"b" * 10
    assert ray.get(store.usage.remote(), timeout=10) == {3: 1500}
    # The budget gives a peer copy up (its owner's node keeps the file): it goes, the step stays.
    assert ray.get(store.drop_files.remote({3: ["rank0.pt", "rank9.pt"]}), timeout=10) == 1500
    assert ray.get(store.usage.remote(), timeout=10) == {3: 0}
    # A copy whose bytes differ from the sender's CRC is not kept.
    ray.get(store.receive.remote(4, "rank0.pt", 0, first), timeout=10)
    assert ray.get(store.received.remote(4, "rank0.pt", 1000, crc), timeout=10) is False
    assert ray.get(store.catalog.remote(), timeout=10)[4]["files"] == {}
    ray.kill(store)

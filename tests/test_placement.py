"""Resource arithmetic: how many bundles fit, and how a reservation is split into groups."""

from airay import placement


def test_bundles_fit_per_node_never_across_nodes():
    free = [{"CPU": 1.5, "GPU": 1}, {"CPU": 8, "GPU": 8}, {"CPU": 0.5, "GPU": 4}]
    per_worker = {"CPU": 1, "GPU": 1}
    assert placement.fits_per_node(free, per_worker) == [1, 8, 0]
    assert placement.bundles_that_fit(free, per_worker) == 9  # 2 CPUs half-free on two nodes make none


def test_strict_pack_reserves_one_group_per_node():
    # Three 8-GPU nodes, one with 3 GPUs taken: a STRICT_PACK group must fit on one node, so 20
    # workers are 8 + 8 + 4 (the roomiest nodes first), not one group of 20 that never places.
    fits = [5, 8, 8]
    assert placement.group_sizes(20, fits, "STRICT_PACK") == [8, 8, 4]
    assert placement.group_sizes(30, fits, "STRICT_PACK") == [8, 8, 5]  # what fits now
    assert placement.group_sizes(4, fits, "STRICT_PACK") == [4]
    assert placement.group_sizes(4, [], "STRICT_PACK") == []
    # PACK and SPREAD: one group; Ray places its bundles over the nodes.
    assert placement.group_sizes(20, fits, "PACK") == [20]
    assert placement.group_sizes(0, fits, "SPREAD") == []


def test_actor_options_take_exactly_one_bundle():
    assert placement.actor_options({"GPU": 1}) == {"num_cpus": 0.0, "num_gpus": 1}
    assert placement.actor_options({"CPU": 2, "GPU": 1, "memory": 1e9, "efa": 1}) == \
        {"num_cpus": 2, "num_gpus": 1, "memory": 1e9, "resources": {"efa": 1}}


def test_avoid_nodes_selector():
    assert placement.avoid_nodes(set(), 2) is None
    assert placement.avoid_nodes({"b", "a"}, 2) == [{"ray.io/node-id": "!in(a,b)"}] * 2


def test_a_scheduled_job_reserves_groups_as_small_as_what_it_may_give_back():
    # Under the scheduler a job shrinks by world_size_multiple at a time, and Ray releases whole
    # groups only: its groups hold `unit` bundles (a STRICT_PACK node's group is cut too).
    assert placement.group_sizes(4, [], "PACK", unit=1) == [1, 1, 1, 1]
    assert placement.group_sizes(16, [], "PACK", unit=8) == [8, 8]
    assert placement.group_sizes(20, [5, 8, 8], "STRICT_PACK", unit=4) == [4, 4, 4, 4, 4]
    assert placement.group_sizes(6, [8], "STRICT_PACK", unit=4) == [4, 2]

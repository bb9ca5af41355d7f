"""The model-parallel layout (airay.parallel.layout): rank <-> coordinates, groups, what retires."""

import pytest

from airay.parallel.layout import Coordinates, Layout, form_teams, groups_per_node


def test_tensor_parallel_is_fastest_then_sequence_then_data():
    lay = Layout(world=16, tp=2, sp=2)
    assert (lay.mp, lay.dp) == (4, 4)
    assert lay.coordinates(0) == Coordinates(0, 0, 0)
    assert lay.coordinates(1) == Coordinates(0, 0, 1)
    assert lay.coordinates(2) == Coordinates(0, 1, 0)
    assert lay.coordinates(7) == Coordinates(1, 1, 1)
    assert [lay.rank(lay.coordinates(r)) for r in range(16)] == list(range(16))
    assert lay.tensor_parallel_groups()[:3] == [[0, 1], [2, 3], [4, 5]]
    assert lay.sequence_parallel_groups()[:3] == [[0, 2], [1, 3], [4, 6]]
    assert lay.model_parallel_groups()[1] == [4, 5, 6, 7]
    assert lay.data_parallel_groups() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    # Every rank is in exactly one group of each kind.
    for groups in (lay.tensor_parallel_groups(), lay.sequence_parallel_groups(), lay.data_parallel_groups(),
                   lay.model_parallel_groups()):
        assert sorted(r for g in groups for r in g) == list(range(16))


def test_a_lost_rank_retires_its_whole_model_parallel_group():
    lay = Layout(world=8, tp=2)
    assert lay.retire([3]) == [2, 3]
    assert lay.retire([3, 2]) == [2, 3]  # one group, however many of its ranks died
    assert lay.retire([0, 7]) == [0, 1, 6, 7]
    assert Layout(world=4).retire([2]) == [2]  # pure data parallelism: a rank is a replica


def test_a_node_holds_whole_groups():
    assert groups_per_node(8, 4) == 2 and groups_per_node(2, 4) == 0


def test_survivors_whole_groups_keep_their_order_and_broken_groups_stand_by():
    # World of 4 at tp 2 on nodes a (ranks 0, 1) and b (2, 3); rank 1 died: its group mate 0 is
    # left without a group, the whole group (2, 3) keeps its order and comes first.
    nodes, prior = ["a", "b", "b"], [("w1", 0), ("w1", 1), ("w1", 1)]
    assert form_teams(nodes, prior, 2) == [[1, 2]]
    # Its replacement on node a is up (a spare, no prior group): a completes a group with it.
    assert form_teams(nodes + ["a"], prior, 2) == [[1, 2], [0, 3]]
    # A spare on another node completes nothing: tensor-parallel ranks share a node.
    assert form_teams(nodes + ["c"], prior, 2) == [[1, 2]]


def test_spares_form_groups_node_by_node_and_pure_data_parallelism_is_one_member_a_group():
    assert form_teams(["a", "b", "a", "b", "a"], [None] * 5, 2) == [[0, 2], [1, 3]]
    assert form_teams(["x"] * 8, [None] * 8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # 8 GPUs, tp 4: 2 groups
    assert form_teams(["a", "b", "c"], [("w", 0), ("w", 1), None], 1) == [[0], [1], [2]]
    # A group whose members were spread (it should not be) is not kept whole.
    assert form_teams(["a", "b"], [("w", 0), ("w", 0)], 2) == []


def test_bad_layouts_say_what_is_wrong():
    with pytest.raises(ValueError, match="not a whole number of model-parallel groups of 4"):
        Layout(world=6, tp=2, sp=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        Layout(world=4, tp=0)
    with pytest.raises(ValueError, match="outside a world of 4"):
        Layout(world=4, tp=2).coordinates(4)
    with pytest.raises(ValueError, match="outside a layout"):
        Layout(world=4, tp=2).rank(Coordinates(2, 0, 0))

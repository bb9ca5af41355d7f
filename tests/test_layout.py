"""The model-parallel layout (airay.parallel.layout): rank <-> coordinates, groups, what retires."""

import pytest

from airay.parallel.layout import Coordinates, Layout, groups_per_node, world_sizes


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


def test_sizes_are_whole_groups_and_a_node_holds_whole_groups():
    assert world_sizes(2, 8, mp=2) == [2, 4, 6, 8]
    assert world_sizes(3, 8, mp=2) == [4, 6, 8]
    assert world_sizes(1, 16, mp=4, multiple=8) == [8, 16]  # whole 8-GPU nodes of 2 groups each
    assert world_sizes(1, 3, mp=4) == []
    assert groups_per_node(8, 4) == 2 and groups_per_node(2, 4) == 0


def test_bad_layouts_say_what_is_wrong():
    with pytest.raises(ValueError, match="not a whole number of model-parallel groups of 4"):
        Layout(world=6, tp=2, sp=2)
    with pytest.raises(ValueError, match="must be >= 1"):
        Layout(world=4, tp=0)
    with pytest.raises(ValueError, match="outside a world of 4"):
        Layout(world=4, tp=2).coordinates(4)
    with pytest.raises(ValueError, match="outside a layout"):
        Layout(world=4, tp=2).rank(Coordinates(2, 0, 0))

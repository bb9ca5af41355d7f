"""Model parallelism's decisions as data (no Ray, no DeepSpeed world): which workers make a world
of whole model-parallel groups, placement groups of whole groups, a checkpoint's slices as each
slice's data-parallel checkpoint, and the export's joining of tensor-parallel slices."""

from dataclasses import dataclass

import pytest
import torch

from airay import placement
from airay.checkpoint import reshard
from airay.checkpoint.layout import Manifest, files_to_load
from airay.export import merge_tensor_parallel
from airay.worker_group import world_members


@dataclass
class Worker:
    name: str
    node: str
    team: tuple | None = None
    bundle_index: int = 0

    @property
    def node_id(self):
        return self.node


def test_a_world_of_whole_groups_keeps_the_whole_survivors_first_and_completes_groups_on_one_node():
    # World 4 at tp 2: a0 a1 on node a (group 0), b0 b1 on node b (group 1); a1 died.
    a0, b0, b1 = Worker("a0", "a", (1, 0)), Worker("b0", "b", (1, 1)), Worker("b1", "b", (1, 1))
    active, standby = world_members([a0, b0, b1], [], 2, mp=2)
    assert [w.name for w in active] == ["b0", "b1"] and [w.name for w in standby] == ["a0"]
    # a1's replacement is up on node a: the world of 4 is the whole group, then a's new group.
    spare = Worker("a1'", "a")
    a0.team = None  # it stood by: in no group of the world
    active, standby = world_members([b0, b1], [a0, spare], 4, mp=2)
    assert [w.name for w in active] == ["b0", "b1", "a0", "a1'"] and standby == []
    # A spare on a third node cannot complete a's group: the world stays at one replica.
    active, standby = world_members([b0, b1], [a0, Worker("c0", "c")], 4, mp=2)
    assert [w.name for w in active] == ["b0", "b1"] and {w.name for w in standby} == {"a0", "c0"}


def test_placement_groups_hold_whole_model_parallel_groups_one_node_each():
    assert placement.group_sizes(8, [3, 3, 2], "STRICT_PACK", team=2) == [2, 2, 2]  # a node's odd CPU idles
    assert placement.group_sizes(16, [8, 8], "STRICT_PACK", team=4) == [8, 8]  # 2 groups of tp 4 a node
    assert placement.group_sizes(7, [8], "STRICT_PACK", team=4) == [4]
    assert placement.group_sizes(8, [8, 8], "STRICT_PACK", unit=4, team=4) == [4, 4]


def _reports(world, mp, layouts):
    reps = []
    for rank in range(world):
        dp, m = divmod(rank, mp)
        files = {reshard.optim_file(dp, mp=m): [10, 1]}
        if dp == 0:
            files[reshard.model_file(m)] = [5, 2]
        reps.append({"files": files, "layout": layouts[m] if rank < mp else {}})
    return reps


def test_a_tensor_parallel_checkpoint_is_per_slice_a_data_parallel_one():
    layouts = [{"partitions": [6], "totals": [12]}, {"partitions": [5], "totals": [10]}]
    m = Manifest.from_reports(4, 4, 2, {"name": "j"}, _reports(4, 2, layouts), 0.0, model_parallel=2)
    again = Manifest.from_json(m.to_json())
    assert again.model_parallel == 2 and again.data_parallel == 2
    one = again.slice(1)
    assert (one.world_size, one.layout, one.mp_rank, one.slices) == (2, layouts[1], 1, 2)
    # Slice 1 at the same data-parallel size reads its own files; at another, the old
    # partitions of slice 1 that overlap its new one (one replica: both of them).
    assert files_to_load(one, 1, 2, layouts[1]) == ["mp_rank_01_model_states.pt",
                                                   "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    assert files_to_load(one, 0, 1, {"partitions": [10], "totals": [10]}) == [
        "mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt",
        "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    assert again.slice(0).layout == layouts[0]
    plain = Manifest.from_reports(4, 2, 2, {"name": "j"}, _reports(2, 1, layouts[:1]), 0.0)
    assert plain.slice(0) is plain and plain.layout == layouts[0]


def test_export_joins_slices_along_the_dimension_they_were_cut_and_names_one_that_does_not_fit():
    full = torch.arange(24.0).reshape(4, 6)
    slices = [{"col": full[:2], "row": full[:, :3], "norm": torch.ones(6)},
              {"col": full[2:], "row": full[:, 3:], "norm": torch.ones(6)}]
    out = merge_tensor_parallel(slices, {"col": (4, 6), "row": (4, 6), "norm": (6,)})
    assert torch.equal(out["col"], full) and torch.equal(out["row"], full) and torch.equal(out["norm"], torch.ones(6))
    with pytest.raises(ValueError, match=r"slices of col \(\[\(2, 6\), \(2, 6\)\]\) do not make its shape .*\(5, 6\)"):
        merge_tensor_parallel(slices, {"col": (5, 6), "row": (4, 6), "norm": (6,)})


def test_a_sequence_parallel_shard_keeps_each_tokens_next_token_and_global_position():
    from airay.parallel.sequence import shard

    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[1, 6:] = -100  # padding at the end of the second sample: not predicted
    parts = [shard({"input_ids": ids}, labels, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), ids)
    assert torch.equal(parts[1]["position_ids"][0], torch.arange(4, 8))
    # The last token of shard 0 predicts the first of shard 1; the sequence's last token, nothing.
    assert parts[0]["shift_labels"][0, -1] == 4 and parts[1]["shift_labels"][0, -1] == -100
    predicted = 7 + 5  # tokens with a next token that counts, over both samples
    assert all(float(p["num_items_in_batch"]) == predicted / 2 for p in parts)
    with pytest.raises(ValueError, match="sequences of 8 tokens do not split over sequence_parallel_size 3"):
        shard({"input_ids": ids}, labels, 0, 3)

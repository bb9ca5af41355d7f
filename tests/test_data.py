import torch

from airay import data, policy
from airay.models import tiny_gpt


def test_every_world_size_trains_on_the_same_samples_per_step():
    for step in (0, 7):
        expected = list(data.step_sample_ids(step, 24))
        for w in (1, 2, 3, 4, 6):
            plan = policy.plan_batch(24, 4, w)
            ids = [i for r in range(w) for mb in data.rank_micro_batch_ids(step, r, plan) for i in mb]
            assert ids == expected, w
            assert all(len(mb) == plan.micro_batch_size for r in range(w)
                       for mb in data.rank_micro_batch_ids(step, r, plan))


def test_synthetic_samples_are_deterministic_and_distinct():
    a = tiny_gpt.synthetic_sample(5, seed=1)["tokens"]
    assert torch.equal(a, tiny_gpt.synthetic_sample(5, seed=1)["tokens"])
    assert not torch.equal(a, tiny_gpt.synthetic_sample(6, seed=1)["tokens"])
    src = data.SyntheticSource(tiny_gpt.synthetic_sample, 0, {})
    batches = src.micro_batches(2, 1, policy.plan_batch(24, 4, 3))
    assert [b["sample_id"].tolist() for b in batches] == [[56, 57, 58, 59], [60, 61, 62, 63]]

"""The memory tier's budget (airay.checkpoint.budget): what each node may hold, and what a save
gives up to stay within it. Pure; the controller tests drive it through the Checkpointer."""

from airay.checkpoint.budget import SHM_SHARE, NodeMemory, node_budgets, plan_save, rank_bytes
from airay.checkpoint.layout import FileEntry, Manifest

GiB = 1 << 30


def node(name, host, mem=24 * GiB, shm_free=12 * GiB, tier=0):
    return NodeMemory(name, host, mem, mem // 2, 12 * GiB, shm_free, tier)


def test_a_machines_budget_is_split_between_its_raylets_and_capped_by_dev_shm():
    # A local cluster: four raylets on one 24 GiB machine share a quarter of it.
    budgets = node_budgets([node(f"n{i}", "box") for i in range(4)], 0.25)
    assert budgets == {f"n{i}": int(6 * GiB / 4) for i in range(4)}
    # Two machines each keep their own quarter.
    assert node_budgets([node("a", "h1"), node("b", "h2")], 0.25) == {"a": 6 * GiB, "b": 6 * GiB}
    # /dev/shm's room caps it: what is free plus what this job's tiers there already hold.
    tight = node_budgets([node("a", "h1", shm_free=2 * GiB, tier=1 * GiB)], 0.25)
    assert tight == {"a": int(SHM_SHARE * 3 * GiB)}
    # The spec's budget per node, still capped by /dev/shm; the memory monitor's scale halves it.
    assert node_budgets([node("a", "h1")], 0.25, budget_bytes=GiB) == {"a": GiB}
    assert node_budgets([node("a", "h1"), node("b", "h1")], 0.25, budget_bytes=GiB, scale={"h1": 0.5}) == \
        {"a": GiB // 2, "b": GiB // 2}


RING = {"A": "B", "B": "A"}


def test_a_save_that_fits_gives_up_nothing():
    plan = plan_save({"A": 2000, "B": 2000}, {"A": {2: 800}, "B": {2: 800}}, set(), {"A": 400, "B": 400}, RING)
    assert (plan.drop, plan.no_peer, plan.skip) == ((), frozenset(), False)
    assert plan.use == {"A": 1600, "B": 1600}


def test_the_oldest_kept_steps_go_first_then_the_peer_copy_then_the_save():
    kept = {"A": {2: 800, 4: 800}, "B": {2: 800, 4: 800}}
    own = {"A": 400, "B": 400}
    # Each node holds its own 400 and its peer's 400 of every step: two kept steps and the new one
    # need 2400; without step 2, 1600; without both, 800.
    assert plan_save({"A": 1700, "B": 1700}, kept, set(), own, RING).drop == (2,)
    plan = plan_save({"A": 1500, "B": 1500}, kept, set(), own, RING)
    assert (plan.drop, plan.no_peer, plan.skip) == ((2, 4), frozenset(), False)
    assert max(plan.use.values()) <= 1500
    # Step 4 is being uploaded (protected): after step 2, only the peer copies can go.
    plan = plan_save({"A": 1500, "B": 1500}, kept, {4}, own, RING)
    assert (plan.drop, plan.no_peer, plan.skip) == ((2,), frozenset({"A", "B"}), False)
    assert plan.use == {"A": 1200, "B": 1200}
    # Only B is short: only A's ranks (who copy to B) skip their copy.
    plan = plan_save({"A": 1700, "B": 1500}, kept, {4}, own, RING)
    assert plan.no_peer == frozenset({"A"}) and plan.use == {"A": 1600, "B": 1200}
    # A node's own files alone exceed its budget: the save is skipped and nothing is dropped for it.
    plan = plan_save({"A": 1100, "B": 1500}, kept, {4}, own, RING)
    assert plan.skip and plan.drop == () and "node A" in plan.reason and "budget" in plan.reason


def test_a_saves_size_comes_from_the_last_manifest_rescaled_to_the_world():
    files = {f"r{r}.pt": FileEntry(size=100 + (50 if r == 0 else 0), crc32=0, rank=r) for r in range(4)}
    manifest = Manifest(step=4, world_size=4, zero_stage=2, job={}, files=files, created=0.0)
    assert rank_bytes(manifest, 4) == [150, 100, 100, 100]
    assert rank_bytes(manifest, 2) == [300, 300]  # the largest rank's share, over half the ranks


def test_the_peer_copies_of_a_step_an_upload_reads_go_before_the_new_steps_peer_copies():
    kept = {"A": {2: 800, 4: 800}, "B": {2: 800, 4: 800}}
    own = {"A": 400, "B": 400}
    copies = {"A": {4: 400}, "B": {4: 400}}  # of step 4 (uploading), each node holds its peer's 400
    # Without step 2 and step 4's peer copies: 400 of step 4 + 800 of the new step with its copy.
    plan = plan_save({"A": 1300, "B": 1300}, kept, {4}, own, RING, copies)
    assert (plan.drop, plan.drop_copies, plan.no_peer, plan.skip) == ((2,), (4,), frozenset(), False)
    assert plan.use == {"A": 1200, "B": 1200}
    # Tighter: the new step's copies go too; tighter still, the save is skipped and nothing dropped.
    plan = plan_save({"A": 1000, "B": 1000}, kept, {4}, own, RING, copies)
    assert (plan.drop_copies, plan.no_peer, plan.skip) == ((4,), frozenset({"A", "B"}), False)
    assert plan.use == {"A": 800, "B": 800}
    plan = plan_save({"A": 700, "B": 1000}, kept, {4}, own, RING, copies)
    assert plan.skip and plan.drop == () and plan.drop_copies == ()
    # Copies of a step no upload reads are not counted apart: the step goes whole.
    assert plan_save({"A": 1300, "B": 1300}, kept, set(), own, RING, {"A": {2: 400}}).drop_copies == ()

"""The scheduler's queue as data (airay.sched.queue): what the actor holds, decides and keeps on disk."""

import pytest

from airay.sched.actor import worker_slots
from airay.sched.queue import Queue


def job(id, priority=0, team="default", lo=1, hi=4, **kw):
    return {"id": id, "name": id, "priority": priority, "team": team, "min_workers": lo, "max_workers": hi, **kw}


def targets(q):
    return {j.id: j.target for j in q.jobs.values()}


def test_a_higher_priority_job_shrinks_a_running_one_and_the_shrunk_job_keeps_saying_why():
    q = Queue()
    q.submit(job("low", lo=2, hi=4), now=0)
    assert q.decide(4, now=1) == ["low"] and targets(q) == {"low": 4}
    q.submit(job("high", priority=10, lo=2, hi=2), now=2)
    assert sorted(q.decide(4, now=3)) == ["high", "low"] and targets(q) == {"low": 2, "high": 2}
    assert q.jobs["low"].reason.startswith("running at 2 of 4: shrunk for high")
    q.report("low", current=2, step=30, now=4)
    assert q.decide(4, now=4) == [] and "shrunk for high" in q.jobs["low"].reason  # said again, not lost
    q.finish("high", "done", now=5)
    assert q.decide(4, now=6) == ["low"] and targets(q) == {"low": 4, "high": 0}
    assert q.jobs["high"].state == "done" and q.jobs["low"].reason == "running at 4 (its max)"


def test_a_teams_guaranteed_workers_are_never_taken_by_another_team_of_equal_or_lower_priority():
    q = Queue()
    q.set(quotas={"prod": 2})
    q.submit(job("research-1", team="research", lo=1, hi=4), now=0)
    q.decide(4, now=0)
    assert targets(q) == {"research-1": 4}  # idle quota is borrowed
    q.submit(job("prod-1", team="prod", lo=2, hi=2), now=1)
    q.decide(4, now=1)
    assert targets(q) == {"research-1": 2, "prod-1": 2}  # and given back by a shrink
    q.submit(job("research-2", team="research", priority=0, lo=2, hi=4), now=2)
    q.submit(job("research-3", team="research", priority=-5, lo=1, hi=4), now=2)
    for t in range(3, 6):
        q.decide(4, now=t)
        assert q.jobs["prod-1"].target == 2
    assert q.jobs["research-2"].target == 0 and "waiting" in q.jobs["research-2"].reason


def test_submit_is_idempotent_and_the_queue_survives_a_restart_from_disk(tmp_path):
    q = Queue()
    q.submit(job("a", lo=2, hi=4), now=0)
    q.submit(job("b", priority=1, lo=2, hi=2), now=1)
    q.set(quotas={"default": 2}, policy="goodput")
    q.decide(4, now=2)
    assert q.submit(job("a", lo=2, hi=4), now=3).submit_ts == 0  # a retried submit keeps its place
    q.save(tmp_path / "state.json")
    back = Queue.load(tmp_path / "state.json")
    assert back.to_dict() == q.to_dict() and targets(back) == {"a": 2, "b": 2}
    assert Queue.load(tmp_path / "missing.json").jobs == {}
    assert list(tmp_path.iterdir()) == [tmp_path / "state.json"]  # no temporary file left behind


def test_a_job_whose_driver_went_silent_is_dropped_and_its_workers_given_out():
    q = Queue(lost_after_s=60)
    q.submit(job("gone", lo=4, hi=4), now=0)
    q.submit(job("next", lo=2, hi=4), now=0)
    q.decide(4, now=0)
    assert targets(q) == {"gone": 4, "next": 0}
    q.report("next", 0, 0, now=100)
    q.decide(4, now=100)
    assert q.jobs["gone"].state == "lost" and targets(q) == {"gone": 0, "next": 4}


def test_bad_input_is_refused_with_the_field():
    q = Queue()
    with pytest.raises(ValueError, match="world_size_multiple"):
        q.submit(job("x", lo=3, hi=3, world_size_multiple=4), now=0)
    with pytest.raises(ValueError, match="unknown job field"):
        q.submit(job("y", colour="red"), now=0)
    with pytest.raises(ValueError, match="policy must be one of"):
        q.set(policy="fifo")
    with pytest.raises(KeyError, match="no job 'z'"):
        q.report("z", 1, 0, now=0)


def test_quotas_above_the_cluster_are_scaled_to_it():
    q = Queue()
    q.set(quotas={"a": 6, "b": 2})
    assert q._fitted_quotas(4) == {"a": 3, "b": 1} and q._fitted_quotas(8) == {"a": 6, "b": 2}


def test_workers_are_the_alive_nodes_gpus_where_there_are_any_else_their_cpus():
    nodes = [{"Alive": True, "Resources": {"CPU": 16, "GPU": 8}}, {"Alive": False, "Resources": {"GPU": 8}},
             {"Alive": True, "Resources": {"CPU": 4}}]
    assert worker_slots(nodes) == 8
    assert worker_slots([{"Alive": True, "Resources": {"CPU": 2}}, {"Alive": True, "Resources": {"CPU": 2}}]) == 4

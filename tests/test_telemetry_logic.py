"""Pure parts of watching a run: the progress line, the ETA, the collective timer and counters, token counts."""

import time

import torch

from airay import commtime
from airay.events import RunRecorder, read_jsonl
from airay.telemetry import eta_s, progress_line
from airay.worker import free_port, token_count


def test_progress_line_is_one_plain_line():
    line = progress_line(40, 130, 2.31, 412.04, 13184.4, 4, 1, eta_s(90, 0.5))
    assert line == "[airay] step 40/130 loss 2.3100 samples/s 412.0 tokens/s 13184 world 4 restarts 1 eta 45s"
    assert progress_line(1, 10, 1.0, 5.0, None, 1, 0, None).endswith("world 1 restarts 0 eta ?")
    assert progress_line(1, 10, 1.0, 5.0, None, 1, 0, 3725).endswith("eta 1h02m")
    assert "\r" not in line and "\x1b" not in line


def test_console_lines_stay_short_at_any_world_size_and_events_jsonl_keeps_everything(tmp_path, capsys):
    workers = [{"node_id": f"{r // 8:056x}", "pid": 1000 + r, "device": f"cuda:{r % 8}", "gpu_ids": [r % 8],
                "backend": "nccl", "timeline": {"init_ts": 1.5, "ready_ts": 2.5}, "local_rank": r % 8}
               for r in range(4096)]
    rec = RunRecorder(tmp_path, echo=True)
    rec.event("world_formed", step=0, world_size=4096, plan={"world_size": 4096, "global_batch_size": 8192},
              join_s=1.23456, workers=workers)
    rec.event("checkpoint_saved", step=5, tier="durable", upload_windows=[[1.0, 2.0]] * 4096,
              peer_nodes=[f"{n:056x}" for n in range(512)], retried_ranks=[])
    rec.event("run_failed", step=5, error="x" * 5000, traceback="Traceback:\n  File 'a.py'\nValueError: bad")
    rec.close()
    lines = capsys.readouterr().out.splitlines()
    formed, saved, failed = lines[0], lines[1], lines[2]
    assert formed == ("[airay] world_formed step=0 world_size=4096 plan={'world_size': 4096, 'global_batch_size': "
                      "8192} join_s=1.235 workers=4096 on 512 node(s)")
    assert len(saved) < 600 and "upload_windows=[[1.000, 2.000], [1.000, 2.000], [1.000, 2.000], (+4093 more)]" in saved
    assert "(+509 more)] retried_ranks=[]" in saved
    assert len(failed) < 400 and "... (+4700 chars)" in failed
    assert lines[3:] == ["  File 'a.py'", "ValueError: bad"]  # a traceback keeps its lines
    # The record is whole: every worker with every field, every window, the whole error.
    recorded = {e["type"]: e for e in read_jsonl(tmp_path / "events.jsonl")}
    assert recorded["world_formed"]["workers"] == workers
    assert len(recorded["checkpoint_saved"]["upload_windows"]) == 4096 and len(recorded["run_failed"]["error"]) == 5000


def test_token_count_only_for_integer_sequences():
    assert token_count({"tokens": torch.zeros(4, 33, dtype=torch.long)}) == 132
    assert token_count({"input_ids": torch.zeros(2, 8, dtype=torch.int32), "tokens": torch.zeros(1, 1)}) == 16
    assert token_count({"x": torch.zeros(4, 10)}) == 0
    assert token_count({"tokens": torch.zeros(4, 10)}) == 0  # float features are not token ids


def test_collective_time_is_counted_once_per_outermost_call():
    import torch.distributed as dist

    commtime.install()
    commtime.install()  # idempotent: wrapping twice would count twice
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        before = commtime.seconds()
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.distributed_c10d.all_reduce(t)  # the other namespace DeepSpeed calls through
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        after = commtime.seconds()
        assert after > before
        assert dist.all_reduce is dist.distributed_c10d.all_reduce  # one wrapper, both names
        assert t.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


def test_collective_calls_are_counted_once_and_an_action_runs_just_before_the_nth():
    import torch.distributed as dist

    commtime.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        seen = []
        entered0, left0 = commtime.calls()
        commtime.before_collective(2, lambda: seen.append(commtime.calls()))
        t = torch.ones(4)
        dist.all_reduce(t)
        assert seen == []
        dist.distributed_c10d.all_reduce(t)  # the second call (the other namespace)
        assert seen == [(entered0 + 1, left0 + 1)]  # before the 2nd: one entered and left
        dist.all_reduce(t, async_op=True).wait()  # a wait is not another call
        assert commtime.calls() == (entered0 + 3, left0 + 3)
        assert not commtime.disarm()  # it ran once
    finally:
        dist.destroy_process_group()


def test_torchs_group_counters_are_read_for_this_worlds_groups_only():
    """torch's flight recorder dump (no trace buffer) gives each process group's collective
    counters; a world's are those of the groups made since it began (torch keeps old ones)."""
    import torch.distributed as dist

    from airay.worker.dist import collective_counts, group_status

    for _ in range(2):  # the second world: the first one's group is still in torch's status
        old = frozenset(group_status("gloo") or ())
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        try:
            t = torch.ones(2)
            dist.all_reduce(t)
            dist.all_reduce(t)
            status = group_status("gloo")
            assert status is not None and len(status) == len(old) + 1  # torch 2.13 has the dump for gloo
            # gloo's work thread records a completion a moment after the caller returns
            deadline = time.time() + 5
            while collective_counts(group_status("gloo"), old)[0] < 2 and time.time() < deadline:
                time.sleep(0.01)
            assert collective_counts(group_status("gloo"), old) == [2, -1, 2]  # gloo records no device start
        finally:
            dist.destroy_process_group()
    assert collective_counts(None, frozenset()) is None
    two = {"0": {"last_completed_collective": 3, "last_started_collective": 4, "last_enqueued_collective": 5},
           "1": {"last_completed_collective": 1, "last_started_collective": 1, "last_enqueued_collective": 2}}
    assert collective_counts(two, frozenset()) == [4, 5, 7]
    assert collective_counts(two, frozenset({"0"})) == [1, 1, 2]

"""Pure parts of watching a run: the progress line, the ETA, the collective timer and counters, token counts."""

import io
import time

import pytest
import torch

from airay import commtime
from airay.events import RunRecorder, read_jsonl
from airay.observe.console import LINE_MAX, Console, Progress, progress_text
from airay.telemetry import Pace
from airay.worker import free_port, token_count


def test_progress_line_says_steps_loss_throughput_world_eta_and_the_newest_durable_step():
    line = progress_text(Progress(40, 130, 2.31, 13184.4, 412.04, 4, 45.0, 35))
    assert line == "step 40/130 | loss 2.3100 | 13.2k tokens/s | world 4 | eta 45s | saved 35"
    assert progress_text(Progress(1, 10, 1.0, None, 5.0, 1, None, None)) == \
        "step 1/10 | loss 1.0000 | 5.0 samples/s | world 1 | eta ?"
    assert progress_text(Progress(1, 10, 1.0, None, 5.0, 1, 3725, None)).endswith("eta 1h02m")


def test_the_eta_smooths_over_resizes():
    """The demo's ETA jumped from 32 s to 1m11s after a resize: the round that formed the new
    world took its recovery into its pace. Steady rounds set the pace; a new world size scales it."""
    pace = Pace(weight=0.5)
    pace.round(5, 1.0, world_size=4, steady=False)  # the first round: the only measure there is
    assert pace.eta_s(100) == 20.0
    pace.round(5, 1.0, world_size=4, steady=True)
    pace.round(1, 9.0, world_size=3, steady=False)  # a recovery: 9 s for one step
    assert pace.eta_s(100) == pytest.approx(20.0 * 4 / 3)  # fewer ranks, same global batch
    pace.round(5, 5 * 0.3, world_size=3, steady=True)
    assert pace.eta_s(100) == pytest.approx(100 * (0.5 * 0.3 + 0.5 * 0.2 * 4 / 3))
    assert Pace().eta_s(10) is None


def _event(type_, step=None, **fields):
    return {"ts": 0.0, "type": type_, **({"step": step} if step is not None else {}), **fields}


def test_the_console_tells_the_story_in_short_lines_and_verbose_prints_every_event():
    node = "6e3cefd89d7bdaa2416f29d4dc918acd25b0bea90c9d4e2f28ae3e03"
    workers = [{"node_id": f"{r // 2:056x}", "pid": r} for r in range(4)]
    events = [
        _event("run_started", run_dir="/r/demo", max_steps=130, global_batch_size=24),
        _event("placement", resources_per_worker={"CPU": 1.0}),
        _event("world_formed", 0, world_size=4, plan={"micro_batch_size": 3, "grad_accum_steps": 2}, join_s=5.94,
               workers=workers),
        _event("checkpoint_saved", 5, tier="memory", peer_nodes=[node] * 3),
        _event("fault_injected", 12, fault="kill_worker", rank=1),
        _event("ray_message", source="raylet", message=f"A worker died ... Node ID: {node}"),
        _event("worker_failed", 12, rank=1, node_id=node, outcome="died",
               error="The actor died unexpectedly before finishing this task.\n\tclass_name: TrainWorker"),
        _event("resize_started", 12, old_world_size=4, new_world_size=3),
        _event("world_formed", 10, world_size=3, plan={}, workers=workers[:3]),
        _event("resize_finished", 10, old_world_size=4, new_world_size=3, recovery_s=1.184, resumed_step=10,
               reason="failure"),
        _event("checkpoint_budget", 15, action="dropped", reason="room"),
        _event("checkpoint_failed", 45, tier="durable", error="RuntimeError: ranks [2] were lost before upload"),
        _event("node_added", 50, node_id=node),
        _event("something_new", 60, detail="x" * 5000),
    ]
    out = io.StringIO()
    console = Console(out, interactive=False)
    for e in events:
        console.event(e)
    console.progress(Progress(10, 130, 5.5, 3119.0, 94.5, 4, 32.0, 5))
    lines = out.getvalue().splitlines()
    assert lines == [
        "[airay] run directory /r/demo, 130 steps of 24 samples",
        "[airay] world of 4 on 2 nodes: micro-batch 3 x 2 accumulation steps, formed in 5.9s",
        "[airay] step 12: chaos: kill_worker (rank 1)",
        "[airay] step 12: rank 1 on node 6e3cefd8 failed: The actor died unexpectedly before finishing this task.",
        "[airay] resize 4 -> 3 (failure) at step 10: recovery 1.18s",
        "[airay] step 45: durable checkpoint failed: RuntimeError: ranks [2] were lost before upload",
        "[airay] step 50: node 6e3cefd8 added",
        lines[7],
        "[airay] step 10/130 | loss 5.5000 | 3.1k tokens/s | world 4 | eta 32s | saved 5",
    ]
    assert lines[7].startswith("[airay] something_new step=60 detail=xxx") and len(lines[7]) == LINE_MAX
    assert all(node not in line for line in lines)

    out = io.StringIO()
    console = Console(out, verbose=True, interactive=False)
    for e in events:
        console.event(e)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines if not line.startswith("\t")] == [e["type"] for e in events]


def test_a_terminal_gets_a_progress_bar_redrawn_in_place_with_the_lines_above_it():
    out = io.StringIO()
    console = Console(out, interactive=True)
    console.progress(Progress(5, 130, 5.6, 3141.0, 95.2, 4, 32.0, None))
    console.event(_event("node_added", 50, node_id="cf1ffb86c4"))
    console.progress(Progress(10, 130, 5.5, 3119.0, 94.5, 4, 30.0, 5))
    console.close()
    text = out.getvalue()
    assert "\r" in text and "5/130" in text and "10/130" in text and "saved 5" in text
    assert "[airay] step 50: node cf1ffb86 added\n" in text


def test_console_lines_stay_short_at_any_world_size_and_events_jsonl_keeps_everything(tmp_path, capsys):
    workers = [{"node_id": f"{r // 8:056x}", "pid": 1000 + r, "device": f"cuda:{r % 8}", "gpu_ids": [r % 8],
                "backend": "nccl", "timeline": {"init_ts": 1.5, "ready_ts": 2.5}, "local_rank": r % 8}
               for r in range(4096)]
    rec = RunRecorder(tmp_path, echo=True, verbose=True)
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

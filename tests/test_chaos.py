"""Fault injection: which rank gets which fault when, and the memory fault's cap (real, in a subprocess)."""

import subprocess
import sys

from airay.chaos import damage_checkpoint, quiet, round_faults, spoil_rows
from airay.config import ChaosSpec


def specs(*items):
    return [ChaosSpec(**i) for i in items]


def test_round_faults_one_shot_and_slow_steps():
    chaos = specs({"fault": "hang_worker", "at_step": 4, "rank": 1, "hang_mode": "sigstop"},
                  {"fault": "slow_worker", "at_step": 3, "rank": 2, "steps": 3, "delay_s": 0.2},
                  {"fault": "kill_worker", "at_step": 4, "rank": 3},
                  {"fault": "add_node", "at_step": 4})
    out = round_faults(chaos, set(), 4, 9, world=3)
    assert out[1] == {4: {"fault": "hang_worker", "hang_mode": "sigstop", "delay_s": 0.5, "collective": 1}}
    assert sorted(out[2]) == [4, 5]  # slow in steps 3..5; this round starts at 4
    assert 3 not in out  # rank 3 is outside a world of 3
    assert 1 not in round_faults(chaos, {0}, 4, 9, world=3)  # already fired
    assert round_faults(chaos, set(), 5, 9, world=4).keys() == {2}


def test_stall_collective_stops_the_rank_just_before_its_kth_collective_of_the_step():
    """The worker strikes it at the step's first forward: the rank blocks when it is about to
    enter its `collective`-th call (airay.commtime); a step with fewer calls blocks at its end."""
    from airay import chaos, commtime

    (fault,) = round_faults(specs({"fault": "stall_collective", "at_step": 6, "rank": 1, "collective": 3}),
                            set(), 6, 10, world=2)[1].values()
    assert fault["fault"] == "stall_collective" and fault["collective"] == 3
    chaos.strike(fault, 6, 1)
    entered, _ = commtime.calls()
    assert commtime._before[0] == entered + 3 and commtime._before[1] is chaos.block_forever
    assert commtime.disarm()  # still waiting: the step made fewer calls (step_done would block here)
    chaos.step_done(fault)  # struck (or disarmed) already: the step ends normally
    assert not commtime.disarm()


def test_rounds_are_quiet_only_when_no_fault_can_act_on_them():
    chaos = specs({"fault": "kill_worker", "at_step": 12, "rank": 1},
                  {"fault": "slow_worker", "at_step": 3, "rank": 2, "steps": 3},
                  {"fault": "kill_worker", "at_step": 2, "rank": 0, "during": "save"})
    assert not quiet(chaos, {1, 2}, 4, 9)  # slow steps 3..5 (fired at 3)
    assert quiet(chaos, {1, 2}, 6, 12)  # after the slow steps, before the kill at 12
    assert not quiet(chaos, {1, 2}, 6, 13)  # the kill at 12 is still to fire
    assert quiet(chaos, {0, 1, 2}, 13, 20)  # it fired
    assert not quiet(chaos, {0, 1}, 13, 20)  # the save-time kill waits for a save past step 2
    assert quiet([], set(), 0, 100)


def test_exhaust_memory_raises_memory_error_within_its_cap():
    code = ("import resource; from airay.chaos import exhaust_memory\n"
            "before = resource.getrlimit(resource.RLIMIT_AS)\n"
            "try:\n    exhaust_memory()\nexcept MemoryError:\n    print('MemoryError')\n"
            "assert resource.getrlimit(resource.RLIMIT_AS) == before\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "MemoryError"
    assert int(out[1]) < 600 * 1024  # peak RSS in KiB: the cap kept it to a small headroom


def test_checkpoint_faults_pick_their_file_and_copies(tmp_path):
    """corrupt_checkpoint damages every copy (each node's, the durable one, same size: only
    checksums tell) of the largest optimizer-state file, which every load reads (a ZeRO-1/2 load
    never reads the model file's trained weights); corrupt_memory_copy the rank's own copy of its
    largest file; lose_node_memory the rank's node's copies."""
    from types import SimpleNamespace

    from airay.checkpoint.layout import CheckpointInfo, FileEntry, Manifest
    from airay.checkpoint.storage import Storage

    files = {"mp_rank_00_model_states.pt": FileEntry(900, 1, 0), "zero_pp_rank_0_mp_rank_00_optim_states.pt":
             FileEntry(500, 2, 0), "zero_pp_rank_1_mp_rank_00_optim_states.pt": FileEntry(600, 3, 1)}
    manifest = Manifest(10, 2, 2, {}, files)
    memory = CheckpointInfo(10, 2, 1900, "memory", "memory:step_00000010", manifest=manifest)
    durable = CheckpointInfo(10, 2, 1900, "durable", "d", manifest=manifest)
    calls = []

    class Group:
        def member(self, rank):
            return SimpleNamespace(node_id=f"node{rank}")

        def damage_memory(self, step, name, nodes=None):
            calls.append(("damage", step, name, nodes))
            return [f"{n or 'every node'}:{name}" for n in (nodes or [None])]

        def drop_memory(self, step, node):
            calls.append(("drop", step, node))
            return ["x.pt"]

    storage = Storage(str(tmp_path))
    big = bytes(range(256)) * 4
    storage.write_bytes("step_00000010/zero_pp_rank_1_mp_rank_00_optim_states.pt", big)
    done = damage_checkpoint("corrupt_checkpoint", [memory, durable], Group(), 1, storage)
    assert done["file"] == "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert calls[-1] == ("damage", 10, done["file"], None)
    after = storage.read_bytes("step_00000010/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert len(after) == len(big) and after != big and len(done["copies"]) == 2
    done = damage_checkpoint("corrupt_memory_copy", [memory, durable], Group(), 1, storage)
    assert done["file"] == "zero_pp_rank_1_mp_rank_00_optim_states.pt" and done["node_id"] == "node1"
    assert calls[-1] == ("damage", 10, done["file"], ["node1"])
    done = damage_checkpoint("lose_node_memory", [memory, durable], Group(), 0, storage)
    assert calls[-1] == ("drop", 10, "node0") and done["removed"] == ["x.pt"]


def test_spoil_rows_replaces_only_the_ranks_rows_and_keeps_every_offset():
    # A step of 24 rows from two blocks: rows 0-9 are block a's 30-40, rows 10-23 block b's 0-14.
    pieces = [("a", 30, 40), ("b", 0, 14)]
    # Rank 1 of 4 (6 rows each): rows 6-12, across the blocks' boundary.
    assert spoil_rows(pieces, 6, 12, "X") == [("a", 30, 36), ("X", 36, 40), ("X", 0, 2), ("b", 2, 14)]
    assert spoil_rows(pieces, 0, 6, "X") == [("X", 30, 36), ("a", 36, 40), ("b", 0, 14)]
    assert spoil_rows(pieces, 18, 24, "X") == [("a", 30, 40), ("b", 0, 8), ("X", 8, 14)]
    assert spoil_rows(pieces, 10, 24, "X") == [("a", 30, 40), ("X", 0, 14)]
    for lo, hi in [(0, 6), (6, 12), (12, 18), (18, 24)]:  # row counts and order stay the step's
        out = spoil_rows(pieces, lo, hi, "X")
        assert sum(b - a for _, a, b in out) == 24
        pos, bad = 0, []
        for r, a, b in out:
            if r == "X":
                bad.append((pos, pos + b - a))
            pos += b - a
        assert (bad[0][0], bad[-1][1]) == (lo, hi)


class Recorder:
    """Events, as the run directory would hold them."""

    def __init__(self):
        self.events = []

    def event(self, type_, step=None, **fields):
        self.events.append({"type": type_, "step": step, **fields})
        return self.events[-1]


def test_faults_in_form_save_and_load_strike_once_at_the_first_such_call_past_their_step():
    from airay.chaos_hook import ChaosHook

    rec = Recorder()
    hook = ChaosHook(specs({"fault": "kill_worker", "during": "save", "at_step": 10, "rank": 3},
                           {"fault": "kill_worker", "during": "form", "at_step": 10, "rank": 2},
                           {"fault": "hang_worker", "during": "load", "at_step": 5, "rank": 1},
                           {"fault": "kill_worker", "at_step": 12, "rank": 0}), rec)
    assert hook.round_starts() == [12]  # only step faults shape the rounds
    assert hook.call("save", 5, world=4) == {} and hook.call("form", 0, world=4) == {}  # not reached yet
    assert hook.call("save", 10, world=4) == {3: {"fault": "kill_worker", "hang_mode": "sleep", "delay_s": 0.5}}
    assert hook.call("save", 15, world=4) == {}  # once
    assert hook.call("form", 10, world=2) == {}  # rank 2 is outside a world of 2: skipped, said so
    assert rec.events[-1]["type"] == "fault_skipped" and rec.events[-1]["chaos_index"] == 1
    assert hook.call("load", 5, world=2) == {1: {"fault": "hang_worker", "hang_mode": "sleep", "delay_s": 0.5}}
    injected = [e for e in rec.events if e["type"] == "fault_injected"]
    assert [(e["chaos_index"], e["during"], e["step"]) for e in injected] == [(0, "save", 10), (2, "load", 5)]


def test_a_restarted_driver_does_not_inject_a_fault_an_earlier_driver_of_the_run_injected():
    from airay.chaos_hook import ChaosHook

    chaos = specs({"fault": "kill_driver", "at_step": 12}, {"fault": "kill_worker", "during": "form", "at_step": 3})
    earlier = [{"type": "fault_injected", "fault": "kill_driver", "chaos_index": 0}]
    hook = ChaosHook(chaos, Recorder(), earlier_events=earlier)
    assert hook.round_starts() == []  # kill_driver at 12 fired already: a restart resuming before 12 runs on
    assert 0 in hook.call("form", 5, world=4)

"""Fault injection: which rank gets which fault when, and the memory fault's cap (real, in a subprocess)."""

import subprocess
import sys

from airay.chaos import corrupt_checkpoint, round_faults, spoil_rows
from airay.config import ChaosSpec


def specs(*items):
    return [ChaosSpec(**i) for i in items]


def test_round_faults_one_shot_and_slow_steps():
    chaos = specs({"fault": "hang_worker", "at_step": 4, "rank": 1, "hang_mode": "sigstop"},
                  {"fault": "slow_worker", "at_step": 3, "rank": 2, "steps": 3, "delay_s": 0.2},
                  {"fault": "kill_worker", "at_step": 4, "rank": 3},
                  {"fault": "add_node", "at_step": 4})
    out = round_faults(chaos, set(), 4, 9, world=3)
    assert out[1] == {4: {"fault": "hang_worker", "hang_mode": "sigstop", "delay_s": 0.5}}
    assert sorted(out[2]) == [4, 5]  # slow in steps 3..5; this round starts at 4
    assert 3 not in out  # rank 3 is outside a world of 3
    assert 1 not in round_faults(chaos, {0}, 4, 9, world=3)  # already fired
    assert round_faults(chaos, set(), 5, 9, world=4).keys() == {2}


def test_exhaust_memory_raises_memory_error_within_its_cap():
    code = ("import resource; from airay.chaos import exhaust_memory\n"
            "before = resource.getrlimit(resource.RLIMIT_AS)\n"
            "try:\n    exhaust_memory()\nexcept MemoryError:\n    print('MemoryError')\n"
            "assert resource.getrlimit(resource.RLIMIT_AS) == before\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "MemoryError"
    assert int(out[1]) < 600 * 1024  # peak RSS in KiB: the cap kept it to a small headroom


def test_corrupt_checkpoint_keeps_size_and_changes_bytes(tmp_path):
    (tmp_path / "universal").mkdir()
    big = tmp_path / "universal" / "w.pt"
    big.write_bytes(bytes(range(256)) * 8)
    (tmp_path / "universal" / "small.pt").write_bytes(b"x")
    before = big.read_bytes()
    assert corrupt_checkpoint(tmp_path, "universal") == "universal/w.pt"
    after = big.read_bytes()
    assert len(after) == len(before) and after != before


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

"""The driver's own CPU per round and per recovery at 64 to 4,096 ranks.

The real Controller (airay.controller) runs a job against the scripted worker group of the unit
tests (tests/fake_group.py: no Ray, no processes, steps instant), so what is measured is the
driver's work alone: gathering and classifying a round's outcomes, recording its steps (metrics,
TensorBoard, Ray gauges, events), straggler checks, checkpoint commits (manifests of one file per
rank, the durable tier's listing and commit on a local directory) and, after a rank dies, the
recovery: the failure's events, the new world's plan, checkpoint choice, re-form and load.

Each of the controller's state methods is timed with time.process_time (CPU of this process, all
threads): `_running` once per round (a round gathered; with a checkpoint every `--save-every`
rounds), `_recovering` once per rank death (drop the rank, decide, choose the checkpoint, form
the shrunk world, load it: everything up to the new world's first round), `_growing` once per
regrow (the replacement joining). The fake group's own work inside those calls (making each
rank's step records, writing the durable tier's files, its bookkeeping) is timed apart and
subtracted: it stands for the ranks and Ray, not the driver. What stays is the controller, the
Checkpointer, the durable tier, the event and metrics files and telemetry. Medians over calls.
The console (`-v`: every event, the most it prints, and the progress lines) goes to a counter: its
longest line is reported.

Usage: python benchmarks/driver_scale.py [--workers 64,512,4096] [--rounds 40] [--deaths 3]
           [--reduced] [--json FILE]
Targets: per round < 10 ms + 0.01 ms per rank; per recovery < 100 ms at 4,096 ranks.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from airay.config import JobConfig  # noqa: E402
from airay.controller import Controller  # noqa: E402
from airay.events import RunRecorder  # noqa: E402
from tests.fake_group import FakeGroup  # noqa: E402

STEPS_PER_ROUND = 5
RANKS_PER_NODE = 8
RECOVERY_TARGET_MS = 100.0


def round_target_ms(workers: int) -> float:
    return 10.0 + 0.01 * workers


class Console(io.TextIOBase):
    """stdout of the run: counts lines and keeps the longest."""

    def __init__(self):
        self.lines, self.longest, self._open = 0, "", ""

    def write(self, text: str) -> int:
        parts = (self._open + text).split("\n")
        self._open = parts.pop()
        for line in parts:
            self.lines += 1
            if len(line) > len(self.longest):
                self.longest = line
        return len(text)


class CpuMeter:
    """CPU time (time.process_time) of calls, and of the fake group's calls made inside them."""

    def __init__(self):
        self.fake = 0.0  # CPU in the fake group's methods so far
        self._depth = 0

    def wrap_group(self, group) -> None:
        """Time every public method of `group` (the outermost call only: they call each other)."""
        for name in dir(group):
            if name.startswith("_") or not callable(getattr(group, name)):
                continue
            setattr(group, name, self._timed_fake(getattr(group, name)))

    def _timed_fake(self, fn):
        def call(*args, **kwargs):
            self._depth += 1
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.fake += time.process_time() - t0
        return call

    def timed_state(self, fn, log: list):
        """Wrap a controller state method: each call appends (driver CPU s, fake group CPU s)."""
        def call():
            fake0, t0 = self.fake, time.process_time()
            try:
                return fn()
            finally:
                total, fake = time.process_time() - t0, self.fake - fake0
                log.append((total - fake, fake))
        return call


def job(workers: int, rounds: int, save_every: int, work: Path) -> dict:
    steps = rounds * STEPS_PER_ROUND
    return {"name": f"driver-scale-{workers}", "model": {"factory": "airay.models.tiny_gpt:build"},
            "loss_fn": "airay.models.tiny_gpt:loss", "global_batch_size": 2 * workers, "micro_batch_size": 2,
            "max_steps": steps, "steps_per_round": STEPS_PER_ROUND,
            "scaling": {"min_workers": workers // 2, "max_workers": workers, "resources_per_worker": {"CPU": 1}},
            "checkpoint": {"every_n_steps": 2 * save_every * STEPS_PER_ROUND,
                           "fast_every_n_steps": save_every * STEPS_PER_ROUND, "keep_last": 2,
                           "memory_path": str(work / "shm")},
            "health": {"restart_backoff_s": 0}, "max_failures": 100,
            "timeouts": {"capacity_wait_s": 5, "grow_settle_s": 0}, "run_dir": str(work / "run")}


def death_script(workers: int, rounds: int, deaths: int) -> dict:
    """A rank dies in the train calls spread over the run, each on another node."""
    calls = [round((k + 1) * rounds / (deaths + 1)) for k in range(deaths)]
    return {"train": {n: {(k + 1) * workers // (deaths + 1) + 1: "died"} for k, n in enumerate(calls)}}


def _ms(log: list, i: int = 0) -> list[float]:
    return [entry[i] * 1e3 for entry in log]


def measure(workers: int, rounds: int, deaths: int, save_every: int) -> dict:
    meter = CpuMeter()
    script = death_script(workers, rounds, deaths)
    # The first world is up at once; each replacement two polls later: the recovery shrinks the
    # world, a grow brings the replacement in a round after.
    factory = FakeGroup.factory(script, capacity=workers, nodes=max(1, workers // RANKS_PER_NODE),
                                ready_after=[0] * workers + [2] * deaths)

    def make(*args, **kwargs):
        group = factory(*args, **kwargs)
        meter.wrap_group(group)
        return group

    make.default_resources = factory.default_resources
    logs: dict[str, list] = {"running": [], "recovering": [], "growing": [], "starting": []}
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ctl = Controller(JobConfig.from_dict(job(workers, rounds, save_every, work)),
                         RunRecorder(work / "run", echo=True, verbose=True), None, group_factory=make)
        for state in logs:
            setattr(ctl, f"_{state}", meter.timed_state(getattr(ctl, f"_{state}"), logs[state]))
        t0 = time.perf_counter()
        with redirect_stdout(console):
            result = ctl.run()
        wall = time.perf_counter() - t0
        jsonl_longest = max(len(line) for line in (work / "run" / "events.jsonl").read_text().splitlines())
    assert result.status == "finished", result.error
    assert result.restarts == deaths, (result.restarts, deaths)
    assert result.world_sizes[0] == workers and result.world_sizes[-1] == workers, result.world_sizes
    saves = factory.made[0].counts.get("save", 0)
    # The last _running call finishes the run (final checkpoint, wait): not a round.
    rounds_log = logs["running"][:-1]
    per_round = _ms(rounds_log)
    target = round_target_ms(workers)
    row = {"workers": workers, "nodes": max(1, workers // RANKS_PER_NODE), "rounds": len(rounds_log),
           "saves": saves, "recoveries": len(logs["recovering"]), "grows": len(logs["growing"]),
           "round_ms": statistics.median(per_round), "round_ms_mean": statistics.mean(per_round),
           "round_ms_max": max(per_round),
           "round_fake_ms": statistics.median(_ms(rounds_log, 1)),
           "recovery_ms": statistics.median(_ms(logs["recovering"])),
           "recovery_ms_all": _ms(logs["recovering"]),
           "recovery_fake_ms": statistics.median(_ms(logs["recovering"], 1)),
           "grow_ms": statistics.median(_ms(logs["growing"])) if logs["growing"] else None,
           "start_ms": _ms(logs["starting"])[0],
           "round_target_ms": target, "recovery_target_ms": RECOVERY_TARGET_MS,
           "console_lines": console.lines, "console_longest": len(console.longest),
           "events_jsonl_longest": jsonl_longest, "wall_s": wall}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="64,512,4096", help="world sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of steps per run (before replays)")
    ap.add_argument("--deaths", type=int, default=3, help="rank deaths per run (each a recovery and a regrow)")
    ap.add_argument("--save-every", type=int, default=5, help="a checkpoint every this many rounds")
    ap.add_argument("--reduced", action="store_true", help="64 and 512 ranks, 12 rounds, one death (the suite's run)")
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()
    sizes = [int(w) for w in args.workers.split(",")]
    rounds, deaths = args.rounds, args.deaths
    if args.reduced:
        sizes, rounds, deaths = [w for w in sizes if w <= 512] or [64], 12, 1
    rows = [measure(w, rounds, deaths, args.save_every) for w in sizes]
    print(f"{'ranks':>6} {'round ms':>9} {'mean':>7} {'max':>7} {'target':>7} {'recovery ms':>12} "
          f"{'target':>7} {'grow ms':>8} {'fake/round':>10} {'console max':>11}")
    for r in rows:
        print(f"{r['workers']:>6} {r['round_ms']:>9.2f} {r['round_ms_mean']:>7.2f} {r['round_ms_max']:>7.1f} "
              f"{r['round_target_ms']:>7.2f} {r['recovery_ms']:>12.2f} {RECOVERY_TARGET_MS:>7.0f} "
              f"{r['grow_ms'] or 0:>8.2f} {r['round_fake_ms']:>10.2f} {r['console_longest']:>11}")
    top = rows[-1]
    print(f"driver CPU at {top['workers']} ranks: {top['round_ms']:.2f} ms per round (target < "
          f"{top['round_target_ms']:.2f} ms), {top['recovery_ms']:.1f} ms per recovery (target < "
          f"{RECOVERY_TARGET_MS:.0f} ms at 4,096 ranks)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {"rounds": rounds, "deaths": deaths,
                                                        "save_every": args.save_every,
                                                        "steps_per_round": STEPS_PER_ROUND},
                                               "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

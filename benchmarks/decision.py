"""The controller's decision path at fleet scale: one failure among N workers -> the new plan.

What the driver computes between "a round came back with a dead rank" and "form the new world",
on the same pure functions the controller calls (airay.health, airay.policy): classify the
round's N outcomes, decide shrink-or-wait, pick the batch plan of the new size, renumber the
survivors, and end the next round. Actor calls and Ray's own work are not part of it (they are
in benchmarks/recovery.py).

Usage: python benchmarks/decision.py [--workers 4096] [--repeats 21] [--json FILE]
Target: under 100 ms at 4,096 workers.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airay import policy  # noqa: E402
from airay.health import RankOutcome, classify_round  # noqa: E402

TARGET_MS = 100.0


def decision_path(outcomes: list[RankOutcome], global_batch: int, max_micro: int, min_workers: int,
                  max_workers: int, step: int) -> tuple[int, policy.BatchPlan, list[int], int]:
    verdict = classify_round(outcomes)
    lost = set(verdict.lost_ranks)
    survivors = [o.rank for o in outcomes if o.rank not in lost]
    decision = policy.decide_recovery(len(survivors), 0, policy.allowed_world_sizes(min_workers, max_workers))
    plan = policy.plan_batch(global_batch, max_micro, decision.new_world_size)
    new_ranks = {old: new for new, old in enumerate(survivors)}
    end = policy.next_round_end(step, 10**9, 5, 100, [])
    return decision.new_world_size, plan, [new_ranks[r] for r in survivors], end


def measure(workers: int, repeats: int) -> dict:
    # A global batch that splits evenly over N and N-1 workers (the sizes this failure moves between).
    global_batch = math.lcm(workers, workers - 1) * 2
    outcomes = [RankOutcome(r, "errored", "gloo: Connection closed by peer") for r in range(workers)]
    outcomes[workers // 3] = RankOutcome(workers // 3, "died", "actor died: SIGKILL")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        size, plan, ranks, _ = decision_path(outcomes, global_batch, 16, workers // 2, workers, 1234)
        times.append((time.perf_counter() - t0) * 1000)
    assert size == workers - 1 and plan is not None and plan.global_batch_size == global_batch
    assert ranks == list(range(workers - 1))
    return {"workers": workers, "median_ms": statistics.median(times), "min_ms": min(times),
            "max_ms": max(times), "repeats": repeats, "target_ms": TARGET_MS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", help="also write the numbers to this file")
    args = ap.parse_args()
    rows = [measure(n, args.repeats) for n in sorted({n for n in (64, 512) if n < args.workers} | {args.workers})]
    print(f"{'workers':>8} {'median ms':>10} {'min':>8} {'max':>8}")
    for r in rows:
        print(f"{r['workers']:>8} {r['median_ms']:>10.3f} {r['min_ms']:>8.3f} {r['max_ms']:>8.3f}")
    top = rows[-1]
    print(f"decision path at {top['workers']} workers: {top['median_ms']:.3f} ms median "
          f"(target < {TARGET_MS:.0f} ms; {TARGET_MS / top['median_ms']:.0f}x headroom)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Many jobs on one fleet, simulated: Kueue-like eviction vs shrink-instead-of-evict vs goodput-aware.

The scheduler's three policies (airay.sched.policy: `evict`, whole lower-priority jobs evicted and
requeued, sizes fixed at admission; `shrink`, lower-priority elastic jobs shrunk first, a whole
job preempted (checkpointed) only when that cannot make room, grow-back when capacity frees;
`goodput`, shrink but a grow only when it pays for its resize) run over the same generated trace
of 1,000+ jobs (airay.sched.trace.generate: sizes, run times, priorities, teams and quotas, a
diurnal Poisson arrival process at 90% offered load) on 1,024 and 4,096 GPUs, by
airay.sched.simulate. Each seed is a trace; the rows are means over the seeds, each ratio against
the evict policy on the same fleet (its spread: the smallest and largest per-seed ratio).

Resizes cost airay's measured warm recovery (airay/measured.json) and a restart its measured cold
start; `--slow-resize-s` reruns shrink and goodput as if a resize took that long (an assumption
about large models at thousands of GPUs, not a measurement): the case the goodput policy is for.

Usage: python benchmarks/sched_sim.py [--jobs 1200] [--gpus 1024,4096] [--seeds 3] [--load 0.9]
           [--slow-resize-s 300] [--reduced] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airay.sched.policy import POLICIES  # noqa: E402
from airay.sched.simulate import Settings, compare, table  # noqa: E402
from airay.sched.trace import TEAMS  # noqa: E402

NUMERIC = ("mean_jct_s", "p99_jct_s", "high_wait_mean_s", "high_wait_p99_s", "wait_mean_s", "utilisation",
           "lost_gpu_h", "lost_work_gpu_h", "lost_idle_gpu_h", "resizes", "preemptions", "makespan_s")


def aggregate(runs: list[dict]) -> list[dict]:
    """Means over seeds per (fleet, resize cost, policy), with ratios against evict on the same fleet and seed."""
    evict = {(r["gpus"], r["seed"]): r for r in runs if r["policy"] == "evict"}
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["gpus"], r["resize_s"], r["policy"]), []).append(r)
    rows = []
    for (gpus, resize_s, policy), rs in groups.items():
        row = {"gpus": gpus, "resize_s": resize_s, "policy": policy, "seeds": len(rs), "jobs": rs[0]["jobs"],
               "high_priority": rs[0]["high_priority"], "high_jobs": sum(r["high_jobs"] for r in rs)}
        row.update({k: statistics.fmean(r[k] for r in rs) for k in NUMERIC})
        for key in ("mean_jct_s", "p99_jct_s", "lost_gpu_h"):
            per_seed = [r[key] / evict[gpus, r["seed"]][key] for r in rs if evict[gpus, r["seed"]][key] > 0]
            base = statistics.fmean(evict[gpus, r["seed"]][key] for r in rs)
            row[f"{key}_vs_evict"] = row[key] / base if base > 0 else None
            row[f"{key}_vs_evict_range"] = [min(per_seed), max(per_seed)] if per_seed else None
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1200)
    ap.add_argument("--gpus", default="1024,4096")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--slow-resize-s", type=float, default=300.0, help="0: leave the slow-resize rows out")
    ap.add_argument("--reduced", action="store_true", help="200 jobs on 1,024 GPUs, one seed (seconds)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    if args.reduced:
        args.jobs, args.gpus, args.seeds = 200, "1024", 1
    fleets = [int(g) for g in args.gpus.split(",")]
    measured = Settings().resize_s
    runs = []
    for seed in range(args.seeds):
        for resize_s, policies in ((measured, POLICIES), (args.slow_resize_s, ("shrink", "goodput"))):
            if resize_s <= 0:
                continue
            for r in compare(fleets, policies, jobs=args.jobs, seed=seed, load=args.load, resize_s=resize_s):
                runs.append({**r, "seed": seed})
    rows = aggregate(runs)
    print(f"{args.jobs} jobs per trace, offered load {args.load}, means over {args.seeds} seeds")
    print(table(rows))
    for r in rows:
        if r["policy"] != "evict":
            print(f"{r['gpus']:>5} GPUs, {r['policy']} (resize {r['resize_s']:g} s) / evict: mean JCT "
                  f"{r['mean_jct_s_vs_evict']:.3f}, p99 JCT {r['p99_jct_s_vs_evict']:.3f}, lost GPU-h "
                  f"{r['lost_gpu_h_vs_evict']:.3f}")
    s = Settings()
    result = {"args": {k: getattr(args, k) for k in ("jobs", "gpus", "seeds", "load", "slow_resize_s")},
              "settings": {"resize_s": s.resize_s, "cold_restart_s": s.cold_restart_s,
                           "checkpoint_interval_s": s.checkpoint_interval_s, "horizon_s": s.horizon_s,
                           "gpus_per_node": s.gpus_per_node, "scaling": s.scaling},
              "teams": {t: {"job_share": j, "quota_share": q} for t, (j, q) in TEAMS.items()},
              "rows": rows, "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

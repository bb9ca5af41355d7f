"""Issues 27 and 28's scenario, as a new user runs it: does the memory tier stay within the machine?

The tiny GPT at d_model 1024, 8 layers (100M parameters), sequence 8, global batch 12, micro-batch
1, ZeRO-2, 4 workers on a local cluster of 4 one-CPU nodes on this machine; a memory-tier save
every 2 steps and a durable one every 4, the memory tier in its default place (/dev/shm/airay,
RAM) with its default budget and retention; rank 1 SIGKILLed at step 7; 12 steps. The same job without the fault is the reference. Before the
tier had a budget, /dev/shm held 11 GB after the kill and the regrow beside four 2.6 GB workers:
Ray's memory monitor killed every rank, every node was excluded and the run failed.

Reported: the run's status and world sizes, the nodes excluded (target: none), how the ranks
were lost (worker_failed outcomes), each node's tier budget and the peak bytes its tier held on
/dev/shm (sampled every 50 ms), the budget's actions (checkpoint_budget), and the worst relative
difference between the faulty run's committed losses and the fault-free run's (target < 1e-5).
Every step is CPU work (no sleep). Usage:
  python benchmarks/memory_pressure.py [--d-model 1024] [--steps 12] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.sampler import Sampler  # noqa: E402

WORKERS, LAYERS, SEQ = 4, 8, 8


def job(run_dir: Path, durable: Path, d_model: int, steps: int, kill: bool) -> dict:
    return {"name": f"pressure-{d_model}-{'kill' if kill else 'plain'}",
            "model": {"factory": "airay.models.tiny_gpt:build",
                      "kwargs": {"d_model": d_model, "n_layers": LAYERS, "n_heads": 8, "seq_len": SEQ}},
            "loss_fn": "airay.models.tiny_gpt:loss", "data": {"kwargs": {"seq_len": SEQ}},
            "deepspeed": {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}},
            "global_batch_size": 12, "micro_batch_size": 1, "max_steps": steps, "steps_per_round": 1,
            "scaling": {"min_workers": 2, "max_workers": WORKERS},
            "checkpoint": {"path": str(durable), "every_n_steps": 4, "fast_every_n_steps": 2},
            "chaos": [{"fault": "kill_worker", "at_step": 7, "rank": 1}] if kill else [],
            "timeouts": {"capacity_wait_s": 300, "hang_timeout_s": 300, "collective_timeout_s": 600,
                         "phase_timeout_s": 600},
            "run_dir": str(run_dir)}


class TierSampler(Sampler):
    """Peak bytes each node's memory tier holds: the directories `pattern` finds under `base`."""

    period_s = 0.05

    def __init__(self, base: Path, pattern: str = "node-*"):
        super().__init__()
        self.base, self.pattern, self.peak = Path(base), pattern, {}

    def sample(self) -> None:
        for node in self.base.glob(self.pattern):
            held = 0
            for f in node.glob("step_*/*"):
                try:
                    held += f.stat().st_size
                except FileNotFoundError:  # pruned meanwhile
                    pass
            self.peak[node.name] = max(self.peak.get(node.name, 0), held)


def run(d_model: int, steps: int, kill: bool, work: Path) -> dict:
    import ray

    from airay import JobConfig, fit
    from airay.checkpoint.tiers import memory_base
    from airay.config import LocalClusterSpec
    from airay.events import committed_losses, read_jsonl
    from airay.local_cluster import LocalCluster

    run_dir, durable = work / "run", work / "durable"
    spec = JobConfig.from_dict(job(run_dir, durable, d_model, steps, kill))
    lc = LocalCluster(LocalClusterSpec(local_nodes=WORKERS, cpus_per_node=1))
    ray.init(address=lc.address, logging_level="WARNING", log_to_driver=False)
    try:
        with TierSampler(memory_base(None, str(durable))) as tiers:
            result = fit(spec, echo=False)
    finally:
        ray.shutdown()
        lc.shutdown()
    events = read_jsonl(run_dir / "events.jsonl")
    of = lambda kind: [e for e in events if e["type"] == kind]  # noqa: E731
    budget = of("memory_budget")
    return {"status": result.status, "error": result.error, "world_sizes": result.world_sizes,
            "losses": committed_losses(run_dir), "excluded": [e["node_id"] for e in of("node_excluded")],
            "lost": [{"rank": e["rank"], "outcome": e["outcome"], "step": e["step"]} for e in of("worker_failed")],
            "budget_bytes": budget[0]["budget_bytes"] if budget else None,
            "tier_peak_bytes": tiers.peak,
            "budget_actions": [{k: e.get(k) for k in ("step", "action", "dropped_steps", "no_peer_nodes")}
                               for e in of("checkpoint_budget")],
            "checkpoint_bytes": max((e["bytes"] for e in of("checkpoint_saved")), default=None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    import torch

    from airay.models import tiny_gpt

    with torch.device("meta"):
        params = sum(p.numel() for p in tiny_gpt.build(d_model=args.d_model, n_layers=LAYERS, n_heads=8,
                                                       seq_len=SEQ).parameters())
    out = {"d_model": args.d_model, "parameters": params, "workers": WORKERS, "steps": args.steps}
    for side, kill in (("fault_free", False), ("kill", True)):
        with tempfile.TemporaryDirectory() as d:
            out[side] = r = run(args.d_model, args.steps, kill, Path(d))
        peak = max(r["tier_peak_bytes"].values(), default=0)
        print(f"{side}: {r['status']}, worlds {r['world_sizes']}, lost {r['lost']}, excluded {r['excluded']}; "
              f"checkpoint {(r['checkpoint_bytes'] or 0) / 1e9:.2f} GB; tier budget per node "
              f"{(r['budget_bytes'] or 0) / 1e9:.2f} GB, peak held by a node {peak / 1e9:.2f} GB; "
              f"budget actions {len(r['budget_actions'])}", flush=True)
    plain, faulty = out["fault_free"]["losses"], out["kill"]["losses"]
    same = sorted(plain) == sorted(faulty) == list(range(args.steps))
    out["worst_loss_rel_diff"] = max(abs(faulty[s] - plain[s]) / abs(plain[s]) for s in plain) if same else None
    out["tier_within_budget"] = all(
        max(out[s]["tier_peak_bytes"].values(), default=0) <= (out[s]["budget_bytes"] or 0)
        for s in ("fault_free", "kill"))
    print(f"{params / 1e6:.0f}M parameters, ZeRO-2 on {WORKERS} ranks, rank 1 killed at step 7: "
          f"status {out['kill']['status']}, nodes excluded {len(out['kill']['excluded'])} (target 0), every step "
          f"committed {same}, worst relative loss difference {out['worst_loss_rel_diff']} (target < 1e-5), "
          f"tiers within budget {out['tier_within_budget']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if out["kill"]["status"] == "finished" and same and not out["kill"]["excluded"] else 1


if __name__ == "__main__":
    sys.exit(main())

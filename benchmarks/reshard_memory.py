"""What a resharded load adds to a rank's own memory while it runs: airay's reshard gathering the
new partition's fp32 masters into the engine's, against gathering them into tensors of their own
that DeepSpeed's loader then copies (what the reshard did before).

A world of 4 gloo processes (no Ray) trains the tiny GPT (d_model 1024, 8 layers: 101.3M
parameters) a step with AdamW and saves its native checkpoint to /dev/shm; then, turn by turn, a
world of 3 builds its engine and loads it through airay's LoadPlan (airay.checkpoint.loading,
resharded 4 -> 3), with and without the gather into the engine's buffers
(airay.checkpoint.reshard.engine_buffers). Each rank samples its RssAnon (/proc/self/status:
its own memory, not the checkpoint files it maps) every 2 ms through load_engine. Reported per
ZeRO stage: the growth of each rank's anonymous memory over its value before the load, at its
peak, the worst rank, median of the turns, for both ways; and what the new partition's masters
weigh (4 bytes a parameter over the world). Steps are CPU work.

Usage: python benchmarks/reshard_memory.py [--stages 2,3] [--turns 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"d_model": 1024, "n_layers": 8, "n_heads": 8, "seq_len": 8}
OLD, NEW = 4, 3


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _save(rank: int, stage: int, port: int, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    from airay.checkpoint.reshard import layout_of
    from tests import test_reshard

    test_reshard.MODEL = MODEL
    engine, plan = test_reshard._engine(rank, OLD, stage, port)
    test_reshard._train(engine, plan, rank, range(1))
    engine.save_checkpoint(out, tag="ck", save_latest=False)
    if rank == 0:
        Path(out, "layout.json").write_text(json.dumps(layout_of(engine)))


def _load(rank: int, stage: int, port: int, out: str, into: bool, results) -> None:
    sys.path.insert(0, str(ROOT))
    import deepspeed.comm as dist

    from airay.checkpoint import reshard
    from airay.checkpoint.layout import Manifest
    from airay.checkpoint.loading import LoadPlan, load_engine, needed_files, trained_keys
    from airay.checkpoint.staging import Writer, install
    from airay.worker.memory import release_heap
    from tests import test_reshard

    test_reshard.MODEL = MODEL
    if not into:  # the reshard as it was: the masters gathered apart, then copied by DeepSpeed
        reshard.engine_buffers = lambda engine: None
    old = Path(out, "ck")
    names = sorted(p.name for p in old.iterdir() if p.name.endswith(".pt"))
    manifest = Manifest(0, OLD, stage, {}, {n: None for n in names}, json.loads(Path(out, "layout.json").read_text()))
    engine, _ = test_reshard._engine(rank, NEW, stage, port)
    layout = reshard.layout_of(engine)
    need = needed_files(manifest, rank, NEW, layout)
    plan = LoadPlan(manifest, rank, NEW, {n: str(old / n) for n in need}, layout, trained_keys(engine))
    install(engine, Writer()).plan = plan
    release_heap()
    dist.barrier()
    before, peak, done = rss_anon(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        load_engine(engine, plan, Path(out) / f"load-{rank}-{into}", "ck")
    finally:
        done.set()
        sampler.join()
    results[rank] = max(peak[0], rss_anon()) - before


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.stored import write_result
    import torch

    from airay.models import tiny_gpt
    from airay.worker import free_port
    from tests import worlds

    with torch.device("meta"):
        params = sum(p.numel() for p in tiny_gpt.build(**MODEL).parameters())
    masters = 4 * params / NEW
    rows = []
    for stage in map(int, args.stages.split(",")):
        out = tempfile.mkdtemp(prefix="airay-reshard-memory-", dir="/dev/shm")
        try:
            worlds.spawn(_save, args=(stage, free_port(), out), nprocs=OLD)
            growth = {True: [], False: []}
            for _ in range(args.turns):
                for into in (False, True):
                    results = mp.Manager().dict()
                    worlds.spawn(_load, args=(stage, free_port(), out, into, results), nprocs=NEW)
                    growth[into].append(max(results.values()))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        row = {"stage": stage, "parameters": params, "masters_bytes_per_rank": masters,
               "apart_growth": statistics.median(growth[False]), "into_growth": statistics.median(growth[True]),
               "turns": {"apart": growth[False], "into": growth[True]}}
        rows.append(row)
        print(f"ZeRO-{stage}, {params / 1e6:.1f}M parameters, {OLD} -> {NEW} ranks: a rank's own memory grows by "
              f"{row['into_growth'] / 2**20:.0f} MiB through the load with the masters gathered into the engine's, "
              f"{row['apart_growth'] / 2**20:.0f} MiB gathered apart (the new masters: {masters / 2**20:.0f} MiB a "
              f"rank)  [worst rank, median of {args.turns}]", flush=True)
    if args.json:
        write_result(args.json, "reshard_memory.py", model=MODEL, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

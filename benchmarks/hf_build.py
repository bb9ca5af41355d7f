"""What a resize's model build costs a rank at ZeRO stages 0-2 with a Hugging Face model:
`hf.without_weights` (airay's build for a checkpoint to fill) against a build that initialises.

At stages 0-2 every rank holds the whole model, and at every resize each survivor builds its
model again before the checkpoint's weights are loaded over it. The baseline is `hf.build` from a
config: transformers' `from_config` with its initialisation (each layer's own at construction,
then the model's `init_weights`), which is what `without_weights` ran at stages 0-2 before it
built under transformers' `no_init_weights`. Both sides build the same Llama architecture on
the CPU (as a rank does on a GPU node too, before the engine moves it), on one torch thread (a
rank's share of a node's cores), after one warm-up build each (imports). Reported: each side's
median seconds over the turns, and their ratio; per dtype.

Usage: python benchmarks/hf_build.py [--hidden 2048] [--layers 16] [--turns 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama(hidden: int, layers: int) -> dict:
    """A Llama of `layers` decoder layers of width `hidden` (its MLP 2.75x as wide, grouped-query
    attention of 2 heads a group, heads of 64) and a 32000-token vocabulary."""
    heads = hidden // 64
    return {"model_type": "llama", "vocab_size": 32000, "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
            "max_position_embeddings": 2048}


def timed(build, config: dict, dtype: str) -> tuple[float, int]:
    """Seconds `build` takes for `config`, and the model's parameter count."""
    t0 = time.perf_counter()
    model = build(seed=0, config=config, dtype=dtype)
    seconds = time.perf_counter() - t0
    count = sum(p.numel() for p in model.parameters())
    del model
    gc.collect()
    return seconds, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from benchmarks.stored import write_result
    import torch

    from airay.models import hf

    torch.set_num_threads(1)
    config = llama(args.hidden, args.layers)
    sides = {"initialised": hf.build, "without_weights": hf.without_weights}
    rows = {}
    for dtype in args.dtypes.split(","):
        for build in sides.values():
            timed(build, config, dtype)  # warm-up: imports, the allocator's first pages
        times: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.turns):
            for side, build in sides.items():
                seconds, count = timed(build, config, dtype)
                times[side].append(seconds)
        med = {side: statistics.median(v) for side, v in times.items()}
        rows[dtype] = {"parameters": count, "seconds": times, "median_s": med,
                       "ratio": med["without_weights"] / med["initialised"]}
        print(f"{dtype}, {count / 1e6:.1f}M parameters: initialised build {med['initialised']:.3f} s, "
              f"without_weights {med['without_weights']:.3f} s (ratio {rows[dtype]['ratio']:.4f}; medians of "
              f"{args.turns}, one torch thread)")
    if args.json:
        write_result(args.json, "hf_build.py", config=config, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of `airay export --hf` beyond the consolidated state, against rebuilding the model.

The export holds a checkpoint's consolidated fp32 state (DeepSpeed's zero_to_fp32 output). Before,
it also built the model with a random init and copied the state into it: a second full copy.
Now the model is built on the meta device and the state's tensors are assigned to it
(airay.export.build_fp32): no second copy. Both run here, each in a fresh process, on the same
Llama architecture (about 0.2B parameters); the state is random tensors of the model's shapes
(the shard reading is left out: it is the same for both), written with save_pretrained.

Usage: python benchmarks/export_memory.py [--layers 12] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def llama(layers: int, hidden: int) -> dict:
    return {"model_type": "llama", "vocab_size": 32000, "hidden_size": hidden, "intermediate_size": hidden * 11 // 4,
            "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 16,
            "max_position_embeddings": 512}


def child(side: str, layers: int, hidden: int) -> dict:
    from unittest import mock

    import torch

    from airay import export
    from airay.models import hf

    cfg = llama(layers, hidden)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in hf.build_empty(config=cfg).state_dict().items()}
    state = {k: torch.randn(s) for k, s in shapes.items()}
    held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = Path(tempfile.mkdtemp())
    if side == "rebuild":  # what export did before: a random-init model, the state copied in
        model = hf.build(config=cfg)
        model.load_state_dict(state)
        model.save_pretrained(out / "hf")
    else:
        with mock.patch.object(export, "consolidated_state", lambda step_dir, full_shapes=None: state):
            export.export_step(out / "step", out / "hf", export.HF_FACTORY, {"config": cfg})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"parameters": sum(v.numel() for v in state.values()), "state_bytes": sum(v.numel() * 4 for v in state.values()),
            "held_before_export": held, "peak": peak, "extra": peak - held}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.hidden)))
        return 0
    got = {}
    for side in ("rebuild", "airay"):
        proc = subprocess.run([sys.executable, __file__, "--child", side, "--layers", str(args.layers), "--hidden",
                               str(args.hidden)], capture_output=True, text=True, check=True, cwd=ROOT)
        got[side] = json.loads(proc.stdout.strip().splitlines()[-1])
    gib = 2**30
    print(f"export of a {got['airay']['parameters'] / 1e6:.0f}M-parameter Llama "
          f"({got['airay']['state_bytes'] / gib:.2f} GiB of fp32 state held): memory beyond the state")
    for side, label in (("rebuild", "rebuild + copy (before)"), ("airay", "meta + assign (airay)")):
        print(f"  {label:24s} +{got[side]['extra'] / gib:.2f} GiB (peak {got[side]['peak'] / gib:.2f} GiB)")
    print(f"  extra / state size: before {got['rebuild']['extra'] / got['rebuild']['state_bytes']:.2f}, "
          f"airay {got['airay']['extra'] / got['airay']['state_bytes']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

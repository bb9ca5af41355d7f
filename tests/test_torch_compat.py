"""A rank's process never imports torch._dynamo unless something compiles (airay.worker.torch_compat):
the same numbers as with torch's own wrappers, and torch's wrappers again once dynamo is imported."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A fresh interpreter, as a rank's process is: DeepSpeed imported as a worker imports it, then
# per ZeRO stage an engine (world of 1, gloo), 3 steps, a save, a load of it and one more step.
RANK = r"""
import json, socket, sys
sys.path.insert(0, {root!r})
if {dynamo_first}:
    import torch._dynamo  # torch's own wrappers: what a process that compiled anything runs
import torch
from airay.worker.deepspeed_compat import import_deepspeed
import_deepspeed()
import deepspeed.comm as dist
from airay.data.source import SyntheticSource
from airay.models import tiny_gpt
from airay.policy import plan_batch
from benchmarks.plain import plain_engine, train_step

s = socket.socket(); s.bind(("", 0)); port = s.getsockname()[1]; s.close()
out = {{}}
for i, stage in enumerate((1, 2, 3)):
    model = tiny_gpt.build(seed=0, vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4)
    cfg = {{"optimizer": {{"type": "AdamW", "params": {{"lr": 1e-2}}}}, "zero_optimization": {{"stage": stage}}}}
    plan = plan_batch(4, 2, 1)
    engine = plain_engine(model, cfg, plan, rank=0, world=1, port=port if i == 0 else None)
    data = SyntheticSource(tiny_gpt.synthetic_sample, 0, {{"vocab_size": 64, "seq_len": 8}})
    losses = [train_step(engine, tiny_gpt.loss, data, step, 0, plan) for step in range(3)]
    engine.save_checkpoint({tmp!r} + f"/z{{stage}}", tag="t")
    engine.load_checkpoint({tmp!r} + f"/z{{stage}}", tag="t")
    losses.append(train_step(engine, tiny_gpt.loss, data, 3, 0, plan))
    out[stage] = losses
print("RESULT", json.dumps({{"losses": out, "dynamo": "torch._dynamo" in sys.modules}}))
"""


def _rank(tmp_path: Path, dynamo_first: bool) -> dict:
    code = RANK.format(root=str(ROOT), dynamo_first=dynamo_first, tmp=str(tmp_path / str(dynamo_first)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_a_rank_builds_trains_saves_and_loads_without_importing_dynamo_and_with_the_same_losses(tmp_path):
    lean, torchs = _rank(tmp_path, False), _rank(tmp_path, True)
    # The optimizer's constructor, ZeRO-3's hooks, every step, the save and the load: none imports
    # torch._dynamo (each did before: 2-3 CPU-s a process here).
    assert lean["dynamo"] is False and torchs["dynamo"] is True
    assert set(lean["losses"]) == {"1", "2", "3"}
    assert lean["losses"] == torchs["losses"]  # bit for bit, every stage, after the reload too
    assert all(len(v) == 4 and v[0] != v[2] for v in lean["losses"].values())  # it trained


def test_once_dynamo_is_imported_torchs_own_wrappers_run_and_compiled_code_still_works():
    code = r"""
import sys
import torch
from airay.worker.torch_compat import defer_dynamo
assert defer_dynamo() > 0 and defer_dynamo() == 0 or "torch._dynamo" in sys.modules
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
calls = []
@torch.compiler.disable
def counted(x):
    calls.append(1)
    return x * 2
def train(x):
    loss = counted(model(x)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss
x = torch.ones(3, 4)
first = train(x).item()
print("before", "torch._dynamo" in sys.modules)
import torch._dynamo
compiled = torch.compile(train, backend="eager")
second = compiled(x).item()
inner = torch.optim.Optimizer.zero_grad.__wrapped__
print("after", type(inner.__dynamo_disable).__name__, getattr(inner.__dynamo_disable, "_torchdynamo_disable", False),
      len(calls), first != second)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert "before False" in lines
    # The first call after the import made torch's own disabled function (and cached it, as
    # torch does); the compiled step ran the disabled function eagerly and trained.
    assert "after function True 2 True" in lines, proc.stdout + proc.stderr[-2000:]

"""`airay plot RUN_DIR`: one PNG of a run — loss vs step, world size and throughput vs time,
faults and checkpoints marked, goodput in the title. Also used inline by the notebook."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from airay.runview import RunView, load


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, show: bool = False) -> dict[str, Any]:
    """Draw the run; write it to `out` (default RUN_DIR/run.png). Returns what was drawn (the
    series, the marks and the title) and the figure, so callers can check or display it."""
    view = load(run_dir)
    drawn = series(view)
    if show:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(10, 9), layout="constrained")
    else:
        # Files only, without pyplot: no backend to pick (a job's driver has no display), no
        # global state (the MLflow tracker draws it on its thread; a notebook's backend stays).
        from matplotlib.figure import Figure

        fig = Figure(figsize=(10, 9), layout="constrained")
    ax_loss, ax_world, ax_tput = fig.subplots(3, 1)
    fig.suptitle(drawn["title"])

    steps, losses = drawn["loss"]
    ax_loss.plot(steps, losses, color="tab:blue", label="loss (kept steps)")
    if drawn["replayed"][0]:
        ax_loss.scatter(*drawn["replayed"], s=12, color="tab:gray", label="replayed (discarded)", zorder=3)
    for i, s in enumerate(drawn["checkpoint_steps"]):
        ax_loss.axvline(s, color="tab:green", alpha=0.25, lw=1, label="checkpoint" if i == 0 else None)
    for i, f in enumerate(drawn["faults"]):
        ax_loss.axvline(f["step"], color="tab:red", ls="--", lw=1.5, label="fault" if i == 0 else None)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.legend(loc="upper right", fontsize=8)

    t, world = drawn["world_size"]
    ax_world.step(t, world, where="post", color="tab:purple")
    ax_world.set_ylabel("world size")
    if world:
        ax_world.set_ylim(0, max(world) + 1)
    t, tput = drawn["throughput"]
    ax_tput.plot(t, tput, ".-", color="tab:orange", ms=3)
    ax_tput.set_ylabel("samples/s")
    ax_tput.set_xlabel("seconds since start")
    for ax in (ax_world, ax_tput):
        ax.set_xlim(0, max(drawn["wall_s"], 1e-3))
    for ax in (ax_world, ax_tput):
        for i, f in enumerate(drawn["faults"]):
            ax.axvline(f["t"], color="tab:red", ls="--", lw=1.5, label="fault" if i == 0 else None)
        for i, c in enumerate(drawn["checkpoint_times"]):
            ax.axvline(c, color="tab:green", alpha=0.25, lw=1, label="checkpoint" if i == 0 else None)
    ax_world.legend(loc="lower right", fontsize=8)

    out = Path(out) if out is not None else view.run_dir / "run.png"
    fig.savefig(out, dpi=100)
    drawn.update(path=str(out), figure=fig)
    return drawn


def series(view: RunView) -> dict[str, Any]:
    """The data the plot shows, apart from matplotlib (so it can be checked)."""
    kept_steps = sorted(view.kept)
    kept_ids = {id(r) for r in view.kept.values()}
    replayed = [r for r in view.metrics if id(r) not in kept_ids]
    g = view.goodput
    t = [end - view.t0 for end in step_end_times(view.metrics)]
    worst = max(g.lost_s, key=g.lost_s.get) if g.wall_s else None
    title = (f"{view.name}: goodput {g.goodput:.2f} ({view.status}, {len(kept_steps)} steps, "
             f"{view.restarts} restarts, wall {g.wall_s:.0f}s"
             + (f"; most lost to {worst.replace('_', ' ')} {g.lost_s[worst]:.1f}s" if worst else "") + ")")
    return {
        "title": title,
        "loss": (kept_steps, [view.kept[s]["loss"] for s in kept_steps]),
        "replayed": ([r["step"] for r in replayed], [r["loss"] for r in replayed]),
        "world_size": (t, [r["world_size"] for r in view.metrics]),
        "throughput": (t, [r["samples_per_s"] for r in view.metrics]),
        "wall_s": g.wall_s,
        "faults": [{"t": f["ts"] - view.t0, "step": f.get("step"), "type": f["type"], "rank": f.get("rank")}
                   for f in view.faults if f.get("rank") is not None],
        "checkpoint_steps": [c["step"] for c in view.checkpoints],
        "checkpoint_times": [c["ts"] - view.t0 for c in view.checkpoints],
    }


def step_end_times(metrics: list[dict[str, Any]]) -> list[float]:
    """When each step ended. A round's records share the time it was recorded (its end), so
    earlier steps of the round ended that much earlier: by the step times that followed them."""
    out = [0.0] * len(metrics)
    later = 0.0
    for i in range(len(metrics) - 1, -1, -1):
        if i + 1 < len(metrics) and metrics[i + 1]["ts"] == metrics[i]["ts"]:
            later += metrics[i + 1]["step_time_s"]
        else:
            later = 0.0
        out[i] = metrics[i]["ts"] - later
    return out

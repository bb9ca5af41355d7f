"""The driver's side of chaos: which fault of the spec's `chaos:` list strikes at which named point.

The controller calls the hook at its named points and hands the answer on; it holds no chaos
logic of its own:

- `round(step, end, group, ckpt)` at a round's start: the ranks' step faults, node removal
  (after the round is launched, so the world is mid-step) and addition, checkpoint damage,
  break_storage, kill_driver.
- `feed(feed, start, end, group, plans)`: data faults spoil the rows of a round's feed.
- `call(point, step, world)` before a world formation ("form"), a save ("save") and a load
  ("load"): the ranks' faults inside that call (kill_worker / hang_worker with `during`).

Every fault strikes once. A fault already injected by an earlier driver of the same run
directory (one that was killed and restarted, or a run resumed after preemption) is not
injected again: the hook starts from the run's `fault_injected` events.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any, Callable

from airay import chaos
from airay.config import DATA_FAULTS, ChaosSpec


class ChaosHook:
    def __init__(self, specs: list[ChaosSpec], recorder, local=None, durable_dir: str | None = None,
                 earlier_events: list[dict] = ()):
        self.specs = list(specs)
        self.rec = recorder
        self.local = local  # a LocalCluster, for remove_node / add_node
        self.durable_dir = durable_dir  # break_storage's target (a local checkpoint directory)
        self.fired: set[int] = {e["chaos_index"] for e in earlier_events
                                if e.get("type") == "fault_injected" and "chaos_index" in e}
        self.cleanups: list[Callable[[], None]] = []

    # ---- what the step loop needs to know --------------------------------------------------

    def round_starts(self) -> list[int]:
        """Steps a round must start at: those of faults still to strike at a round's start."""
        return [c.at_step for i, c in enumerate(self.specs)
                if i not in self.fired and c.fault not in DATA_FAULTS and c.during == "step"]

    def quiet(self, start: int, end: int) -> bool:
        """No fault acts on the steps [start, end) (airay.chaos.quiet)."""
        return chaos.quiet(self.specs, self.fired, start, end)

    # ---- named points ----------------------------------------------------------------------

    def round(self, step: int, end: int, group, ckpt) -> tuple[dict[int, dict[int, dict]], Any, bool]:
        """Chaos for the round [step, end): the ranks' step faults, an after-launch hook (node
        removal, so the world is mid-step when it strikes) and whether a fault strikes now."""
        world = len(group.active)
        faults = chaos.round_faults(self.specs, self.fired, step, end, world)
        removals, struck = [], False
        for i, fault in enumerate(self.specs):
            if fault.at_step != step or i in self.fired or fault.fault in DATA_FAULTS or fault.during != "step":
                continue
            self.fired.add(i)
            if fault.rank >= world and fault.fault not in ("add_node", "kill_driver", "break_storage"):
                self._skipped(i, step, f"world size is {world}")
                continue
            detail = {}
            if fault.fault in chaos.CHECKPOINT_FAULTS:
                # Damage the checkpoint the run would load (once committed, so the outcome is
                # known), then make the run need one: kill the rank.
                ckpt.wait(uploads=True)
                detail = chaos.damage_checkpoint(fault.fault, ckpt.candidates(group), group, fault.rank,
                                                 ckpt.durable.storage)
                # A bad copy must be read by its own node's rank: then another rank is the one lost.
                victim = (fault.rank + 1) % world if fault.fault == "corrupt_memory_copy" else fault.rank
                faults.setdefault(victim, {})[step] = {"fault": "kill_worker"}
                detail["killed_rank"] = victim
            elif fault.fault == "break_storage":
                ckpt.wait(uploads=True)  # what was saved before at_step is written: the fault starts here
                detail = self._break_storage()
            self._injected(i, step, **detail)
            struck = struck or fault.fault not in ("add_node", "slow_worker", "break_storage")
            if fault.fault == "remove_node":
                removals.append(group.member(fault.rank).node_id)
            elif fault.fault == "add_node":
                node = self.local.add_node()
                self.rec.event("node_added", step=step, node_id=node)
            elif fault.fault == "kill_driver":
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no last word (events are written per line)

        def remove_nodes():
            for node_id in removals:
                self.local.remove_node(node_id)

        return faults, (remove_nodes if removals else None), struck

    def feed(self, feed: dict[int, list] | None, start: int, end: int, group, plans) -> bool:
        """Data chaos for the round [start, end): the rows a rank trains on at a fault's step come
        from a block that cannot be fetched. Whether one struck."""
        world, struck = len(group.active), False
        for i, fault in enumerate(self.specs):
            if fault.fault not in DATA_FAULTS or i in self.fired or not start <= fault.at_step < end:
                continue
            self.fired.add(i)
            if fault.rank >= world:
                self._skipped(i, fault.at_step, f"world size is {world}")
                continue
            ref, cleanup = chaos.bad_block(fault.fault)
            self.cleanups.append(cleanup)
            replica = fault.rank * plans[world].world_size // world  # its replica's rows (model parallelism)
            feed[fault.at_step] = chaos.spoil_rows(feed[fault.at_step], *plans[world].rank_rows(replica), ref)
            self._injected(i, fault.at_step, round_start=start, block=ref.hex())
            struck = True
        return struck

    def call(self, point: str, step: int, world: int) -> dict[int, dict]:
        """{rank: fault} to strike inside the next `point` call ("form", "save" or "load") of a
        run at `step`: kill_worker / hang_worker faults with `during: point` whose step is reached."""
        out = {}
        for i, fault in enumerate(self.specs):
            if fault.during != point or i in self.fired or fault.at_step > step:
                continue
            self.fired.add(i)
            if fault.rank >= world:
                self._skipped(i, step, f"world size is {world}")
                continue
            out[fault.rank] = {"fault": fault.fault, "hang_mode": fault.hang_mode, "delay_s": fault.delay_s}
            self._injected(i, step, during=point)
        return out

    def close(self) -> None:
        """Undo what faults left behind (a spoiled block's task, a broken storage directory)."""
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception as exc:
                self.rec.event("chaos_cleanup_failed", error=f"{type(exc).__name__}: {exc}")
        self.cleanups = []

    # ---- helpers ---------------------------------------------------------------------------

    def _injected(self, index: int, step: int, **detail) -> None:
        fault = self.specs[index]
        extra = {"hang_mode": fault.hang_mode} if fault.fault == "hang_worker" else {}
        self.rec.event("fault_injected", step=step, fault=fault.fault, rank=fault.rank, chaos_index=index,
                       **extra, **detail)

    def _skipped(self, index: int, step: int, reason: str) -> None:
        fault = self.specs[index]
        self.rec.event("fault_skipped", step=step, fault=fault.fault, rank=fault.rank, chaos_index=index,
                       reason=reason)

    def _break_storage(self) -> dict[str, Any]:
        """Every write under the durable directory fails from now on, for real: the directory is
        moved aside and a file takes its name (even root cannot create a file under a file).
        Restored when the run ends, with whatever it held."""
        path = Path(self.durable_dir)
        aside = path.with_name(path.name + ".chaos-aside")
        path.rename(aside)
        path.write_text("chaos break_storage: this directory is moved aside until the run ends\n")

        def restore():
            if path.is_file():
                path.unlink()
            elif path.is_dir():  # something recreated it meanwhile: keep what the run had before
                shutil.rmtree(path)
            aside.rename(path)

        self.cleanups.append(restore)
        return {"path": str(path)}

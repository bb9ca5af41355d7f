"""Ray's own messages on the driver's console, kept in the run's record instead.

Ray pushes its system messages to every driver's console, whole: "A worker died or was killed
while executing a task by an unexpected system error ... Worker ID: <56 hex> Node ID: <56 hex>
...", "The node with node id: <56 hex> ... has been marked dead because the detector has missed
too many heartbeats ...", several lines each. airay reports the same faults in its own line (the
rank, a short node name, what failed), so during a run these messages go to events.jsonl as
`ray_message` events, which `airay run -v` prints. Workers' own output (user prints, warnings,
errors, each with its rank) still comes through Ray as before.
"""

from __future__ import annotations

from typing import Any, Callable

RAY_SYSTEM_SOURCES = ("raylet",)  # the `pid` Ray gives the messages it pushes, in its stdstream records


def route_ray_messages(record: Callable[[str, str], Any]) -> Callable[[], None]:
    """Ray's system messages go to `record(source, line)`, not to the console, until the
    returned function is called. Call before ray.init (Ray binds its log printer when it
    connects; its error listener looks it up at each message)."""
    import ray._private.worker as ray_worker

    printer = ray_worker.print_to_stdstream

    def routed(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") in RAY_SYSTEM_SOURCES:
            for line in data.get("lines", []):
                record(str(data["pid"]), line)
            return
        printer(data, ignore_prefix)

    ray_worker.print_to_stdstream = routed

    def restore() -> None:
        ray_worker.print_to_stdstream = printer

    return restore

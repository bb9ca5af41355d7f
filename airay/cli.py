"""`airay` command line: `airay run JOB.yaml [--run-dir DIR] [--set key.path=value ...]`."""

from __future__ import annotations

import argparse
import json
import sys

from airay.config import ConfigError, JobConfig


def _summary(result) -> str:
    lines = [f"airay: {result.status} at step {result.final_step}, loss {result.final_loss}, "
             f"restarts {result.restarts}, world sizes {result.world_sizes}, goodput {result.goodput:.2f}, "
             f"wall {result.wall_s:.1f}s", f"airay: run directory {result.run_dir}"]
    for r in result.resizes:
        lines.append(f"airay: resize {r['old_world_size']} -> {r['new_world_size']} ({r['reason']}) at step "
                     f"{r['resumed_step']}: recovery {r['recovery_s']:.2f}s")
    if result.error:
        lines.append(f"airay: error: {result.error}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="airay", description="Elastic DeepSpeed training on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job spec to the end")
    run.add_argument("spec", help="job spec YAML")
    run.add_argument("--run-dir", help="run directory (default runs/NAME-TIMESTAMP)")
    run.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                     help="override a spec field, value parsed as YAML (repeatable)")
    run.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)

    if args.command == "run":
        overrides = list(args.set) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
        try:
            config = JobConfig.from_yaml(args.spec, overrides)
        except ConfigError as exc:
            print(f"airay: {exc}", file=sys.stderr)
            return 2
        from airay.api import fit

        result = fit(config)
        print(json.dumps(result.__dict__, indent=2, default=str) if args.json else _summary(result))
        return 0 if result.status == "finished" else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())

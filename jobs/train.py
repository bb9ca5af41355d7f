"""Train a job spec on the Ray cluster this process is given: what `ray job submit` runs.

    ray job submit --working-dir . -- python jobs/train.py --config jobs/small.yaml

Inside a Ray job, RAY_ADDRESS names the cluster, so the run uses it as it is (no local cluster:
the spec must not have a `cluster:` section). Prints the same progress lines and summary as
`airay run`, which is what this calls.
"""

import argparse
import sys
from pathlib import Path

# Run from a checkout without installing: the project root (the job's working_dir) first.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airay.cli import main  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="job spec YAML")
    parser.add_argument("--run-dir", help="run directory (default runs/NAME-TIMESTAMP)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE")
    args = parser.parse_args()
    argv = ["run", args.config] + [f"--set={s}" for s in args.set]
    sys.exit(main(argv + (["--run-dir", args.run_dir] if args.run_dir else [])))

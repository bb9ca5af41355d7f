"""`airay` command line.

    airay run JOB.yaml [--run-dir DIR] [--set key.path=value ...] [-v] [--json]
    airay submit JOB.yaml [--address URL] ...         a job on a running cluster (airay.submit)
    airay status      RUN_DIR | --job ID  [--json]    progress, world, last fault, ETA, goodput
    airay logs        RUN_DIR | --job ID  [--follow] [-v] [--json]
    airay plot        RUN_DIR | --job ID  [--out PNG] [--json]
    airay checkpoints RUN_DIR | LOCATION | --job ID  [--crc] [--json]      lists, never changes
    airay prune       RUN_DIR | LOCATION | --job ID  --keep-last N [--keep STEP ...] [--dry-run] [--json]
    airay export      RUN_DIR | CHECKPOINT | --job ID  --out DIR [--format hf] [--dtype ...] [--json]
    airay simulate [--gpus 1024,4096,16384 ...] [--json]   goodput per recovery policy (airay.simulate)
    airay simulate-queue [--trace FILE.csv | --jobs 1200] [--gpus 1024,4096] [--json]
                                                  the multi-job scheduler's policies (airay.sched.simulate)
    airay --version

Every command that reads a run takes its run directory or a submitted job's id (`--job`, with
`--address`: the job's run directory, recorded at submission, read on this machine).
"""

from __future__ import annotations

import argparse
import json
import sys

from airay.config import ConfigError, JobConfig, spec_mapping, supervision
from airay.sched.policy import POLICIES


SUMMARY_RESIZES = 10  # resize lines in the summary; `airay status RUN_DIR` lists them all


def _summary(result) -> str:
    from airay.observe.console import PREFIX, bounded, duration
    from airay.runview import lost_text, resize_text

    worlds = " -> ".join(str(w) for w in result.world_sizes[:12]) + (" ..." if len(result.world_sizes) > 12 else "")
    loss = f"{result.final_loss:.4f}" if result.final_loss is not None else "-"
    lines = [f"{result.status} at step {result.final_step}: loss {loss}, goodput {result.goodput:.2f}, "
             f"wall {duration(result.wall_s)}, {result.restarts} restarts, worlds {worlds}"]
    if result.time_lost_s:
        lines.append(f"time lost: {lost_text(result.time_lost_s)}")
    lines += [resize_text(r) for r in result.resizes[:SUMMARY_RESIZES]]
    if len(result.resizes) > SUMMARY_RESIZES:
        lines.append(f"(+{len(result.resizes) - SUMMARY_RESIZES} more resizes: airay status {result.run_dir})")
    if result.error:
        lines.append(f"error: {result.error}")
    lines.append(f"run directory {result.run_dir}")
    return "\n".join(bounded(f"{PREFIX} {line}") for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="airay", description="Elastic DeepSpeed training on Ray")
    parser.add_argument("--version", action="version", version=f"airay {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job spec to the end")
    run.add_argument("spec", help="job spec YAML")
    run.add_argument("--run-dir", help="run directory (default runs/NAME-TIMESTAMP)")
    run.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                     help="override a spec field, value parsed as YAML (repeatable)")
    run.add_argument("--json", action="store_true", help="print the result as JSON")
    run.add_argument("-v", "--verbose", action="store_true",
                     help="print every event as it is recorded (default: progress, faults, recoveries, the summary)")
    run.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the supervised driver itself
    _queue_flags(run)
    addr_help = "Ray dashboard address, e.g. http://127.0.0.1:8265 (default: RAY_ADDRESS, else the local cluster)"
    submit = sub.add_parser("submit", help="submit a job spec to a running Ray cluster (Ray's Job API)")
    submit.add_argument("spec", help="job spec YAML, inside the working directory")
    submit.add_argument("--address", help=addr_help)
    submit.add_argument("--working-dir", default=".", help="project directory uploaded as the job's working_dir")
    submit.add_argument("--run-dir", help="run directory on the cluster (default runs/NAME-TIMESTAMP there)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override a spec field, value parsed as YAML (repeatable)")
    _queue_flags(submit)
    status = sub.add_parser("status", help="a run's progress, world, last fault, ETA, goodput")
    _reads_a_run(status, addr_help)
    logs = sub.add_parser("logs", help="a run's events as the console shows them (--job: the job's output)")
    _reads_a_run(logs, addr_help)
    logs.add_argument("--follow", action="store_true", help="with --job: stream until the job ends")
    logs.add_argument("-v", "--verbose", action="store_true", help="every event, not just the story")
    plot = sub.add_parser("plot", help="PNG of a run: loss, world size, throughput, faults, goodput")
    _reads_a_run(plot, addr_help)
    plot.add_argument("--out", help="PNG path (default RUN_DIR/run.png)")
    cks = sub.add_parser("checkpoints", help="list a run's checkpoints: step, world size, tier, size, verified")
    _reads_a_run(cks, addr_help, "a run directory, or a checkpoint path or URI (s3://bucket/prefix, ...)")
    cks.add_argument("--crc", action="store_true", help="also read every file and check its CRC-32")
    prune = sub.add_parser("prune", help="delete a run's durable checkpoints but the newest N and the kept ones")
    _reads_a_run(prune, addr_help, "a run directory, or a checkpoint path or URI (s3://bucket/prefix, ...)")
    prune.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N complete steps (at least 1)")
    prune.add_argument("--keep", type=int, action="append", default=[], metavar="STEP",
                       help="mark STEP's checkpoint to keep: never pruned, by this or by a run (repeatable)")
    prune.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    exp = sub.add_parser("export", help="a checkpoint as a Hugging Face model folder (from_pretrained loads it)")
    _reads_a_run(exp, addr_help, "a run directory (its newest durable step) or RUN_DIR/checkpoints/step_NNNNNNNN")
    exp.add_argument("--out", required=True, metavar="DIR", help="the model folder to write")
    exp.add_argument("--format", choices=("hf",), default="hf", help="hf: a Hugging Face model folder")
    exp.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    exp.add_argument("--config", help="the run's config.yaml (default: found above the checkpoint)")
    sim = sub.add_parser("simulate", help="simulate weeks of training on a large fleet: goodput per policy")
    sim.add_argument("--gpus", default="1024,4096,16384", help="comma-separated fleet sizes")
    sim.add_argument("--gpus-per-node", type=int, default=8)
    sim.add_argument("--mtbf-hours", type=float, default=50_000.0, help="per-GPU mean time between failures")
    sim.add_argument("--replacement-s", type=float, default=1800.0, help="until a failed node is back")
    sim.add_argument("--checkpoint-s", type=float, default=30.0, help="training time blocked per checkpoint")
    sim.add_argument("--warm-recovery-s", type=float, default=None,
                     help="default: airay's measured value (airay/measured.json)")
    sim.add_argument("--cold-restart-s", type=float, default=None,
                     help="default: airay's measured value (airay/measured.json)")
    sim.add_argument("--interval-s", type=float, default=None, help="checkpoint interval; default Daly's optimum")
    sim.add_argument("--days", type=float, default=14.0)
    sim.add_argument("--repeats", type=int, default=3)
    sim.add_argument("--json", action="store_true", help="print the rows as JSON")
    sq = sub.add_parser("simulate-queue", help="simulate the multi-job scheduler's policies over a job trace")
    sq.add_argument("--trace", help="trace CSV (format: airay.sched.trace); default: a generated trace per fleet size")
    sq.add_argument("--jobs", type=int, default=1200, help="jobs in the generated trace")
    sq.add_argument("--load", type=float, default=0.9, help="generated trace: work offered / the fleet's GPUs")
    sq.add_argument("--seed", type=int, default=0)
    sq.add_argument("--gpus", default="1024,4096", help="comma-separated fleet sizes")
    sq.add_argument("--policies", default="evict,shrink,goodput")
    sq.add_argument("--quota", action="append", default=[], metavar="TEAM=GPUS",
                    help="a team's guaranteed GPUs (repeatable); default: the generated teams' quotas, "
                    "none with --trace")
    sq.add_argument("--resize-s", type=float, default=None, help="default: airay's measured warm recovery")
    sq.add_argument("--json", action="store_true", help="print the rows as JSON")
    queue = sub.add_parser("queue", help="the cluster's job queue: priority, team, size and target, state, and why")
    queue.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS when it is not a dashboard URL, "
                       "else `auto`: the cluster this machine is a node of; ray://HEAD:10001 from elsewhere)")
    queue.add_argument("--quota", action="append", default=[], metavar="TEAM=WORKERS",
                       help="set a team's guaranteed workers (0 removes it; repeatable)")
    queue.add_argument("--policy", choices=POLICIES, help="set the scheduler's policy (default shrink)")
    queue.add_argument("--all", action="store_true", help="also the jobs that ended")
    queue.add_argument("--json", action="store_true", help="print the queue as JSON")
    args = parser.parse_args(argv)
    if args.command in ("run", "submit"):  # --priority/--team are the queue's fields of the spec
        args.set += [f"queue.{k}={v}" for k, v in (("priority", args.priority), ("team", args.team)) if v is not None]

    if args.command == "queue":
        return _queue(args)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "simulate-queue":
        return _simulate_queue(args)
    if args.command == "submit":
        return _submit(args)
    if args.command in READERS:
        try:
            return READERS[args.command](args)
        except (ConfigError, FileNotFoundError, ValueError, OSError) as exc:
            print(f"airay: {exc}", file=sys.stderr)
            return 2
        except (ConnectionError, RuntimeError) as exc:  # Ray's Job API: an unreachable dashboard, an unknown job
            print(f"airay: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1

    if args.command == "run":
        from airay import supervisor
        from airay.events import process_start_ts

        overrides = list(args.set) + ([f"run_dir={args.run_dir}"] if args.run_dir else [])
        try:
            if not args.driver:
                # This process supervises (the driver runs in a child it restarts if it dies):
                # it reads what it needs and leaves the full checks to the driver, at once.
                data = spec_mapping(args.spec, overrides)
                run_dir, max_restarts = supervision(data, args.spec)
                if max_restarts > 0:
                    driver_argv = ["run", args.spec, *[a for s in args.set for a in ("--set", s)], "--run-dir",
                                   str(run_dir), "--driver", *(["--json"] if args.json else []),
                                   *(["--verbose"] if args.verbose else [])]
                    return supervisor.supervise(driver_argv, str(run_dir), max_restarts, process_start_ts(),
                                                supervisor.cluster_address(data))
            config = JobConfig.from_yaml(args.spec, overrides)
        except ConfigError as exc:
            print(f"airay: {exc}", file=sys.stderr)
            return 2
        import os

        from airay.api import fit

        attempt = int(os.environ.get(supervisor.ATTEMPT_ENV, "0")) if args.driver else None
        launched = os.environ.get(supervisor.LAUNCHED_ENV)
        try:
            # Start-up counts from when the user pressed enter: the supervisor's start, or ours.
            result = fit(config, launched_ts=float(launched) if launched else process_start_ts(),
                         driver_attempt=attempt, previous_exit=os.environ.get(supervisor.PREVIOUS_EXIT_ENV),
                         verbose=args.verbose)
        except ConfigError as exc:  # found once Ray is up (a dataset, a checkpoint path of another job)
            print(f"airay: {exc}", file=sys.stderr)
            return 2
        except Exception:
            if not args.driver:
                raise
            import traceback

            traceback.print_exc()  # e.g. the cluster could not be reached: the supervisor tries again
            return supervisor.DRIVER_FAILED_EXIT
        print(json.dumps(result.__dict__, indent=2, default=str) if args.json else _summary(result))
        if result.status == "driver_failed":
            print("airay: the driver failed (traceback above, and in events.jsonl); it is restarted", file=sys.stderr)
            return supervisor.DRIVER_FAILED_EXIT
        if result.status == "preempted":
            print("[airay] preempted; run the same command again to resume from the checkpoint above")
        # A preempted run exits cleanly (0): it stopped as asked and left a checkpoint to resume.
        return 0 if result.status in ("finished", "preempted") else 1
    return 2


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("airay")
    except PackageNotFoundError:  # a checkout run without installing
        return "unknown (not installed)"


def _queue_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--priority", type=int, help="run under the cluster's scheduler at this priority (queue.priority)")
    p.add_argument("--team", help="run under the cluster's scheduler, on this team's quota (queue.team)")


def _reads_a_run(p: argparse.ArgumentParser, addr_help: str, what: str = "the run directory") -> None:
    """The one way every reading command names its run: RUN_DIR, or --job ID (and --address)."""
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help=what)
    p.add_argument("--job", metavar="ID", help="a submitted job's id (from `airay submit`): its run directory")
    p.add_argument("--address", help=addr_help)
    p.add_argument("--json", action="store_true", help="print JSON")


def _run_dir(args) -> str:
    if (args.run_dir is None) == (args.job is None):
        raise ConfigError(f"`airay {args.command}` reads one run: give RUN_DIR or --job ID, not "
                          f"{'both' if args.run_dir else 'neither'}")
    if args.run_dir is not None:
        return args.run_dir
    from airay import submit

    return submit.job_run_dir(args.address, args.job)


def _print_json(value) -> int:
    print(json.dumps(value, indent=2, default=str))
    return 0


def _submit(args) -> int:
    from airay import submit

    try:
        job_id = submit.submit(args.address, args.spec, args.set, args.run_dir, args.working_dir)
    except ConfigError as exc:
        print(f"airay: {exc}", file=sys.stderr)
        return 2
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"airay: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(job_id)
    print(f"airay: follow it with `airay logs --job {job_id} --follow` or `airay status --job {job_id}`",
          file=sys.stderr)
    return 0


def _status(args) -> int:
    from airay import submit
    from airay.runview import load, status_dict, status_text

    job = None
    if args.job is not None and args.run_dir is None:
        state, text = submit.job_status_text(args.address, args.job)
        job = {"job_id": args.job, "status": state, "text": text}
        try:
            run_dir = submit.job_run_dir(args.address, args.job)
        except ConfigError as exc:  # not started yet, or on another machine: the job's own view
            if args.json:
                return _print_json({**job, "run": None, "why": str(exc)})
            print(text)
            return 0 if state != "FAILED" else 1
    else:
        run_dir = _run_dir(args)
    view = load(run_dir)
    if args.json:
        return _print_json({**(job or {}), "run": status_dict(view)} if job else status_dict(view))
    print("\n".join(([job["text"].splitlines()[0]] if job else []) + [status_text(view)]))
    return 0 if job is None or job["status"] != "FAILED" else 1


def _logs(args) -> int:
    if args.job is not None and args.run_dir is None and not args.json:
        from airay import submit

        if args.follow:
            return 0 if submit.follow_logs(args.address, args.job, sys.stdout) == "SUCCEEDED" else 1
        print(submit.client(args.address).get_job_logs(args.job), end="")
        return 0
    from pathlib import Path

    from airay.events import read_jsonl
    from airay.observe.console import Console

    events_file = Path(_run_dir(args)) / "events.jsonl"
    if not events_file.is_file():
        raise FileNotFoundError(f"{events_file.parent} is not a run directory (no events.jsonl)")
    events = read_jsonl(events_file)
    if args.json:
        for e in events:
            print(json.dumps(e))
        return 0
    console = Console(sys.stdout, verbose=args.verbose, interactive=False)
    for e in events:
        console.event(e)
    return 0


def _plot(args) -> int:
    from airay.plot import plot_run

    drawn = plot_run(_run_dir(args), args.out)
    if args.json:
        return _print_json({"path": str(drawn["path"]), "title": drawn["title"]})
    print(f"airay: wrote {drawn['path']} ({drawn['title']})")
    return 0


def _export(args) -> int:
    import torch

    from airay.worker.logs import quiet_deepspeed

    quiet_deepspeed(drives_gpu=torch.cuda.is_available())  # DeepSpeed logs to stdout: keep it for the result
    from airay.export import export_hf

    out = export_hf(_run_dir(args), args.out, args.dtype, args.config)
    if args.json:
        return _print_json({"path": str(out), "format": args.format, "dtype": args.dtype})
    print(f"airay: wrote {out} (AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it)")
    return 0


def checkpoint_tiers(location: str) -> list[tuple[str, str]]:
    """[(tier, location)] to list for `airay checkpoints LOCATION`: a run directory's durable
    checkpoint path (from its config.yaml) and its memory tier as this machine holds it; anything
    else is taken as a checkpoint path."""
    from pathlib import Path

    import yaml

    from airay.checkpoint.tiers import memory_base

    config = Path(location) / "config.yaml"
    if "://" in location or not config.is_file():
        return [("durable", location)]
    ck = (yaml.safe_load(config.read_text()) or {}).get("checkpoint") or {}
    durable = ck.get("path") or str(Path(location) / "checkpoints")
    memory = memory_base(ck.get("memory_path"), durable)
    return [("memory", str(memory)), ("durable", durable)] if memory.is_dir() else [("durable", durable)]


def _checkpoints(args) -> int:
    from airay.checkpoint.tiers import describe, describe_memory

    rows = []
    location = _run_dir(args)
    try:
        for tier, where in checkpoint_tiers(location):
            rows += describe_memory(where) if tier == "memory" else describe(where, args.crc)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read checkpoints at {location}: {exc}") from exc
    if args.json:
        return _print_json(rows)
    if not rows:
        print(f"airay: no checkpoints at {location}")
        return 0
    print(f"{'step':>8} {'world':>5} {'tier':>7} {'size':>10} {'status':>10}  path")
    for r in rows:
        size = f"{r['bytes'] / 2**20:.1f} MiB"
        world = r["world_size"] if r["world_size"] is not None else "-"
        status = r["status"] + (" keep" if r["keep"] else "")
        print(f"{r['step']:>8} {world:>5} {r['tier']:>7} {size:>10} {status:>10}  {r['path']}")
    return 0


def _prune(args) -> int:
    """The durable tier's prune, as a run does it (DurableTier.prune): never a kept step, never
    the newest complete one, never one newer than it (it may still be uploading)."""
    from airay.checkpoint.layout import KEEP_MARKER, step_name
    from airay.checkpoint.tiers import DurableTier, describe

    if args.keep_last is None and not args.keep:
        raise ConfigError("`airay prune` needs --keep-last N (delete all but the newest N complete steps) and/or "
                          "--keep STEP (mark a step never to be deleted)")
    if args.keep_last is not None and args.keep_last < 1:
        raise ConfigError(f"--keep-last {args.keep_last}: at least 1 (the newest complete step is never deleted)")
    durable = dict(checkpoint_tiers(_run_dir(args)))["durable"]
    verified = {r["step"] for r in describe(durable) if r["status"] == "verified"}
    missing = sorted(set(args.keep) - verified)
    if missing:
        raise ConfigError(f"--keep {missing}: no complete checkpoint of that step in {durable}")
    tier = DurableTier.reading(durable)
    if not args.dry_run:
        for step in args.keep:
            tier.storage.write_bytes(f"{step_name(step)}/{KEEP_MARKER}", b"")
    doomed = tier.prune(args.keep_last, protect=set(args.keep), dry_run=args.dry_run) \
        if args.keep_last is not None else []
    if args.json:
        return _print_json({"location": tier.storage.uri(), "kept_marked": args.keep, "deleted": doomed,
                            "dry_run": args.dry_run})
    verb = "would delete" if args.dry_run else "deleted"
    print(f"airay: {verb} {len(doomed)} step(s) in {tier.storage.uri()}: {doomed}"
          + (f"; marked to keep: {args.keep}" if args.keep and not args.dry_run else ""))
    return 0


READERS = {"status": _status, "logs": _logs, "plot": _plot, "checkpoints": _checkpoints, "prune": _prune,
           "export": _export}


def _queue(args) -> int:
    import os

    import ray

    from airay.sched.actor import scheduler
    from airay.sched.queue import LIVE

    try:
        quotas = _quotas(args.quota)
    except ValueError as exc:
        print(f"airay: --quota: {exc}", file=sys.stderr)
        return 2
    address = args.address or os.environ.get("RAY_ADDRESS", "")
    address = address if address and "://" not in address or address.startswith("ray://") else "auto"
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except ConnectionError as exc:
        print(f"airay: no Ray cluster at {address}: {exc}; give --address (HOST:6379, or ray://HEAD:10001)",
              file=sys.stderr)
        return 2
    try:
        actor = scheduler(create=bool(quotas or args.policy))
        if actor is None:
            snap = {"jobs": [], "quotas": {}, "policy": None, "capacity": None}
        elif quotas or args.policy:
            snap = ray.get(actor.configure.remote(quotas, args.policy), timeout=60)
        else:
            snap = ray.get(actor.snapshot.remote(), timeout=60)
    finally:
        ray.shutdown()
    jobs = [j for j in snap["jobs"] if args.all or j["state"] in LIVE]
    if args.json:
        return _print_json({**snap, "jobs": jobs})
    print(queue_table(snap, jobs))
    return 0


def _quotas(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        team, sep, n = item.partition("=")
        if not sep or not team or not n.strip().isdigit():
            raise ValueError(f"give TEAM=WORKERS, e.g. research=16, not {item!r}")
        out[team] = int(n)
    return out


def queue_table(snap: dict, jobs: list[dict]) -> str:
    """The queue as `airay queue` prints it: one line per job, highest priority first."""
    if snap.get("policy") is None:
        return "no scheduler on this cluster: no job has been queued (a job spec's `queue:` section starts it)"
    quotas = ", ".join(f"{t}={n}" for t, n in sorted(snap["quotas"].items())) or "none"
    lines = [f"scheduler: policy {snap['policy']}, {snap['capacity']} workers, quotas {quotas}"]
    if not jobs:
        return "\n".join(lines + ["no jobs"])
    lines.append(f"{'JOB':<28} {'TEAM':<12} {'PRIO':>4} {'STATE':<8} {'SIZE':>5} {'TARGET':>6} {'RANGE':>6} "
                 f"{'STEP':>8}  REASON")
    for j in sorted(jobs, key=lambda j: (-j["priority"], j["submit_ts"])):
        step = f"{j['step']}/{j['max_steps']}" if j["max_steps"] else str(j["step"])
        sizes = f"{j['min_workers']}-{j['max_workers']}"
        lines.append(f"{j['id'][:28]:<28} {j['team'][:12]:<12} {j['priority']:>4} {j['state']:<8} {j['current']:>5} "
                     f"{j['target']:>6} {sizes:>6} {step:>8}  {j['reason'][:100]}")
    return "\n".join(lines)


def _simulate(args) -> int:
    from airay import simulate as sim

    try:
        gpus = [int(g) for g in args.gpus.split(",") if g]
    except ValueError:
        print(f"airay: --gpus '{args.gpus}' must be comma-separated integers, e.g. 1024,4096", file=sys.stderr)
        return 2
    costs = sim.Costs(checkpoint_s=args.checkpoint_s,
                      warm_recovery_s=args.warm_recovery_s if args.warm_recovery_s is not None
                      else sim.MEASURED_WARM_RECOVERY_S,
                      cold_restart_s=args.cold_restart_s if args.cold_restart_s is not None
                      else sim.MEASURED_COLD_RESTART_S)
    fleet = sim.Fleet(gpus=gpus[0], gpus_per_node=args.gpus_per_node, mtbf_gpu_hours=args.mtbf_hours,
                      replacement_s=args.replacement_s)
    try:
        rows = sim.compare(gpus, fleet, costs, args.interval_s, args.days, args.repeats)
    except ValueError as exc:
        print(f"airay: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{args.days:g} days, per-GPU MTBF {args.mtbf_hours:g} h, node back after {args.replacement_s:g} s, "
          f"checkpoint {costs.checkpoint_s:g} s, warm recovery {costs.warm_recovery_s:g} s, "
          f"cold restart {costs.cold_restart_s:g} s; median of {args.repeats}")
    print(f"{'gpus':>6} {'fleet MTBF h':>12} {'interval s':>10} {'policy':>8} {'goodput':>8} {'min':>6} {'max':>6} "
          f"{'failures':>8} {'lost':>6} {'recov':>6} {'ckpt':>6}")
    for r in rows:
        print(f"{r['gpus']:>6} {r['fleet_mtbf_h']:>12.2f} {r['interval_s']:>10.0f} {r['policy']:>8} "
              f"{r['goodput']:>8.4f} {r['goodput_min']:>6.3f} {r['goodput_max']:>6.3f} {r['failures']:>8} "
              f"{r['lost_work_share']:>6.3f} {r['recovery_share']:>6.3f} {r['checkpoint_share']:>6.3f}")
    return 0


def _simulate_queue(args) -> int:
    from airay.sched import simulate as sq
    from airay.sched.trace import TraceError, load_csv

    try:
        gpus = [int(g) for g in args.gpus.split(",") if g]
        quotas = {team: int(n) for team, n in (q.split("=", 1) for q in args.quota)} if args.quota else None
    except ValueError:
        print(f"airay: --gpus takes comma-separated integers and --quota TEAM=GPUS (got --gpus {args.gpus!r}, "
              f"--quota {args.quota})", file=sys.stderr)
        return 2
    extra = {"resize_s": args.resize_s} if args.resize_s is not None else {}
    try:
        trace = load_csv(args.trace) if args.trace else None
        rows = sq.compare(gpus, tuple(p for p in args.policies.split(",") if p), trace, args.jobs, args.seed,
                          args.load, quotas, **extra)
    except (TraceError, ValueError) as exc:
        print(f"airay: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if args.json else sq.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

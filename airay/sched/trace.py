"""Job traces for the scheduler's simulator: a CSV format to replay a real trace, and a generator.

## The CSV format

One row per job, a header naming the columns (any order); lines starting with `#` are comments.

| column | required | meaning |
| --- | --- | --- |
| job_id | yes | unique name |
| submit_s | yes | seconds from the trace's start to the job's submission (>= 0) |
| gpus | yes | the size the job asks for: its max_workers (one worker per GPU) |
| duration_s | yes | its run time at `gpus` GPUs without interruption; its work is gpus x duration_s GPU-seconds |
| team | no (`default`) | who pays: the key of the teams' guaranteed quotas |
| priority | no (0) | an integer, higher runs first |
| min_gpus | no (= gpus) | its min_workers; below `gpus` the job is elastic, equal to it rigid |
| multiple | no (1) | world_size_multiple: its sizes are multiples of this (8: whole 8-GPU nodes) |

Replaying a public trace: Microsoft's Philly trace (github.com/msr-fiddle/philly-traces,
`cluster_job_log`): job_id = `jobid`, submit_s = `submitted_time` minus the first one, gpus = the
GPUs of its last attempt (`detail[].gpus`, summed over machines), duration_s = that attempt's
`end_time - start_time`, team = `vc` (Philly's virtual clusters, each with its GPU quota).
Alibaba's PAI trace (github.com/alibaba/clusterdata, cluster-trace-gpu-v2020): `pai_job_table`
gives job_name, user and submission (`start_time`), `pai_task_table` the GPUs (`plan_gpu` / 100 x
`inst_num`, summed over the job's tasks) and the run time (task `end_time - start_time`); team =
`user` or its group. Neither trace has priorities or elasticity: choose them (e.g. min_gpus =
gpus / 4 for the jobs you take as elastic).

## The generator

`generate(jobs, gpus, seed, load)`. What it takes from published analyses of two production GPU
clusters is the shape; the numbers are this module's choices, because neither paper's figures
can be copied here as parameters:

- Jeon et al., "Analysis of Large-Scale Multi-Tenant GPU Clusters for DNN Training Workloads",
  USENIX ATC'19 (Microsoft Philly; its public trace, msr-fiddle/philly-traces, holds 117,325 jobs
  submitted from 2017-08-07 to 2017-12-22): gang-scheduled jobs from one GPU to several
  machines, most of them small; teams share the cluster as virtual clusters, each with its GPU
  quota; the paper studies how gang scheduling and locality constraints delay jobs in the queue.
- Weng et al., "MLaaS in the Wild: Workload Analysis and Scheduling in Large-Scale Heterogeneous
  GPU Clusters", USENIX NSDI'22 (Alibaba PAI, over 6,000 GPUs, July and August 2020): jobs whose
  resource demands span orders of magnitude, and long queueing delays. Its trace keeps each
  timestamp's time of day (the trace's README), the daily cycle that arrivals here follow.

Chosen here: sizes are powers of two from 1 to 512 GPUs with `SIZE_WEIGHTS` (most jobs small,
most GPU-hours in large ones); jobs of 8 GPUs or more use whole 8-GPU nodes (multiple 8). Run
times at the requested size are log-normal (heavy-tailed: minutes to days) with median
`DURATION_MEDIAN_S` x (gpus / 8)^`DURATION_SIZE_EXPONENT` (larger jobs run longer) and shape
`DURATION_SIGMA`, clipped to `DURATION_CLIP_S`. Arrivals are a Poisson process whose rate follows
the day (rate x (1 + `DIURNAL_AMPLITUDE` sin(2 pi t / 1 day))), its mean set so that the work
offered per second is `load` x the fleet's GPUs. Priorities: `PRIORITY_SHARES` (high 2, normal 1,
low 0; neither trace has priorities). Teams: `TEAMS` (share of jobs, guaranteed share of the
fleet). Jobs of 16 GPUs or more are elastic with probability `ELASTIC_SHARE`, min_gpus a quarter
of gpus (at least one node); smaller ones are rigid.
"""

from __future__ import annotations

import csv
import math
from dataclasses import astuple, dataclass, fields
from pathlib import Path

import numpy as np

COLUMNS = ("job_id", "submit_s", "gpus", "duration_s", "team", "priority", "min_gpus", "multiple")
REQUIRED = COLUMNS[:4]

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SIZE_WEIGHTS = (0.30, 0.10, 0.10, 0.16, 0.12, 0.09, 0.06, 0.04, 0.02, 0.01)
NODE_GPUS = 8
DURATION_MEDIAN_S = 2 * 3600.0  # at 8 GPUs
DURATION_SIZE_EXPONENT = 0.25
DURATION_SIGMA = 1.5
DURATION_CLIP_S = (120.0, 14 * 86400.0)
DIURNAL_AMPLITUDE = 0.5
DAY_S = 86400.0
PRIORITY_SHARES = {2: 0.1, 1: 0.6, 0: 0.3}
TEAMS = {"team-a": (0.4, 0.30), "team-b": (0.3, 0.25), "team-c": (0.2, 0.15), "team-d": (0.1, 0.10)}
ELASTIC_SHARE = 0.75


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class TraceJob:
    job_id: str
    submit_s: float
    gpus: int
    duration_s: float
    team: str = "default"
    priority: int = 0
    min_gpus: int | None = None  # None: rigid (= gpus)
    multiple: int = 1

    @property
    def min_size(self) -> int:
        return self.gpus if self.min_gpus is None else self.min_gpus

    @property
    def work_gpu_s(self) -> float:
        return self.gpus * self.duration_s


def quotas(gpus: int) -> dict[str, int]:
    """The generated teams' guaranteed GPUs on a fleet of `gpus` (whole nodes)."""
    return {team: int(share * gpus) // NODE_GPUS * NODE_GPUS for team, (_, share) in TEAMS.items()}


def generate(jobs: int = 1200, gpus: int = 1024, seed: int = 0, load: float = 0.9) -> list[TraceJob]:
    """A trace of `jobs` jobs offering `load` x `gpus` GPUs of work on average (see the module doc)."""
    if jobs < 1 or gpus < NODE_GPUS or load <= 0:
        raise ValueError(f"need jobs >= 1, gpus >= {NODE_GPUS} and load > 0 (got {jobs}, {gpus}, {load})")
    rng = np.random.default_rng(seed)
    weights = np.array([w for s, w in zip(SIZES, SIZE_WEIGHTS) if s <= gpus])
    sizes = np.array([s for s in SIZES if s <= gpus])[rng.choice(len(weights), jobs, p=weights / weights.sum())]
    median = DURATION_MEDIAN_S * (sizes / NODE_GPUS) ** DURATION_SIZE_EXPONENT
    durations = np.clip(median * np.exp(DURATION_SIGMA * rng.standard_normal(jobs)), *DURATION_CLIP_S)
    prios = list(PRIORITY_SHARES)
    priority = np.array(prios)[rng.choice(len(prios), jobs, p=list(PRIORITY_SHARES.values()))]
    teams = list(TEAMS)
    team = rng.choice(len(teams), jobs, p=[share for share, _ in TEAMS.values()])
    elastic = rng.random(jobs) < ELASTIC_SHARE
    rate = load * gpus / float(np.mean(sizes * durations))  # jobs per second
    submits = _diurnal_arrivals(rng, jobs, rate)
    out = []
    for i in range(jobs):
        g = int(sizes[i])
        multiple = NODE_GPUS if g >= NODE_GPUS else 1
        floor = max(NODE_GPUS, g // 4 // NODE_GPUS * NODE_GPUS)
        out.append(TraceJob(f"job-{i:05d}", round(float(submits[i]), 1), g, round(float(durations[i]), 1),
                            teams[int(team[i])], int(priority[i]), floor if g >= 2 * NODE_GPUS and elastic[i] else g,
                            multiple))
    return out


def _diurnal_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """n arrival times of a Poisson process of mean rate `rate` whose rate follows the day (thinning)."""
    peak, times, t = rate * (1 + DIURNAL_AMPLITUDE), [], 0.0
    while len(times) < n:
        t += rng.exponential(1.0 / peak)
        if rng.random() * (1 + DIURNAL_AMPLITUDE) < 1 + DIURNAL_AMPLITUDE * math.sin(2 * math.pi * t / DAY_S):
            times.append(t)
    return np.array(times)


def write_csv(path: str | Path, jobs: list[TraceJob]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for j in jobs:
            row = list(astuple(j))
            row[COLUMNS.index("min_gpus")] = j.min_size
            w.writerow(row)


def load_csv(path: str | Path) -> list[TraceJob]:
    """The jobs of a trace file (format in the module doc); a bad row is named with its line and column."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip() and not line.lstrip().startswith("#")]
    if not numbered:
        raise TraceError(f"{path}: no header and no rows; the header names {', '.join(REQUIRED)} at least")
    reader = csv.reader([line for _, line in numbered])
    header = [h.strip() for h in next(reader)]
    missing = [c for c in REQUIRED if c not in header]
    unknown = [c for c in header if c not in COLUMNS]
    if missing or unknown:
        raise TraceError(f"{path} line {numbered[0][0]}: " + "; ".join(
            ([f"missing column(s) {', '.join(missing)}"] if missing else [])
            + ([f"unknown column(s) {', '.join(unknown)}"] if unknown else []))
            + f". Columns: {', '.join(COLUMNS)} (the first {len(REQUIRED)} required)")
    types = {f.name: f.type for f in fields(TraceJob)}
    jobs, seen = [], set()
    for (line_no, _), row in zip(numbered[1:], reader):
        where = f"{path} line {line_no}"
        if len(row) != len(header):
            raise TraceError(f"{where}: {len(row)} values for {len(header)} columns")
        values = dict(zip(header, (v.strip() for v in row)))
        where += f" (job_id {values['job_id']!r})"
        kw = {}
        for col, text in values.items():
            if text == "" and col not in REQUIRED:
                continue
            kw[col] = _parse(where, col, text, types[col])
        job = TraceJob(**kw)
        problem = _problem(job)
        if problem:
            raise TraceError(f"{where}: {problem}")
        if job.job_id in seen:
            raise TraceError(f"{where}, column 'job_id': {job.job_id!r} appears twice")
        seen.add(job.job_id)
        jobs.append(job)
    if not jobs:
        raise TraceError(f"{path}: a header but no jobs")
    return jobs


def _parse(where: str, col: str, text: str, kind: str):
    try:
        if "int" in kind:
            return int(text)
        if "float" in kind:
            value = float(text)
            if not math.isfinite(value):
                raise ValueError
            return value
        if not text:
            raise ValueError
        return text
    except ValueError:
        what = "an integer" if "int" in kind else "a number" if "float" in kind else "a name"
        raise TraceError(f"{where}, column {col!r}: {text!r} is not {what}") from None


def _problem(job: TraceJob) -> str | None:
    if job.submit_s < 0:
        return f"column 'submit_s': {job.submit_s} is negative"
    if job.gpus < 1:
        return f"column 'gpus': {job.gpus} must be >= 1"
    if job.duration_s <= 0:
        return f"column 'duration_s': {job.duration_s} must be > 0"
    if job.multiple < 1:
        return f"column 'multiple': {job.multiple} must be >= 1"
    if not 1 <= job.min_size <= job.gpus:
        return f"column 'min_gpus': {job.min_size} must be in 1..gpus ({job.gpus})"
    if -(-job.min_size // job.multiple) * job.multiple > job.gpus:
        return (f"column 'multiple': no multiple of {job.multiple} lies in min_gpus..gpus "
                f"({job.min_size}..{job.gpus})")
    return None

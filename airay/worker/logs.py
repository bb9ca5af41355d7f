"""A rank's log output, as the driver's console shows it (Ray forwards each worker's stdout and
stderr): DeepSpeed's notices about its own normal operation are quieted where they are made,
real warnings and errors come through, and every line a rank prints carries its rank.

- The accelerator: on a machine without a GPU DeepSpeed warns "Setting accelerator to CPU. If
  you have GPU or other accelerator, we were unable to detect it." every time a process first
  builds an engine; a rank that drives no GPU names the CPU accelerator (DS_ACCELERATOR, what
  DeepSpeed documents for choosing it), and DeepSpeed logs that choice at INFO.
- NOTICES: DeepSpeed call sites whose WARNING describes its own normal operation, by module and
  function (never by text), lowered to DEBUG: WarmupLR's constructor calls its own get_lr()
  before the first step and warns "Attempting to get learning rate from scheduler before it has
  started" on every engine build.
- The rank: Ray prefixes a worker's lines with its actor's name, which a worker's log file names
  in a `:actor_name:` line (Ray writes one with the actor's repr when the actor starts); a rank
  writes one whenever it joins a world, so its lines read `(TrainWorker rank 2 pid=...)`.
"""

from __future__ import annotations

import logging
import os
import sys

# (module file, function) of DeepSpeed notices that say nothing to the user: shown at DEBUG.
NOTICES = {("lr_schedules.py", "get_lr")}
ACTOR_NAME_PREFIX = ":actor_name:"  # ray._private.ray_constants.LOG_PREFIX_ACTOR_NAME (Ray 2.60)


class _Notices(logging.Filter):
    """Lowers the NOTICES' records to DEBUG, so the logger's level decides (as it would had
    DeepSpeed logged them at DEBUG)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if (os.path.basename(record.pathname), record.funcName) in NOTICES and record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_deepspeed(drives_gpu: bool) -> None:
    """Before DeepSpeed is imported in this process (its accelerator is chosen then)."""
    if not drives_gpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    logger = logging.getLogger("DeepSpeed")  # the object deepspeed.utils.logger will be
    logger.setLevel(logging.WARNING)  # DeepSpeed logs every engine build at INFO
    if not any(isinstance(f, _Notices) for f in logger.filters):
        logger.addFilter(_Notices())


def name_rank(rank: int) -> None:
    """From here on, Ray prefixes this process's lines with its rank."""
    for stream in (sys.stdout, sys.stderr):
        print(f"{ACTOR_NAME_PREFIX}TrainWorker rank {rank}", file=stream, flush=True)

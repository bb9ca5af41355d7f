"""A rank's log output (airay.worker.logs): DeepSpeed's notices about its own normal operation are
quieted where they are made, its real warnings still come through, and a rank names itself to Ray."""

import logging

import torch


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_warmup_lrs_own_notice_is_debug_and_a_real_warning_still_comes_through(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    from airay.worker.logs import quiet_deepspeed

    quiet_deepspeed(drives_gpu=False)
    import os

    assert os.environ["DS_ACCELERATOR"] == "cpu"  # a rank without a GPU names its accelerator
    from deepspeed.runtime.lr_schedules import WarmupLR
    from deepspeed.utils import logger

    collect = _Collect()
    logger.addHandler(collect)
    try:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        WarmupLR(optimizer, warmup_num_steps=10)  # calls its own get_lr() before the first step
        assert collect.records == []
        logger.warning("a real warning")
        assert [r.getMessage() for r in collect.records] == ["a real warning"]
        logger.setLevel(logging.DEBUG)  # asked for: the notice is there, at DEBUG
        WarmupLR(optimizer, warmup_num_steps=10)
        assert [(r.levelname, r.funcName) for r in collect.records[1:]] == [("DEBUG", "get_lr")]
    finally:
        logger.removeHandler(collect)
        logger.setLevel(logging.WARNING)


def test_a_rank_names_itself_in_the_line_ray_reads_for_its_log_prefix(capsys):
    from ray._private.ray_constants import LOG_PREFIX_ACTOR_NAME

    from airay.worker.logs import ACTOR_NAME_PREFIX, name_rank

    assert ACTOR_NAME_PREFIX == LOG_PREFIX_ACTOR_NAME  # the Ray this was written for
    name_rank(3)
    out, err = capsys.readouterr()
    assert out == err == f"{LOG_PREFIX_ACTOR_NAME}TrainWorker rank 3\n"

"""The worker's pure decisions: which errors are the user's, device choice, engine config."""

import torch.distributed as tdist

from airay.policy import BatchPlan
from airay.worker import _is_comm_error, device_for, engine_config

GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
              "[127.0.0.1]:387: Connection reset by peer")


def test_collective_failures_are_not_user_errors():
    assert _is_comm_error(RuntimeError(GLOO_RESET))
    assert _is_comm_error(tdist.DistBackendError("NCCL communicator was aborted"))


def test_user_errors_are_not_mistaken_for_collective_failures():
    # "unexpected" contains "peer": a substring match once turned this into a retry loop.
    assert not _is_comm_error(TypeError("TinyGPT.__init__() got an unexpected keyword argument 'n_layerz'"))
    assert not _is_comm_error(RuntimeError("shape mismatch: unexpected peer tensor"))
    assert not _is_comm_error(ValueError("gloo"))


def test_device_for():
    assert device_for(["3"], cuda_available=True) == ("cuda:3", "nccl")
    assert device_for(["3"], cuda_available=False) == ("cpu", "gloo")
    assert device_for([], cuda_available=True) == ("cpu", "gloo")


def test_engine_config_sets_batch_fields_without_touching_the_spec():
    base = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
    cfg = engine_config(base, BatchPlan(3, 4, 2), on_cpu=True, load_universal=True)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) \
        == (24, 4, 2)
    assert cfg["optimizer"]["params"]["torch_adam"] is True and cfg["checkpoint"]["load_universal"] is True
    assert "torch_adam" not in base["optimizer"]["params"] and "train_batch_size" not in base
    assert "torch_adam" not in engine_config(base, BatchPlan(1, 1, 1), on_cpu=False,
                                             load_universal=False)["optimizer"]["params"]


def test_memory_errors_in_user_code_stay_memory_errors():
    # Running out of memory inside the loss is the machine's limit: it must reach the driver as
    # MemoryError (replace the worker), not as UserCodeError (fail the run).
    import pytest

    from airay.worker import TrainWorker, UserCodeError

    w = TrainWorker.__new__(TrainWorker)
    w.rank = 3

    def oom():
        raise MemoryError()

    def bug():
        raise TypeError("bad arg")

    with pytest.raises(MemoryError):
        w._user(oom)
    with pytest.raises(UserCodeError, match="rank 3: TypeError: bad arg"):
        w._user(bug)

"""The training actor and what it is made of:

- actor: TrainWorker, the Ray actor (one process per bundle, kept across world changes).
- device: which GPU a rank drives (LOCAL_RANK, the CUDA ordinal), a pure function.
- dist: process groups (rendezvous port, leaving a broken world, NCCL's error handling) and
  what an exception says failed (infrastructure, a collective, data, or user code).
- engine: the DeepSpeed engine for a world's batch plan, and one micro-batch's update.
- deepspeed_compat: private DeepSpeed details, with the version each was written for.
"""

from airay.worker.actor import TrainWorker, UserCodeError, token_count
from airay.worker.dist import free_port

__all__ = ["TrainWorker", "UserCodeError", "free_port", "token_count"]

"""The training actor and what it is made of:

- actor: TrainWorker, the Ray actor (one process per bundle, kept across world changes).
- device: which GPU a rank drives (LOCAL_RANK, the CUDA ordinal), a pure function.
- dist: process groups (rendezvous port, leaving a broken world, NCCL's error handling).
- failures: what an exception raised on a rank says failed (the machine's memory, the GPU, NCCL,
  a collective, data, airay's own code or the user's), named as the class the rank raises.
- engine: the DeepSpeed engine for a world's batch plan, and one micro-batch's update.
- deepspeed_compat: private DeepSpeed details, with the version each was written for.
"""

from airay.worker.actor import TrainWorker, token_count
from airay.worker.dist import free_port
from airay.worker.failures import UserCodeError

__all__ = ["TrainWorker", "UserCodeError", "free_port", "token_count"]

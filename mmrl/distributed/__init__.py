"""Beyond one process: the training group (FSDP2 or DeepSpeed ZeRO, data parallel) and the Ray backend.

    training_group.py   GroupLearner: one process of the data-parallel, sharded policy update
    deepspeed_group.py  trainer.strategy=deepspeed: DeepSpeedLearner (ZeRO-2/3 in that group) and
                        the local backend's one-process DeepSpeed trainee
    one_update.py       one update of the group on a saved step, launched by torchrun
    ray_backend.py      trainer.backend=ray: rollout workers, reward workers and the training
                        group as Ray actors, composed into the same loop as the local backend
    reward_worker.py    the reward workers' actor class, in a module that loads no torch

Ray, DeepSpeed and the group's launch are imported lazily: a local run with the default strategy
needs nothing here.
"""

from __future__ import annotations

import hashlib
import os
import sys


def torch_extensions_dir() -> str:
    """Where DeepSpeed builds and caches its C++ ops (`TORCH_EXTENSIONS_DIR`) for the tests and
    the benchmarks: `~/.cache/mmrl/torch_extensions/<key>`, the key a hash of this virtual
    environment's path. Kept across runs and CI jobs, shared by every process of a run; one per
    environment because a build records the environment's paths, so two checkouts sharing one
    folder would each build the ops again (about a minute of both cores) after the other."""
    key = hashlib.sha1(os.path.abspath(sys.prefix).encode()).hexdigest()[:12]
    return os.path.join(os.path.expanduser("~/.cache/mmrl/torch_extensions"), key)

"""Beyond one process: the training group (FSDP2 or DeepSpeed ZeRO, data parallel) and the Ray backend.

    training_group.py   GroupLearner: one process of the data-parallel, sharded policy update
    deepspeed_group.py  trainer.strategy=deepspeed: DeepSpeedLearner (ZeRO-2/3 in that group) and
                        the local backend's one-process DeepSpeed trainee
    one_update.py       one update of the group on a saved step, launched by torchrun
    ray_backend.py      trainer.backend=ray: rollout workers, reward workers and the training
                        group as Ray actors, composed into the same loop as the local backend

Ray, DeepSpeed and the group's launch are imported lazily: a local run with the default strategy
needs nothing here.
"""

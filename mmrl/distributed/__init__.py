"""Beyond one process: the training group (FSDP2, data parallel) and the Ray backend.

    training_group.py   GroupLearner: one process of the data-parallel, sharded policy update
    one_update.py       one update of the group on a saved step, launched by torchrun
    ray_backend.py      trainer.backend=ray: rollout workers, a reward worker and the training
                        group as Ray actors, composed into the same loop as the local backend

Ray and the group's launch are imported lazily: nothing here is needed by a local run.
"""

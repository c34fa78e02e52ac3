"""Which composition runs a VLM training, chosen by name from the config.

A composition is how the same pieces (policy, rollout engine, router, update) are put together:
what builds the trainee and what one step is (`mmrl.train.grpo.Composition`). The loop in
`mmrl.train.grpo.train` runs whichever it is given. This module is the only one that imports
the compositions, so arrows point one way: the loop imports none of them, and none of them
imports this module.

| setting | composition | module |
|---|---|---|
| (default) | the on-policy loop in one process | `mmrl.train.grpo` |
| `trainer.backend=ray` | rollout, training and reward roles as Ray actors | `mmrl.distributed.ray_backend` |
| `trainer.mode=async` | generation of step k+1 overlaps the update of step k | `mmrl.train.async_grpo` |
| `trainer.strategy=deepspeed` | the update through a DeepSpeed ZeRO engine | `mmrl.distributed.deepspeed_group` |
| `rollout.engine=vllm` | vLLM beside the trainer, asleep during the update | `mmrl.train.colocated` |

The first setting in this order that is not its default decides.
"""

from __future__ import annotations

from mmrl.config import Config
from mmrl.train.grpo import Composition, TrainResult, local_composition
from mmrl.train.grpo import train as train_loop


def composition(cfg: Config) -> Composition:
    """The composition `cfg` asks for (`trainer.backend`, `trainer.mode`, `trainer.strategy`,
    `rollout.engine`; see the module's table)."""
    if cfg.trainer.backend == "ray":
        from mmrl.distributed.ray_backend import ray_composition

        return ray_composition(cfg)
    if cfg.trainer.mode == "async":
        from mmrl.train.async_grpo import async_composition

        return async_composition(cfg)
    if cfg.trainer.strategy == "deepspeed":
        from mmrl.distributed.deepspeed_group import deepspeed_composition

        return deepspeed_composition(cfg)
    if cfg.rollout.engine == "vllm":
        from mmrl.train.colocated import colocated_composition

        return colocated_composition(cfg)
    return local_composition()


def train(cfg: Config) -> TrainResult:
    """`mmrl train` for a VLM recipe: the training loop with the composition `cfg` asks for."""
    return train_loop(cfg, composition(cfg))

"""The class of one training-group process, by `trainer.strategy`.

Above both strategies' modules (`training_group`: FSDP2, `deepspeed_group`: DeepSpeed ZeRO),
which import neither this module nor, for this choice, each other.
"""

from __future__ import annotations

from mmrl.config import Config
from mmrl.distributed.training_group import GroupLearner


def learner_class(cfg: Config) -> type[GroupLearner]:
    """`GroupLearner` (FSDP2) or `mmrl.distributed.deepspeed_group.DeepSpeedLearner` (DeepSpeed
    ZeRO; imported only when asked for, with DeepSpeed itself)."""
    if cfg.trainer.strategy == "deepspeed":
        from mmrl.distributed.deepspeed_group import DeepSpeedLearner

        return DeepSpeedLearner
    return GroupLearner

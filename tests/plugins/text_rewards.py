"""A test-only model reward any process can import (`reward.plugins=[text_rewards]`, with this
folder on PYTHONPATH): the Ray backend's reward workers build it in their own processes."""

from __future__ import annotations

import torch

from mmrl.rewards.base import RewardModel, RewardOutput, register_reward_model


@register_reward_model("test_brevity_module")
class BrevityWithWeights(RewardModel):
    """1 / (1 + characters): rewards short answers. It holds a small torch module (so it has
    memory to place and can be moved off the accelerator around updates)."""

    requires = ("responses",)

    def __init__(self, device="cpu"):
        super().__init__(device)
        self.head = torch.nn.Linear(16, 1).to(device)

    def torch_modules(self) -> dict[str, torch.nn.Module]:
        return {"head": self.head}

    def score_with_components(self, images=None, prompts=None, responses=None, **fields):
        self.check_inputs(images, prompts, responses, fields)
        return RewardOutput(
            scores=[1 / (1 + len(r)) for r in responses],
            components={"chars": [float(len(r)) for r in responses]},
        )

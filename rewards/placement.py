"""Sharing the accelerator between the policy and the reward models.

The reward models score on the accelerator, but while the policy takes its update (gradients
and optimizer state at their peak) there may be no room for them. `RewardPlacement` decides
once, from the memory each model holds and a budget, which models stay **resident** on the
accelerator and which are **offloaded**: moved to host memory before each update and back to
the accelerator before scoring. Every move is recorded (`events`), and `report()` gives the
memory each model holds and where it is.

Devices are configuration: `accelerator="cuda:0", host="cpu"` on a GPU machine; on a CPU-only
machine `accelerator="cpu", host="cpu"` runs the same code paths (the moves are real `to()`
calls, only to the same device), which is how it is tested here.

The trainer's loop::

    placement = RewardPlacement(models, accelerator="cuda:0", budget_bytes=free - policy_peak)
    for step ...:
        with placement.scoring():      # offloaded models come back to the accelerator
            rewards = score_model_rewards(samples, responses, images, placement.models)
        with placement.training():     # offloaded models go to host memory
            update(policy)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from mmrl.rewards.base import RewardModel

ACCELERATOR = "accelerator"
HOST = "host"


@dataclass
class PlacementEvent:
    """One move of one reward model."""

    model: str
    """The reward model's name in the placement."""
    src: str
    """Where it was: "accelerator" or "host"."""
    dst: str
    """Where it went."""
    device: str
    """The torch device it went to."""
    reason: str
    """"initial", "update" (leaving for the policy's update) or "scoring" (back to score)."""
    bytes: int
    """Memory moved (parameters and buffers)."""


class RewardPlacement:
    """Keeps reward models resident on the accelerator when `budget_bytes` allows, else moves
    them to host memory around each policy update.

    Args:
        models: name -> reward model; the order is the priority (earlier models are kept
            resident first) and the order in which offloaded models are moved.
        accelerator: the device the policy trains on and the reward models score on.
        host: where offloaded models wait ("cpu").
        budget_bytes: accelerator memory the reward models may keep during the update; None
            keeps every model resident. Models are kept greedily in priority order while their
            total fits; `cpu_only` models (JPEG, ONNX OCR) never count nor move.
    """

    def __init__(
        self,
        models: Mapping[str, RewardModel],
        accelerator: str | torch.device = "cpu",
        host: str | torch.device = "cpu",
        budget_bytes: int | None = None,
    ):
        self.models = dict(models)
        self.accelerator = torch.device(accelerator)
        self.host = torch.device(host)
        self.budget_bytes = budget_bytes
        self.memory = {name: model.memory_bytes() for name, model in self.models.items()}
        self.resident: list[str] = []
        self.offloaded: list[str] = []
        used = 0
        for name, model in self.models.items():
            if model.cpu_only:
                continue
            if budget_bytes is None or used + self.memory[name] <= budget_bytes:
                self.resident.append(name)
                used += self.memory[name]
            else:
                self.offloaded.append(name)
        self.location = {name: HOST if m.cpu_only else ACCELERATOR for name, m in self.models.items()}
        self.events: list[PlacementEvent] = []
        for name in self.resident + self.offloaded:  # everything starts ready to score
            self._move(name, ACCELERATOR, "initial", force=True)

    def _move(self, name: str, dst: str, reason: str, force: bool = False) -> None:
        if self.location[name] == dst and not force:
            return
        device = self.accelerator if dst == ACCELERATOR else self.host
        src = self.location[name]
        self.models[name].to(device)
        self.location[name] = dst
        self.events.append(PlacementEvent(name, src, dst, str(device), reason, self.memory[name]))

    def before_update(self) -> None:
        """Move the offloaded models to host memory (in priority order)."""
        for name in self.offloaded:
            self._move(name, HOST, "update")
        if self.offloaded and self.accelerator.type == "cuda":
            torch.cuda.empty_cache()

    def before_scoring(self) -> None:
        """Bring the offloaded models back to the accelerator (in priority order)."""
        for name in self.offloaded:
            self._move(name, ACCELERATOR, "scoring")

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around the policy update: offloaded models are on the host inside."""
        self.before_update()
        yield

    @contextlib.contextmanager
    def scoring(self) -> Iterator[None]:
        """Around reward scoring: every model is ready on its scoring device inside."""
        self.before_scoring()
        yield

    def score_rows(
        self, samples: list, responses: list[str], failures: dict[int, tuple[str, str]]
    ) -> list[dict[str, float]]:
        """`score_model_rewards` of the rows with every model ready on its scoring device
        (failing rows go to `failures`). A remote placement (the Ray backend's reward workers,
        `mmrl.distributed.ray_backend.RayModelRewards`) has the same method."""
        from mmrl.rewards.router_bridge import score_model_rewards

        with self.scoring():
            return score_model_rewards(samples, responses, None, self.models, failures)

    def resident_bytes(self) -> int:
        """Accelerator memory the reward models keep during the update."""
        return sum(self.memory[n] for n in self.resident)

    def report(self) -> dict[str, dict[str, object]]:
        """name -> {"bytes", "device", "location", "resident"} for every model."""
        return {
            name: {
                "bytes": self.memory[name],
                "device": str(model.device),
                "location": self.location[name],
                "resident": name in self.resident or model.cpu_only,
            }
            for name, model in self.models.items()
        }

    def metrics(self, prefix: str = "reward_models/") -> dict[str, float]:
        """Per model: memory in MB and whether it stays resident (for the step metrics)."""
        out: dict[str, float] = {}
        for name, info in self.report().items():
            out[f"{prefix}memory_mb/{name}"] = int(info["bytes"]) / 1e6
            out[f"{prefix}resident/{name}"] = float(bool(info["resident"]))
        out[f"{prefix}resident_mb"] = self.resident_bytes() / 1e6
        out[f"{prefix}moves"] = float(sum(e.reason != "initial" for e in self.events))
        return out

"""An exponential moving average of parameters (flow-GRPO's evaluation weights, the image base's
warm-up): a leaf module, so a model's warm-up and the trainer share it without importing each other."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class EMA:
    """Exponential moving average of parameters, swapped in for evaluation and saving.

    ema <- d ema + (1 - d) p with d = min(decay, (1 + n) / (10 + n)) at the n-th update (a warm-up
    so early averages are not dominated by the initial weights).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float):
        self.params = list(params)
        self.shadow = [p.detach().clone().float() for p in self.params]
        self.decay = decay
        self.updates = 0
        self._stash: list[torch.Tensor] | None = None

    @torch.no_grad()
    def update(self) -> None:
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for s, p in zip(self.shadow, self.params):
            s.mul_(d).add_(p.detach().float(), alpha=1 - d)
        self.updates += 1

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The EMA weights in place of the live ones inside the block."""
        with torch.no_grad():
            stash = [p.detach().clone() for p in self.params]
            for s, p in zip(self.shadow, self.params):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for s, p in zip(stash, self.params):
                    p.copy_(s)

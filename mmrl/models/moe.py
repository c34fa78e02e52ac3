"""Mixture-of-experts policies: finding the routers, freezing them, and watching how they route.

RL on an MoE language model (Qwen3-VL-MoE, Qwen3-MoE, ...) has a failure mode dense models do
not: the router's top-k choice is discrete, so the expert a token goes to can differ between the
rollout engine, the old log-prob pass and the update, and a router that drifts during RL changes
which parameters a token's gradient reaches. Two common remedies: freeze the router (its weights
keep the pretrained routing; the experts still train), and watch the routing statistics.

| what | where |
|---|---|
| `router_modules` | every router of a model: transformers' `*TopKRouter` modules (Qwen2/3-MoE, Qwen3-VL-MoE, OLMoE, ...), or a `gate` linear layer inside a sparse-MoE block |
| `freeze_router` | `model.freeze_router`: no gradient to any router weight |
| `RouterStats` | forward hooks that record, per router, the expert load and router entropy of every position it routes |

Metrics (`RouterStats.metrics`, logged by the update as `moe/...`), with E experts, top-k routing,
f_e the share of routing slots that went to expert e and P_e its mean router probability:

    moe/load_balance     E * sum_e f_e P_e       1 when the routing is uniform (the Switch /
                                                 Qwen auxiliary loss, divided by k so balanced = 1)
    moe/router_entropy   mean over positions of H(softmax(router logits)), nats (max log E)
    moe/expert_frac_max  max_e f_e               1 / E when balanced, at most 1 / k (one expert
                                                 in every position's top k)

averaged over the routers (layers). They cover every position a router sees in the update's
forward passes: prompt, response and padding positions alike (the hooks do not see the mask).
"""

from __future__ import annotations

from collections import defaultdict

import torch

ROUTER_CLASS_SUFFIX = "Router"


def router_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The routers of `model` by module name (empty for a dense model)."""
    found: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if type(module).__name__.endswith(ROUTER_CLASS_SUFFIX) and any(True for _ in module.parameters()):
            found[name] = module
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if (
            name.endswith(".gate")
            and isinstance(module, torch.nn.Linear)
            and "SparseMoe" in type(model.get_submodule(parent)).__name__
        ):
            found[name] = module
    return found


def freeze_router(model: torch.nn.Module) -> int:
    """Turn off the gradient of every router parameter; returns how many tensors were frozen.
    Raises if the model has no router (a dense model: `model.freeze_router` is a mistake there)."""
    routers = router_modules(model)
    if not routers:
        raise ValueError(
            f"model.freeze_router: {type(model).__name__} has no mixture-of-experts router (a dense model)"
        )
    frozen = 0
    for module in routers.values():
        for p in module.parameters():
            p.requires_grad_(False)
            frozen += 1
    return frozen


def _top_k(module: torch.nn.Module, model: torch.nn.Module) -> int:
    k = getattr(module, "top_k", None)
    if k is None:
        text = model.config.get_text_config() if hasattr(model, "config") else None
        k = getattr(text, "num_experts_per_tok", None)
    if k is None:
        raise ValueError(f"cannot tell the top-k of router {type(module).__name__}")
    return int(k)


class RouterStats:
    """Routing statistics of the forward passes run while installed (a context manager).

        with RouterStats(model) as stats:
            ...forward passes...
        stats.metrics()  # {"moe/load_balance": ..., "moe/router_entropy": ..., ...}

    Each router's hook takes its logits ([positions, E]: a router's first output, or the gate
    layer's output), under no_grad, and accumulates per expert the routing slots and the summed
    probabilities, and the summed entropy. Nothing is kept per position.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.routers = router_modules(model)
        self._handles: list = []
        self.slots: dict[str, torch.Tensor] = {}
        self.prob_sums: dict[str, torch.Tensor] = {}
        self.entropy_sum: dict[str, float] = defaultdict(float)
        self.positions: dict[str, int] = defaultdict(int)

    def __enter__(self) -> RouterStats:
        for name, module in self.routers.items():
            self._handles.append(module.register_forward_hook(self._hook(name, _top_k(module, self.model))))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str, k: int):
        def hook(module, inputs, output):
            logits = output[0] if isinstance(output, tuple) else output
            self.record(name, logits, k)

        return hook

    @torch.no_grad()
    def record(self, name: str, logits: torch.Tensor, k: int) -> None:
        """Accumulate one router call's logits [..., E] (top-k routing)."""
        logits = logits.detach().float().reshape(-1, logits.shape[-1])
        if logits.shape[0] == 0:
            return
        E = logits.shape[-1]
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        chosen = torch.topk(logits, min(k, E), dim=-1).indices
        slots = torch.zeros(E, device=logits.device).index_add_(
            0, chosen.flatten(), torch.ones(chosen.numel(), device=logits.device)
        )
        self.slots[name] = self.slots.get(name, torch.zeros_like(slots)) + slots
        self.prob_sums[name] = self.prob_sums.get(name, torch.zeros_like(slots)) + p.sum(0)
        self.entropy_sum[name] += float(-(p * logp).sum())
        self.positions[name] += logits.shape[0]

    def metrics(self) -> dict[str, float]:
        """`moe/load_balance`, `moe/router_entropy`, `moe/expert_frac_max` averaged over the routers
        that routed anything, and `moe/routers`; {} for a dense model or before any forward."""
        names = [n for n in self.slots if self.positions[n] > 0]
        if not names:
            return {}
        balance, entropy, frac_max = [], [], []
        for n in names:
            f = self.slots[n] / self.slots[n].sum()
            P = self.prob_sums[n] / self.positions[n]
            E = f.numel()
            balance.append(float(E * (f * P).sum()))
            entropy.append(self.entropy_sum[n] / self.positions[n])
            frac_max.append(float(f.max()))
        return {
            "moe/load_balance": sum(balance) / len(names),
            "moe/router_entropy": sum(entropy) / len(names),
            "moe/expert_frac_max": sum(frac_max) / len(names),
            "moe/routers": float(len(names)),
        }

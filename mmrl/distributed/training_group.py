"""The training group: the policy update across processes, data parallel, with FSDP2.

Each process of the group holds a shard of the parameters, gradients and optimizer state
(PyTorch FSDP2, `torch.distributed.fsdp.fully_shard`: ZeRO-3), and gets an equal share of the
rows of every mini-batch. It runs the very same update as the single-process trainer
(`mmrl.train.update.update_policy`, `old_and_ref_logprobs`) on its rows; only the loss is
re-weighted so that the group's gradient is the single-process one on the whole batch:

    single process, mini-batch j:   L_j = sum_{rows of j} l / D_j
    process r (its rows of j):      L_rj = sum_{its rows} l / D_rj      (what update_policy computes)
    the group:                      grad L_j = sum_r (D_rj / D_j) grad L_rj

D is `loss_denominator` (tokens, or sequences, or sequences x max_len, by `algo.loss_agg`), for
the whole mini-batch (D_j) and for the process's share (D_rj); FSDP2 sums the processes'
gradients (reduce-scatter). The factor D_rj / D_j scales the gradient reaching the logits of
each forward of the update, so the loss values and metrics stay update_policy's own. Gradient
clipping sees the global norm (DTensor). Tested: a 2-process gloo update gives the 1-process
parameters (`tests/test_distributed_training_group.py`).

Limits (checked in `Config.__post_init__`): `ppo_epochs=1` (later epochs shuffle rows within
a process), an entropy bonus only with `loss_agg=token_mean` (its normaliser is a token count),
no DAPO dynamic sampling (rows must split evenly), no LoRA yet. A non-finite loss in one
process skips its micro-batches but not the others': the group would stop in a collective.

`trainer.strategy=deepspeed` swaps FSDP2 for DeepSpeed ZeRO in the same class's place
(`learner_class`; `mmrl.distributed.deepspeed_group.DeepSpeedLearner`): the same rows, shares and
update, DeepSpeed's engine, optimizer and clipping.

Launch: one `GroupLearner` per process, each told its rank, the world size and a rendezvous
(`init_method`): Ray actors (`mmrl.distributed.ray_backend`), or any launcher such as
`torchrun` (`GroupLearner.from_env` reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
"""

from __future__ import annotations

import copy
import logging
import os
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from mmrl.algos.losses import loss_denominator
from mmrl.config import Config
from mmrl.models.adapters import freeze_parts, param_groups
from mmrl.models.loading import Policy, load_policy
from mmrl.models.precision import Precision, resolve_dtype
from mmrl.train.batching import select_rows
from mmrl.train.update import old_and_ref_logprobs, row_chunks, update_policy
from mmrl.types import RolloutBatch

log = logging.getLogger(__name__)


def rank_rows(n_rows: int, mini_batches: int, rank: int, world_size: int) -> list[int]:
    """The rows of an `n_rows` batch that process `rank` trains: an equal, contiguous share of
    every mini-batch, in order (so its mini-batch j is its share of the global mini-batch j).

    >>> rank_rows(8, 2, 1, 2)
    [2, 3, 6, 7]
    """
    mb = n_rows // mini_batches
    if n_rows % mini_batches or mb % world_size:
        raise ValueError(
            f"{n_rows} rows do not split into {mini_batches} mini-batches of equal shares for "
            f"{world_size} processes (trainer.mini_batches * trainer.train_workers must divide the rows)"
        )
    share = mb // world_size
    return [j * mb + rank * share + i for j in range(mini_batches) for i in range(share)]


def loss_shares(cfg: Config, global_mask: torch.Tensor, rows: list[int]) -> list[float]:
    """D_rj / D_j for each forward of this process's update pass (`row_chunks` order).

    Args:
        global_mask: [N, R] the response mask of the whole batch.
        rows: this process's rows (`rank_rows`).
    """
    M, max_len, agg = cfg.trainer.mini_batches, cfg.rollout.max_new_tokens, cfg.algo.loss_agg
    mb, share = global_mask.shape[0] // M, len(rows) // M
    shares = []
    for chunk in row_chunks(cfg, len(rows)):
        j = chunk[0] // share
        whole = loss_denominator(global_mask[j * mb : (j + 1) * mb].float(), agg, max_len)
        mine = loss_denominator(global_mask[rows[j * share : (j + 1) * share]].float(), agg, max_len)
        shares.append(mine / whole)
    return shares


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class ShareOfGlobalLoss(torch.nn.Module):
    """The policy as `update_policy` sees it in a group: each gradient-enabled log-prob pass
    (`mmrl.train.forward.response_logprobs`) scales the gradient of its outputs by the next
    planned share (`loss_shares`)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.shares: deque[float] = deque()

    def run_as_forward(self, fn):
        """`fn` as the sharded model's forward (see `call_as_forward`), its log-probs and
        entropy scaled on the way back."""
        from mmrl.train.forward import call_as_forward

        out = call_as_forward(self.module, fn)
        if torch.is_grad_enabled():
            if not self.shares:
                raise RuntimeError(
                    "a gradient pass beyond the planned ones: update_policy's pass order no longer "
                    "matches row_chunks, so the group's loss shares would be wrong"
                )
            share = self.shares.popleft()
            out = tuple(_ScaleGrad.apply(x, share) for x in out)
        return out


def shard(model: torch.nn.Module, mesh, mp_policy=None) -> torch.nn.Module:
    """FSDP2 on every block the model says must not be split (decoder layers, vision blocks),
    then on the whole; gradients are summed across the group, not averaged. `mp_policy`: an
    FSDP2 `MixedPrecisionPolicy` (None: compute in the weights' dtype)."""
    from torch.distributed.fsdp import fully_shard

    kw = {"mesh": mesh} if mp_policy is None else {"mesh": mesh, "mp_policy": mp_policy}
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, **kw)
    fully_shard(model, **kw)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


class GroupLearner:
    """One process of the training group: its shard of the policy (and reference), its optimizer
    and learning-rate schedule; `old_and_ref_logprobs` and `update` on its rows of a batch.

    Every process must make the same calls in the same order (they meet in collectives).
    """

    def __init__(
        self,
        cfg: Config,
        model_path: str | Path,
        rank: int,
        world_size: int,
        init_method: str,
        backend: str | None = None,
        threads: int = 0,
        dtype: torch.dtype = torch.float32,
    ):
        from mmrl.train.grpo import seed_everything

        if cfg.model.lora_rank > 0:
            raise ValueError("model.lora_rank > 0: the training group does not shard LoRA adapters yet")
        if threads > 0:
            torch.set_num_threads(threads)
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        gpu = torch.cuda.is_available() and backend != "gloo"
        self.device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                backend or ("nccl" if gpu else "gloo"),
                init_method=init_method,
                rank=rank,
                world_size=world_size,
            )
        seed_everything(cfg.trainer.seed)
        policy = load_policy(model_path, dtype=dtype, revision=cfg.model.revision)
        freeze_parts(policy.model, cfg)
        self._shard(policy, dtype)
        self._wrapped = ShareOfGlobalLoss(self.model)

    averages_gradients = False
    """Whether the strategy averages the processes' gradients (then each loss share is scaled by
    the world size); FSDP2 here sums them."""

    def _shard(self, policy: Policy, dtype: torch.dtype) -> None:
        """Shard the policy (and reference) and build the optimizer and schedule: sets `model`,
        `reference`, `precision`, `policy`, `optimizer`, `scheduler`."""
        from torch.distributed import fsdp
        from torch.distributed.device_mesh import init_device_mesh

        from mmrl.train.grpo import lr_lambda

        cfg = self.cfg
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        model = policy.model.to(self.device).train()
        # Mixed precision the FSDP2 way: sharded master weights in `dtype` (float32), gathered in
        # the compute dtype for the forward and backward, gradients reduced in float32. An explicit
        # non-float32 `dtype` (a test's float64) is used throughout.
        compute = resolve_dtype(cfg.model.dtype, self.device) if dtype == torch.float32 else dtype
        mp = (
            None
            if compute == dtype
            else fsdp.MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        )
        reference = None
        if cfg.algo.kl_coef > 0:
            reference = shard(copy.deepcopy(model).eval().requires_grad_(False), mesh, mp)
        self.model = shard(model, mesh, mp)
        self.precision = Precision(self.device, compute, compute)  # FSDP2 casts; no autocast
        log.info("training group: FSDP2 on %s, master weights %s, compute %s", self.device, dtype, compute)
        self.policy = Policy(self.model, policy.processor, policy.blocked.to(self.device),
                             policy.stop_token_ids, policy.pad_token_id, self.precision)  # fmt: skip
        self.reference = reference
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, cfg), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))

    @classmethod
    def from_env(cls, cfg: Config, model_path: str | Path, **kw) -> GroupLearner:
        """In a process started by `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
        if torch.cuda.is_available() and kw.get("backend") != "gloo":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        return cls(cfg, model_path, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", **kw)

    def rows(self, n_rows: int) -> list[int]:
        return rank_rows(n_rows, self.cfg.trainer.mini_batches, self.rank, self.world_size)

    def old_and_ref_logprobs(
        self, batch: RolloutBatch
    ) -> tuple[list[int], torch.Tensor, torch.Tensor | None]:
        """This process's rows and their old / reference log-probs [n, R], in the chunks of its
        update's first pass (so its first on-policy mini-batch has a ratio of exactly 1)."""
        rows = self.rows(len(batch))
        mine = select_rows(batch, rows).to(self.device)
        old, ref = old_and_ref_logprobs(self.cfg, self.policy, self.reference, mine)
        return rows, old.cpu(), None if ref is None else ref.cpu()

    def update(
        self,
        batch: RolloutBatch,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        weights: torch.Tensor | None,
    ) -> tuple[dict[str, float], float, float]:
        """`update_policy` on this process's rows of the whole batch (all tensors are the whole
        batch's: advantages [N], the rest [N, R]), then one scheduler step. Returns its metrics,
        its token count and its mean loss share (for `merge_metrics`)."""
        rows = self.rows(len(batch))
        dev = self.device

        def mine(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[rows].to(dev)

        shares = loss_shares(self.cfg, batch.response_mask, rows)
        scale = self.world_size if self.averages_gradients else 1
        self._wrapped.shares = deque(share * scale for share in shares)
        local = select_rows(batch, rows).to(dev)
        policy = Policy(self._wrapped, self.policy.processor, self.policy.blocked,
                        self.policy.stop_token_ids, self.policy.pad_token_id, self.precision)  # fmt: skip
        metrics = update_policy(
            self.cfg, policy, self.optimizer, local, mine(advantages), mine(old_logprobs),
            mine(ref_logprobs), mine(weights),
        )  # fmt: skip
        if self._wrapped.shares:
            raise RuntimeError(f"{len(self._wrapped.shares)} planned gradient passes did not run")
        self.scheduler.step()
        return metrics, float(local.response_mask.sum()), sum(shares) / len(shares)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole policy's weights on CPU on rank 0 (None elsewhere); every rank must call."""
        from torch.distributed.tensor import DTensor

        full = {}
        for key, value in self.model.state_dict().items():
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if self.rank == 0:
                full[key] = value.detach().cpu()
        return full if self.rank == 0 else None

    def optimizer_state_dict(self) -> dict | None:
        """The optimizer state gathered on rank 0, keyed by parameter name (None elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return state if self.rank == 0 else None

    def last_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def close(self, end_group: bool = True) -> None:
        """Release the process's part of the group (and leave the process group, unless
        `end_group` is False: another learner of this process goes on using it)."""
        if end_group and dist.is_initialized():
            dist.destroy_process_group()


def merge_metrics(parts: list[tuple[dict[str, float], float, float]]) -> dict[str, float]:
    """The group's `actor/...` metrics from each process's (metrics, tokens, mean loss share).

    Token-weighted means (entropy, PPO KL, clip fractions, ratio mean: exact); the mini-batch
    losses (`actor/pg_loss`, `actor/ref_kl`) as the share-weighted sum (exact when a process's
    share is the same in every mini-batch, else close); min / max for the ratio extremes; the
    gradient norm and skip count as every process saw them (they are the group's)."""
    total = sum(tokens for _, tokens, _ in parts) or 1.0
    out: dict[str, float] = {}
    for key in parts[0][0]:
        values = [m[key] for m, _, _ in parts]
        if key == "actor/ratio_min":
            out[key] = min(values)
        elif key == "actor/ratio_max":
            out[key] = max(values)
        elif key == "actor/skipped_steps":
            out[key] = max(values)
        elif key == "actor/grad_norm":
            out[key] = values[0]
        elif key in ("actor/pg_loss", "actor/ref_kl"):
            out[key] = sum(v * share for v, (_, _, share) in zip(values, parts))
        else:
            out[key] = sum(v * tokens for v, (_, tokens, _) in zip(values, parts)) / total
    return out


def learner_class(cfg: Config) -> type[GroupLearner]:
    """The class of one training-group process for `trainer.strategy`: `GroupLearner` (FSDP2)
    or `mmrl.distributed.deepspeed_group.DeepSpeedLearner` (DeepSpeed ZeRO)."""
    if cfg.trainer.strategy == "deepspeed":
        from mmrl.distributed.deepspeed_group import DeepSpeedLearner

        return DeepSpeedLearner
    return GroupLearner

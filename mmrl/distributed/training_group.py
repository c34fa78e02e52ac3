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
clipping sees the global norm (DTensor). Tested: 3 updates of a 2-process gloo group equal the
1-process trainer's at every step (`tests/test_distributed_multistep.py`).

LoRA (`model.lora_rank > 0`): every process wraps the policy with the same adapters (drawn
from `trainer.seed`, or set by `load_state`), shards base and adapters alike and trains the
adapters only; the KL reference is the base with the adapters disabled, as in a local run.

Limits (checked in `Config.__post_init__`): `ppo_epochs=1` (later epochs shuffle rows within
a process), an entropy bonus only with `loss_agg=token_mean` (its normaliser is a token count),
no DAPO dynamic sampling (rows must split evenly). A non-finite loss in one process skips its
micro-batches but not the others': the group would stop in a collective.

`trainer.strategy=deepspeed` swaps FSDP2 for DeepSpeed ZeRO in the same class's place
(`mmrl.distributed.learners.learner_class`; `mmrl.distributed.deepspeed_group.DeepSpeedLearner`):
the same rows, shares and update, DeepSpeed's engine, optimizer and clipping.

Launch: one `GroupLearner` per process, each told its rank, the world size and a rendezvous
(`init_method`): Ray actors (`mmrl.distributed.ray_backend`), or any launcher such as
`torchrun` (`GroupLearner.from_env` reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from mmrl.algos.losses import loss_denominator
from mmrl.config import Config
from mmrl.models.adapters import apply_lora, freeze_parts, is_lora, param_groups
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
            out = tuple(
                None if x is None else _ScaleGrad.apply(x, share) for x in out
            )  # (no critic: no values)
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
        if cfg.model.lora_rank > 0:  # the same adapters in every process: drawn from the same seed
            torch.manual_seed(cfg.trainer.seed)
            policy.model = apply_lora(policy.model, cfg)
        freeze_parts(policy.model, cfg)
        self._shard(policy, dtype)
        self._wrapped = ShareOfGlobalLoss(self.model)
        # `update` runs `update_policy` on one mini-batch at a time.
        self._one_minibatch = dataclasses.replace(
            cfg, trainer=dataclasses.replace(cfg.trainer, mini_batches=1)
        )

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
        if cfg.algo.kl_coef > 0 and is_lora(model):
            reference = "adapters_disabled"  # the base model: nothing to copy
        elif cfg.algo.kl_coef > 0:
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
    ) -> list[tuple[dict[str, float], float, float]]:
        """`update_policy` on this process's rows of the whole batch (all tensors are the whole
        batch's: advantages [N], the rest [N, R]), one mini-batch at a time (one optimizer step
        each, as `update_policy` takes them), then one scheduler step. Returns, per mini-batch,
        its metrics, its token count and its loss share (for `merge_metrics`, which then gives
        the group's losses exactly: each mini-batch's is the share-weighted sum of the
        processes')."""
        rows = self.rows(len(batch))
        M, dev = self.cfg.trainer.mini_batches, self.device
        shares = loss_shares(self.cfg, batch.response_mask, rows)  # per forward, mini-batch by mini-batch
        scale = self.world_size if self.averages_gradients else 1
        policy = Policy(self._wrapped, self.policy.processor, self.policy.blocked,
                        self.policy.stop_token_ids, self.policy.pad_token_id, self.precision)  # fmt: skip
        share, forwards = len(rows) // M, len(shares) // M
        parts = []
        for j in range(M):
            mb = rows[j * share : (j + 1) * share]
            mb_shares = shares[j * forwards : (j + 1) * forwards]
            self._wrapped.shares = deque(x * scale for x in mb_shares)
            local = select_rows(batch, mb).to(dev)

            def mine(x: torch.Tensor | None, mb=mb) -> torch.Tensor | None:
                return None if x is None else x[mb].to(dev)

            metrics = update_policy(
                self._one_minibatch, policy, self.optimizer, local, mine(advantages), mine(old_logprobs),
                mine(ref_logprobs), mine(weights),
            )  # fmt: skip
            if self._wrapped.shares:
                raise RuntimeError(f"{len(self._wrapped.shares)} planned gradient passes did not run")
            parts.append((metrics, float(local.response_mask.sum()), mb_shares[0]))
        self.scheduler.step()
        return parts

    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The policy's weights on CPU on rank 0 (None elsewhere), gathered a tensor at a time;
        every rank must call. `trainable_only`: the trained parameters only (LoRA: the adapters)."""
        from torch.distributed.tensor import DTensor

        keep = self.trainable_names() if trainable_only else None
        full = {}
        for key, value in self.model.state_dict().items():
            if keep is not None and key not in keep:
                continue
            value = value.full_tensor() if isinstance(value, DTensor) else value
            if self.rank == 0:
                full[key] = value.detach().to("cpu", copy=True)  # never a view of the live weights
        return full if self.rank == 0 else None

    def trainable_names(self) -> set[str]:
        """Names (as in the state dict) of the parameters the optimizer steps."""
        return {name for name, p in self.model.named_parameters() if p.requires_grad}

    def load_state(self, weights: dict[str, torch.Tensor], optimizer: dict | None, steps: int) -> None:
        """Resume (every rank, each with the whole state): `weights` of every trained parameter
        (a checkpoint's, by name; more keys are ignored), the optimizer state as
        `optimizer_state_dict` returned it (None: fresh), and `steps` scheduler steps taken."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        from torch.distributed.tensor import DTensor, distribute_tensor

        missing = sorted(self.trainable_names() - weights.keys())
        if missing:
            raise KeyError(f"the state to load lacks trained parameters {missing[:5]}")
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if not p.requires_grad:
                    continue
                full = weights[name].to(device=p.device, dtype=p.dtype)
                if isinstance(p, DTensor):  # this rank's shard of the whole tensor, no communication
                    full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
                    p.to_local().copy_(full.to_local())
                else:
                    p.copy_(full)
        if optimizer is not None:
            options = StateDictOptions(full_state_dict=True)
            set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=options)
        self._set_schedule(steps)

    def _set_schedule(self, steps: int) -> None:
        """The learning-rate schedule as after `steps` scheduler steps (and the groups' rates)."""
        sched = self.scheduler
        sched.last_epoch = steps
        lrs = [base * fn(steps) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
        for group, lr in zip(sched.optimizer.param_groups, lrs):
            group["lr"] = lr
        sched._last_lr = lrs

    def save_sharded(self, folder: str) -> None:
        """This process's shards of the trained weights and optimizer state into `folder` (every
        rank calls; `mmrl.train.sharded`): nothing is gathered."""
        from mmrl.train.sharded import save_sharded

        save_sharded(self.model, self.optimizer, folder)

    _writing = None  # the future of a sharded save in the background (`start_sharded_save`)
    _checkpoint_group = None  # the gloo group those saves run their collectives on

    def start_sharded_save(self, folder: str) -> None:
        """`save_sharded` in the background (every rank calls): this process's shards are
        copied now and written by a thread, whose collectives run on a gloo group of their own
        (made at the first save, by every rank), never on the training group's. Poll
        `sharded_save_done`; a save starts only after the one before it is complete."""
        from mmrl.train.sharded import start_save_sharded

        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        if self._writing is not None:
            self._writing.result()
        self._writing = start_save_sharded(self.model, self.optimizer, folder, self._checkpoint_group)

    def sharded_save_done(self) -> bool:
        """Whether this process's last background save is written (raises its error)."""
        if self._writing is None:
            return True
        if not self._writing.done():
            return False
        writing, self._writing = self._writing, None
        writing.result()
        return True

    def load_sharded(self, folder: str, steps: int) -> None:
        """Resume from a sharded checkpoint written by any number of processes (every rank calls;
        each reads its own shards), and the schedule as after `steps` scheduler steps."""
        from mmrl.train.sharded import load_sharded

        load_sharded(self.model, self.optimizer, folder)
        self._set_schedule(steps)

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


def merge_metrics(parts: list[list[tuple[dict[str, float], float, float]]]) -> dict[str, float]:
    """The group's `actor/...` metrics from `parts[r][j]`: process r's (metrics, tokens, loss
    share) of mini-batch j, as `GroupLearner.update` returns them.

    Per mini-batch: the losses (`actor/pg_loss`, `actor/ref_kl`) as the share-weighted sum of
    the processes' (the mini-batch's own loss, exactly); token-weighted means (entropy, PPO KL,
    clip fractions, ratio mean); min / max for the ratio extremes; the gradient norm as every
    process saw it (the group's); skips counted once. Then over the mini-batches as
    `update_policy` combines them: the mean loss, token-weighted means, the mean gradient norm
    of the steps taken, the number of skipped steps."""
    losses = ("actor/pg_loss", "actor/ref_kl")
    per_mb: list[tuple[dict[str, float], float]] = []
    for j in range(len(parts[0])):
        procs = [p[j] for p in parts]
        tokens = sum(t for _, t, _ in procs)
        out: dict[str, float] = {}
        for key in procs[0][0]:
            values = [m[key] for m, _, _ in procs]
            if key == "actor/ratio_min":
                out[key] = min(values)
            elif key in ("actor/ratio_max", "actor/skipped_steps"):
                out[key] = max(values)
            elif key == "actor/grad_norm":
                out[key] = values[0]
            elif key in losses:
                out[key] = sum(v * share for v, (_, _, share) in zip(values, procs))
            else:
                out[key] = sum(v * t for v, (_, t, _) in zip(values, procs)) / (tokens or 1.0)
        per_mb.append((out, tokens))
    total = sum(t for _, t in per_mb) or 1.0
    merged: dict[str, float] = {}
    for key in per_mb[0][0]:
        values = [m[key] for m, _ in per_mb]
        if key == "actor/ratio_min":
            merged[key] = min(values)
        elif key == "actor/ratio_max":
            merged[key] = max(values)
        elif key == "actor/skipped_steps":
            merged[key] = sum(values)
        elif key == "actor/grad_norm":
            taken = [v for v in values if math.isfinite(v)]
            merged[key] = sum(taken) / len(taken) if taken else float("nan")
        elif key in losses:
            merged[key] = sum(values) / len(values)
        else:
            merged[key] = sum(v * t for v, (_, t) in zip(values, per_mb)) / total
    return merged

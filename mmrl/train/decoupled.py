"""Decoupled RL on an autoregressive planner + diffusion decoder (`mmrl train --task text_to_image_decoupled`).

The generator (`mmrl.models.planner`): a causal LM reads the request and writes a plan, the
decoder's prompt; a text-to-image pipeline renders the plan. GLM-Image post-trains such a
generator with *decoupled* RL: GRPO on the autoregressive half with low-frequency rewards (is the
picture semantically what was asked?) and flow-GRPO on the decoder with high-frequency ones (is
it a crisp rendering of what it was told?). One step (`decoupled_step`), the rollout shared:

  1. take B requests; the planner samples G plans each (temperature, seeded)
  2. the decoder renders K images per plan with the SDE sampler (`sample.group_size` = K, one
     initial noise per plan with `same_latent`): B x G x K images
  3. decoder rewards (`reward.*`) score each image against *its plan*; a plan a reward cannot
     read (outside its grammar, `RewardModel.accepts_prompt`) gets NaN there, and its images
     stay out of the decoder's update and statistics; flow-GRPO advantages over the
     K images of each plan: the decoder learns to render whatever it is given, and is not
     blamed for a wrong plan
  4. planner rewards (`planner.rewards.*`) score each image against the request's target;
     a plan's reward is the mean over its K images; GRPO-family advantages over the G plans of
     each request: the planner learns what to ask for, averaged over how the decoder renders it
  5. updates: the planner with its policy loss (`planner.loss`, PPO-clip by default) on the plan
     tokens, the decoder with flow-GRPO's clipped per-step loss (`mmrl.train.flow_grpo`), each
     with its own optimizer; `train_halves` can leave either half frozen (ablations)
  6. metrics per half (`planner/*`, `decoder/*`); every `eval_every` steps an evaluation on the
     held-out requests: greedy plans, the ODE decoder with the EMA weights, one image each with
     a fixed seed; `eval/geneval/accuracy` is the end-to-end strict accuracy against the
     request's target, `eval/planner/plan_accuracy` how often the plan is exactly the target,
     `eval/decoder/accuracy` how often the image is right for the plan it was given; the grid
     is saved with a JSON of each cell's request, plan and verdict.

Checkpoints hold both halves (weights, EMA, both optimizers) and resume exactly, as flow-GRPO's.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from mmrl.models.planner import PlanBatch, Planner, builtin_planner, load_planner, plan_accuracy
from mmrl.progress import ProgressBar
from mmrl.train.flow_checkpoint import (
    FlowProgress,
    _Weights,
    check_config_unchanged,
    find_flow_checkpoint,
    remove_stale_temporaries,
    restore_flow_checkpoint,
    write_flow_checkpoint,
)
from mmrl.train.flow_config import DecoupledConfig, flow_config_dict
from mmrl.train.flow_grpo import (
    FlowTrainee,
    FlowTrainResult,
    PromptOrder,
    _nothing,
    choose_trained_steps,
    compute_advantages,
    create_run_dir,
    describe_eval,
    eval_figures,
    flow_model_path,
    flow_precision,
    holding_the_run_dir,
    make_flow_trainee,
    recompute_log_probs,
    rollout,
    save_grid,
    save_pipeline,
    score_columns,
    seed_everything,
    update_policy,
)
from mmrl.train.metrics_log import check_trackers_installed, open_metrics_log
from mmrl.train.plots import plot_flow_curves

log = logging.getLogger(__name__)

PLANNER_WEIGHTS = "planner.safetensors"


@dataclass
class RequestSet:
    """Requests, what each means (the planner rewards' prompt), optional reference images."""

    requests: list[str]
    targets: list[str]
    references: list[str | None]

    def take(self, idx: list[int]) -> RequestSet:
        return RequestSet(
            [self.requests[i] for i in idx], [self.targets[i] for i in idx], [self.references[i] for i in idx]
        )


@dataclass
class PlannerTrainee:
    """The autoregressive half being trained."""

    planner: Planner
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    rewards: list
    updates: int = 0


def load_requests(cfg: DecoupledConfig) -> tuple[RequestSet, RequestSet]:
    """(train, evaluation) requests: the built-in synonym requests (`trainer.eval_size` of the
    held-out ones), or `data.prompt_file` (JSONL; every line is trained on and the first
    `eval_size` evaluated). A bad line is an error naming the file, line and field."""
    from mmrl.datasets.paraphrase import paraphrase_requests

    if cfg.data.prompt_file is None:
        train = paraphrase_requests("train")
        held = paraphrase_requests("heldout", n=cfg.trainer.eval_size)
        to_set = lambda rs: RequestSet([r.request for r in rs], [r.target for r in rs], [None] * len(rs))  # noqa: E731
        return to_set(train), to_set(held)
    from mmrl.files import read_file

    path = Path(cfg.data.prompt_file)
    rows = []
    for number, line in enumerate(read_file(path).decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(row, dict) or not isinstance(row.get("request"), str) or not row["request"].strip():
            raise ValueError(f'{path}:{number}: field "request" must be a non-empty string')
        for key in ("target", "reference"):
            if key in row and row[key] is not None and not isinstance(row[key], str):
                raise ValueError(f'{path}:{number}: field "{key}" must be a string')
        ref = row.get("reference")
        if ref is not None and not Path(ref).is_absolute():
            ref = str(path.parent / ref)
        if ref is not None and not Path(ref).is_file():
            raise ValueError(f'{path}:{number}: field "reference": no such file {ref}')
        rows.append((row["request"], row.get("target") or row["request"], ref))
    if not rows:
        raise ValueError(f"{path}: no requests")
    train = RequestSet(*map(list, zip(*rows)))
    return train, train.take([i % len(rows) for i in range(cfg.trainer.eval_size)])


def make_planner(cfg: DecoupledConfig, device: torch.device) -> Planner:
    p = cfg.planner
    path = p.path or builtin_planner(p.tiny, p.warmup, cfg.model.cache_dir)
    precision = flow_precision(cfg)
    planner = load_planner(
        path,
        template=p.template,
        instruction=p.instruction,
        max_new_tokens=p.max_new_tokens,
        revision=p.revision,
    )
    # the planner's weights are kept in the master dtype (float32 by default) and its forward
    # runs under autocast in the compute dtype, as the decoder's transformer does
    planner.model.to(device=device, dtype=precision.master)
    planner.autocast = precision.context
    return planner


def make_planner_trainee(cfg: DecoupledConfig, planner: Planner, device: torch.device) -> PlannerTrainee:
    from mmrl.rewards import get_reward_model, reward_model_names

    p = cfg.planner
    train = "planner" in cfg.train_halves
    planner.model.requires_grad_(train)
    params = [q for q in planner.model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(
        params or [torch.nn.Parameter(torch.zeros(1))], lr=p.lr, weight_decay=p.weight_decay
    )
    known = reward_model_names()
    rewards = []
    for name in p.rewards.names:
        if name not in known:
            raise ValueError(f"planner.rewards.names: unknown reward {name!r} (known: {', '.join(known)})")
        kwargs = {"device": str(device), **dict(p.rewards.kwargs.get(name, {}) or {})}
        rewards.append(get_reward_model(name, **kwargs))
    return PlannerTrainee(planner, params, optimizer, rewards)


def _fields(refs: list[str | None]) -> dict:
    """`references=[...]` for the rewards when the requests have them."""
    return {"references": refs} if any(r is not None for r in refs) else {}


def score_decoder(
    cfg: DecoupledConfig, t: FlowTrainee, images: torch.Tensor, plans: list[str], refs: list[str | None]
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """[N, K] decoder rewards of each image against its plan (NaN for plans a reward cannot read),
    their metrics (`decoder/reward/*`) and the [N] mask of images whose plan every reward reads."""
    readable = torch.tensor([all(m.accepts_prompt(p) for m in t.rewards) for p in plans])
    scores = torch.full((len(plans), len(t.rewards)), float("nan"))
    metrics: dict[str, float] = {"decoder/plan_readable": float(readable.float().mean())}
    rows = readable.nonzero().flatten().tolist()
    if rows:
        r = cfg.reward
        part, m = score_columns(
            r.names, t.rewards, r.weights, r.on_error, images[rows], [plans[i] for i in rows],
            prefix="decoder/reward", **_fields([refs[i] for i in rows]),
        )  # fmt: skip
        scores[rows] = part
        metrics.update(m)
    return scores, metrics, readable


def score_planner(
    pt: PlannerTrainee,
    cfg: DecoupledConfig,
    images: torch.Tensor,
    targets: list[str],
    refs: list[str | None],
    K: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """[N / K] planner rewards: each image scored against its request's target, averaged over the
    K images of its plan (a failed score counts 0), and their metrics (`planner/reward/*`)."""
    r = cfg.planner.rewards
    scores, metrics = score_columns(
        r.names, pt.rewards, r.weights, "zero", images, targets, prefix="planner/reward", **_fields(refs)
    )
    total = scores.nan_to_num(nan=0.0) @ torch.tensor(list(r.weights), dtype=torch.float32)
    return total.view(-1, K).mean(dim=1), metrics


@torch.no_grad()
def planner_old_logprobs(cfg: DecoupledConfig, pt: PlannerTrainee, batch: PlanBatch) -> torch.Tensor:
    """[N, R] log-probs of the sampled plans under the weights that sampled them, recomputed in
    the update's mini-batch shapes (so the first ratio is exactly 1)."""
    n = len(batch)
    size = n // cfg.planner.mini_batches
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=batch.response_ids.device)
    for start in range(0, n, size):
        rows = list(range(start, start + size))
        lp, _ = pt.planner.logprobs(batch, rows, cfg.planner.temperature)
        out[rows] = lp.float()
    return out


def update_planner(
    cfg: DecoupledConfig, pt: PlannerTrainee, batch: PlanBatch, advantages: torch.Tensor, gen: torch.Generator
) -> dict[str, float]:
    """`inner_epochs` passes of `mini_batches` AdamW steps of the planner's policy loss."""
    from mmrl.algos.losses import get_policy_loss

    p = cfg.planner
    loss_fn = get_policy_loss(p.loss)
    n = len(batch)
    size = n // p.mini_batches
    device = batch.response_ids.device
    advantages = advantages.to(device)
    sums: dict[str, list[float]] = defaultdict(list)
    pt.planner.model.train()
    for _ in range(p.inner_epochs):
        order = torch.randperm(n, generator=gen).tolist()
        for start in range(0, n, size):
            rows = order[start : start + size]
            lp, entropy = pt.planner.logprobs(batch, rows, p.temperature)
            mask = batch.response_mask[rows].float()
            loss, m = loss_fn(
                lp.float(), batch.old_logprobs[rows], advantages[rows], mask,
                clip_low=p.clip_low, clip_high=p.clip_high, agg=p.agg,
            )  # fmt: skip
            pt.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            clip = p.grad_clip if p.grad_clip > 0 else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(pt.params, clip)
            if torch.isfinite(grad_norm):
                pt.optimizer.step()
                pt.updates += 1
            else:
                sums["planner/skipped_steps"].append(1.0)
                log.warning("planner: non-finite gradient norm: optimizer step skipped")
            pt.optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                denom = mask.sum().clamp(min=1)
                sums["planner/policy_loss"].append(loss.item())
                sums["planner/grad_norm"].append(float(grad_norm))
                sums["planner/entropy"].append(float((entropy.detach() * mask).sum() / denom))
                log_ratio = (lp.detach().float() - batch.old_logprobs[rows]) * mask
                sums["planner/approx_kl"].append(float(0.5 * log_ratio.square().sum() / denom))
                for key, value in m.items():
                    sums[f"planner/{key}"].append(float(value))
    pt.planner.model.eval()
    return {k: sum(v) / len(v) for k, v in sums.items()}


def decoupled_step(
    cfg: DecoupledConfig, t: FlowTrainee, pt: PlannerTrainee, reqs: RequestSet, step: int
) -> dict[str, float]:
    """One decoupled step on B requests (B x G plans, B x G x K images); returns its metrics."""
    G, K = cfg.planner.group_size, cfg.sample.group_size
    gen = torch.Generator().manual_seed(cfg.trainer.seed * 1_000_003 + step)
    t0 = time.monotonic()
    # 1. Plans: G per request.
    batch = pt.planner.sample(reqs.requests, G, cfg.planner.temperature, gen)
    plan_rows = [i for i in range(len(reqs.requests)) for _ in range(G)]
    targets_per_plan = [reqs.targets[i] for i in plan_rows]
    t1 = time.monotonic()
    # 2. Images: K per plan, with the SDE log-probs of the decoder's steps.
    traj = rollout(cfg, t, batch.texts, gen)
    image_rows = [j for j in range(len(batch)) for _ in range(K)]
    plans = [batch.texts[j] for j in image_rows]
    targets = [targets_per_plan[j] for j in image_rows]
    refs = [reqs.references[plan_rows[j]] for j in image_rows]
    t2 = time.monotonic()
    # 3.-4. Rewards, routed: the decoder's against the plan, the planner's against the target.
    dec_scores, metrics, readable = score_decoder(cfg, t, traj.images, plans, refs)
    plan_reward, planner_metrics = score_planner(pt, cfg, traj.images, targets, refs, K)
    metrics.update(planner_metrics)
    t3 = time.monotonic()
    # 5. Updates.
    if "decoder" in cfg.train_halves and bool(readable.any()):
        # images of an unreadable plan stay out of the decoder's statistics whatever
        # `reward.on_error` says: they were not scored, not scored 0
        dec_adv = compute_advantages(cfg, dec_scores, keep=readable)
        trained = choose_trained_steps(traj.sde_steps, cfg.algo.timestep_fraction, gen)
        old = (
            traj.log_probs
            if cfg.algo.old_logprobs == "rollout"
            else recompute_log_probs(cfg, t, traj, trained)
        )
        dec_metrics = update_policy(cfg, t, traj, dec_adv, old, trained, gen)
        metrics.update({f"decoder/{k.removeprefix('actor/')}": v for k, v in dec_metrics.items()})
        metrics["decoder/adv_abs_mean"] = float(dec_adv.abs().mean())
    if "planner" in cfg.train_halves:
        from mmrl.algos.advantages import TOKEN_WEIGHTED, get_advantage_estimator

        extra = {}
        if cfg.planner.advantage in TOKEN_WEIGHTED:
            extra["token_counts"] = batch.response_mask.sum(1).float().cpu()
        plan_adv = get_advantage_estimator(cfg.planner.advantage)(plan_reward, G, **extra)
        batch.old_logprobs = planner_old_logprobs(cfg, pt, batch)
        metrics.update(update_planner(cfg, pt, batch, plan_adv, gen))
        metrics["planner/adv_abs_mean"] = float(plan_adv.abs().mean())
    t4 = time.monotonic()
    grouped = plan_reward.view(-1, G)
    metrics.update(
        {
            "planner/reward/plan_mean": float(plan_reward.mean()),
            "planner/reward/zero_std_frac": float((grouped.std(dim=1) == 0).float().mean()),
            "planner/plan_accuracy": plan_accuracy(batch.texts, targets_per_plan),
            "planner/response_length": float(batch.response_mask.sum(1).float().mean()),
            "planner/distinct_plans": float(len(set(batch.texts)) / len(batch)),
            "time/plan_s": t1 - t0,
            "time/render_s": t2 - t1,
            "time/reward_s": t3 - t2,
            "time/update_s": t4 - t3,
            "time/step_s": t4 - t0,
        }
    )
    return metrics


def verdicts(images: torch.Tensor, prompts: list[str]) -> list[bool]:
    """GenEval's strict verdict of each image for its (GenEval-style) prompt."""
    from mmrl.datasets.geneval import parse_prompt
    from mmrl.rewards.base import as_pil_images
    from mmrl.verifiers.geneval import analyse, check_spec

    return [
        bool(check_spec(parse_prompt(p), analyse(im))["correct"])
        for im, p in zip(as_pil_images(images), prompts)
    ]


DECOUPLED_PANELS = [
    ("planner reward", ["planner/reward/plan_mean", "eval/planner/reward/mean"]),
    ("decoder reward", ["decoder/reward/mean", "eval/decoder/reward/mean"]),
    ("held-out accuracy", ["eval/geneval/accuracy", "eval/planner/plan_accuracy", "eval/decoder/accuracy"]),
    ("planner entropy, KL", ["planner/entropy", "planner/approx_kl"]),
    ("grad norm", ["planner/grad_norm", "decoder/grad_norm"]),
]


@torch.no_grad()
def evaluate_decoupled(
    cfg: DecoupledConfig, t: FlowTrainee, pt: PlannerTrainee, reqs: RequestSet
) -> tuple[dict[str, float], torch.Tensor, list[dict]]:
    """Greedy plans, the ODE decoder (EMA weights, fixed seed), one image per request."""
    from mmrl.train.flow_grpo import geneval_style

    s = cfg.sample
    plans = pt.planner.sample(reqs.requests, 1, greedy=True).texts
    t.transformer.eval()
    gen = torch.Generator().manual_seed(cfg.trainer.seed + 12345)
    with t.ema.applied() if t.ema is not None else _nothing():
        traj = t.sampler.sample(
            list(plans), num_steps=s.eval_num_steps, height=s.resolution, width=s.resolution,
            guidance_scale=s.eval_guidance_scale if s.eval_guidance_scale is not None else s.guidance_scale,
            generator=gen, sde_steps=(), negative_prompt=s.negative_prompt,
        )  # fmt: skip
    dec_scores, metrics, readable = score_decoder(cfg, t, traj.images, plans, reqs.references)
    plan_reward, planner_metrics = score_planner(pt, cfg, traj.images, reqs.targets, reqs.references, 1)
    metrics.update(planner_metrics)
    metrics["planner/plan_accuracy"] = plan_accuracy(plans, reqs.targets)
    metrics["planner/reward/plan_mean"] = float(plan_reward.mean())
    cells = [{"request": r, "plan": p, "target": g} for r, p, g in zip(reqs.requests, plans, reqs.targets)]
    if geneval_style(reqs.targets):
        from mmrl.verifiers.geneval import prompt_following

        metrics.update({f"geneval/{k}": v for k, v in prompt_following(traj.images, reqs.targets).items()})
        right = verdicts(traj.images, reqs.targets)
        # the verdict against the plan needs a plan in the grammar (the decoder's rewards may
        # read other plans: a perceptual reward reads any)
        readable_rows = [i for i in readable.nonzero().flatten().tolist() if geneval_style([plans[i]])]
        rendered = (
            verdicts(traj.images[readable_rows], [plans[i] for i in readable_rows]) if readable_rows else []
        )
        metrics["decoder/accuracy"] = sum(rendered) / len(plans)
        for cell, ok in zip(cells, right):
            cell["correct"] = bool(ok)
    return {f"eval/{k}": v for k, v in metrics.items()}, traj.images, cells


# --- checkpoints ---------------------------------------------------------------------------------
class _BothHalves(_Weights):
    """The decoder's trained weights and EMA (`_Weights`), plus the planner's weights."""

    def __init__(self, t: FlowTrainee, pt: PlannerTrainee):
        super().__init__(t)
        self.pt = pt

    def save_pretrained(self, folder: Path) -> None:
        from safetensors.torch import save_file

        super().save_pretrained(folder)
        state = {k: v.detach().cpu().contiguous() for k, v in self.pt.planner.model.state_dict().items()}
        save_file(_untied(state), Path(folder) / PLANNER_WEIGHTS)


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share memory (tied embeddings): keep one copy each."""
    seen: dict[int, str] = {}
    out = {}
    for k, v in state.items():
        ptr = v.data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.setdefault(ptr, k)
    return out


def write_decoupled_checkpoint(
    cfg: DecoupledConfig,
    t: FlowTrainee,
    pt: PlannerTrainee,
    order: PromptOrder,
    progress: FlowProgress,
    run_dir: Path,
) -> Path:
    """flow-GRPO's checkpoint (`write_flow_checkpoint`: same atomic write, manifest and
    retention) with the planner's weights and optimizer added."""
    extra = {"planner_optimizer": pt.optimizer.state_dict(), "planner_updates": pt.updates}
    return write_flow_checkpoint(
        cfg, t, order, progress, run_dir, weights=_BothHalves(t, pt), extra_state=extra
    )


def restore_decoupled_checkpoint(
    path: Path, t: FlowTrainee, pt: PlannerTrainee, order: PromptOrder, progress: FlowProgress
) -> None:
    """The decoder's state, prompt order, counters and RNG (`restore_flow_checkpoint`), then the
    planner's weights and optimizer."""
    from safetensors.torch import load_file

    from mmrl.train.checkpoint import load_trainer_state

    restore_flow_checkpoint(path, t, order, progress)
    weights = load_file(path / "model" / PLANNER_WEIGHTS)
    missing, unexpected = pt.planner.model.load_state_dict(weights, strict=False)
    if unexpected or [k for k in missing if k not in weights and "lm_head" not in k]:
        raise ValueError(
            f"{path / 'model' / PLANNER_WEIGHTS}: does not match the planner (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}): was it written with another planner config?"
        )
    state = load_trainer_state(path)
    pt.optimizer.load_state_dict(state["planner_optimizer"])
    pt.updates = state["planner_updates"]


# --- the run ---------------------------------------------------------------------------------------
def run_decoupled(cfg: DecoupledConfig) -> FlowTrainResult:
    """`mmrl train --task text_to_image_decoupled`: train both halves, evaluate, save."""
    return holding_the_run_dir(cfg, _run_decoupled)


def _run_decoupled(cfg: DecoupledConfig) -> FlowTrainResult:
    """`run_decoupled` while this process holds the run directory's lock."""
    from mmrl.train.grpo import StopRequest

    t_start = time.monotonic()
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    train_reqs, eval_reqs = load_requests(cfg)
    order = PromptOrder(list(range(len(train_reqs.requests))), cfg.trainer.seed)
    checkpoint = None
    if cfg.trainer.resume:
        remove_stale_temporaries(Path(cfg.trainer.run_dir))
        checkpoint = find_flow_checkpoint(cfg, Path(cfg.trainer.run_dir))
        if checkpoint is not None:
            check_config_unchanged(cfg, checkpoint)
    check_trackers_installed(cfg.trainer.loggers)
    run_dir = create_run_dir(cfg)
    (run_dir / "images").mkdir(exist_ok=True)

    # The two halves (the built-ins warmed up and cached on first use), seeded after both exist.
    from mmrl.models.tiny_diffusion import load_flow_pipeline

    precision = flow_precision(cfg)
    model_path = flow_model_path(cfg, precision.device)
    planner = make_planner(cfg, precision.device)
    pipe = load_flow_pipeline(model_path, precision.compute, revision=cfg.model.revision)
    seed_everything(cfg.trainer.seed)
    t = make_flow_trainee(cfg, pipe)
    if "decoder" not in cfg.train_halves:
        t.transformer.requires_grad_(False)
    pt = make_planner_trainee(cfg, planner, precision.device)
    progress = FlowProgress()
    if checkpoint is not None:
        restore_decoupled_checkpoint(checkpoint, t, pt, order, progress)
        log.info("resumed from %s at step %d", checkpoint, progress.step)
    keep_until = progress.step if checkpoint is not None else (-1 if cfg.trainer.resume else None)
    metrics_log = open_metrics_log(run_dir, cfg.trainer, flow_config_dict(cfg), resume_after=keep_until)
    total = cfg.trainer.total_steps

    def run_eval(step: int) -> float:
        metrics, images, cells = evaluate_decoupled(cfg, t, pt, eval_reqs)
        metrics_log.log(step, metrics)
        grid = save_grid(images, run_dir / "images" / f"eval_step_{step:05d}.png")
        (run_dir / "images" / f"eval_step_{step:05d}.json").write_text(json.dumps(cells, indent=1))
        metrics_log.log_image("eval/images", grid, step)
        figures = eval_figures(metrics)
        log.info(
            "step %d: planner reward %.4f, plan accuracy %.3f, decoder reward %.4f%s",
            step, metrics["eval/planner/reward/mean"], metrics["eval/planner/plan_accuracy"],
            metrics.get("eval/decoder/reward/mean", float("nan")),
            "" if figures is None else "; " + describe_eval(figures),
        )  # fmt: skip
        if step == 0:
            progress.start_accuracy = metrics.get("eval/geneval/accuracy")
            progress.start_eval = figures
        progress.final_accuracy = metrics.get("eval/geneval/accuracy")
        progress.final_eval = figures
        return metrics["eval/planner/reward/mean"]

    stop = StopRequest()
    p = progress
    with metrics_log:
        with stop.installed():
            if checkpoint is None:
                p.start_reward = p.best_reward = p.final_reward = run_eval(0)
            bar = ProgressBar(
                range(p.step + 1, total + 1), desc="decoupled", disable=not cfg.trainer.progress
            )
            for step in bar:
                reqs = train_reqs.take(order.next(cfg.trainer.prompts_per_step))
                metrics = decoupled_step(cfg, t, pt, reqs, step)
                metrics_log.log(step, metrics)
                p.step = step
                bar.set_postfix(
                    plan=f"{metrics['planner/reward/plan_mean']:.3f}", eval=f"{p.final_reward:.3f}"
                )
                if (cfg.trainer.eval_every and step % cfg.trainer.eval_every == 0) or step == total:
                    p.final_reward = run_eval(step)
                    p.best_reward = max(p.best_reward, p.final_reward)
                every = cfg.trainer.checkpoint_every
                if (every and step % every == 0) or step == total or stop.requested:
                    write_decoupled_checkpoint(cfg, t, pt, order, p, run_dir)
                if stop.requested:
                    log.warning("stopping at step %d on %s; checkpoint written", step, stop.signal_name)
                    break
            bar.close()
        if cfg.trainer.save_final and not stop.requested:
            save_pipeline(cfg, t, run_dir / "final" / "decoder")
            pt.planner.save(run_dir / "final" / "planner")
        plot_flow_curves(run_dir / "metrics.jsonl", run_dir / "training_curves.png", DECOUPLED_PANELS)
        metrics_log.log_image("plots/training_curves", run_dir / "training_curves.png", p.step)
        metrics_log.status = "interrupted" if stop.requested else "finished"
    result = FlowTrainResult(
        run_dir, p.start_reward, p.final_reward, p.best_reward, p.step, time.monotonic() - t_start,
        interrupted=stop.requested, start_accuracy=p.start_accuracy, final_accuracy=p.final_accuracy,
        start_eval=p.start_eval, final_eval=p.final_eval,
    )  # fmt: skip
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in result.__dict__.items()}
    summary["model_path"] = str(model_path)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return result

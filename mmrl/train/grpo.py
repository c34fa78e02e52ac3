"""GRPO-family RL on a vision-language model: the whole training loop, top to bottom.

One step (`grpo_step`):
  a. take B prompts; the rollout engine samples G responses each (token ids + log-probs); each
     response goes to the verifier its sample names the moment it is finished
     (with DAPO dynamic sampling: drop groups whose rewards are all equal, draw more prompts)
  b. reward shaping: DAPO's overlong punishment; masking of truncated responses
  c. log-probs of the sampling policy ("old") and of the reference (a frozen copy, or the LoRA
     base model); with `algo.kl_in_reward` the KL goes into the reward here
  d. advantages within each prompt's group (GRPO, Dr.GRPO, RLOO, REINFORCE++, GDPO, OPO,
     pass@k, GPG; ReMax against a greedy response per prompt, `mmrl/train/baselines.py`)
  e. truncated importance sampling weights for rollout/trainer mismatch
  f. the policy update (`mmrl/train/update.py`): mini-batches, PPO / GSPO / CISPO loss
  g. metrics overall and per data source; optional step dump
The loop (`train`) adds greedy held-out evaluation every `eval_every` steps, the run directory
and the final checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmrl.algos.advantages import (
    GROUP_LOCAL,
    NEEDS_BASELINE,
    TOKEN_WEIGHTED,
    clip_advantages,
    get_advantage_estimator,
)
from mmrl.algos.dapo import informative_groups, overlong_penalty, truncation_mask
from mmrl.algos.kl import kl_estimate, kl_penalized_rewards
from mmrl.algos.stability import batch_normalize_weights, rejection_keep
from mmrl.algos.tis import tis_weights
from mmrl.config import CRITIC_ESTIMATORS, AgentConfig, Config, config_to_dict, config_to_yaml
from mmrl.models.adapters import apply_lora, freeze_parts, is_lora, merged_copy_for_saving, param_groups
from mmrl.models.base import builtin_base
from mmrl.models.loading import Policy, load_policy
from mmrl.models.precision import Precision, adamw, place, precision_from
from mmrl.models.saving import skip_unused_deepspeed_probe
from mmrl.progress import ProgressBar
from mmrl.rewards.catalog import build_reward_models
from mmrl.rewards.config import accelerator_device
from mmrl.rewards.placement import RewardPlacement
from mmrl.rollout.hf import HFRolloutEngine, SamplingParams, concat_rollouts
from mmrl.rollout.multiturn import (
    Interrupt,
    generate_trajectories,
    shape_results,
    tokenization_drift,
    trajectory_metrics,
)
from mmrl.router import RewardBatch, Router, model_reward_failed
from mmrl.routing import make_router
from mmrl.train.baselines import greedy_baselines
from mmrl.train.batching import select_rows
from mmrl.train.checkpoint import (
    PendingCheckpoint,
    apply_retention,
    find_resume_checkpoint,
    load_model_weights,
    load_trainer_state,
    set_rng_state,
    start_checkpoint,
    verify_checkpoint,
)
from mmrl.train.data import PromptSampler, cot_pool, load_data_report
from mmrl.train.dumps import write_step_dump
from mmrl.train.evaluation import EvaluationInterrupted, run_evaluation
from mmrl.train.forward import value_head_for
from mmrl.train.metrics_log import check_trackers_installed, open_metrics_log
from mmrl.train.plots import plot_training_curves
from mmrl.train.preflight import check_paths, plan_resume
from mmrl.train.rundir import create_run_dir, hold_run_dir, run_dir_path
from mmrl.train.schedule import schedule_factor
from mmrl.train.sharded import SHARDED, load_sharded, os_error_of, save_sharded, start_save_sharded
from mmrl.train.stability import StabilityState, mismatch_source_metrics
from mmrl.train.step_metrics import step_metrics
from mmrl.train.storage import storage_errors
from mmrl.train.update import (
    CriticTargets,
    critic_metrics,
    critic_targets,
    old_and_ref_logprobs,
    old_from_update,
    old_ref_and_values,
    row_advantages,
    update_policy,
)
from mmrl.types import RolloutBatch, VerifyContext
from mmrl.verifiers.limits import is_refusal

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    run_dir: Path
    start_accuracy: float
    """Greedy held-out accuracy of the starting policy."""
    final_accuracy: float
    """Greedy held-out accuracy of the final policy (the one saved), not the best evaluation."""
    best_accuracy: float
    """Best greedy held-out accuracy seen at any evaluation (reported, never substituted)."""
    steps: int
    seconds: float
    interrupted: bool = False
    start_interval: tuple[float, float] = (float("nan"), float("nan"))
    """95% interval of `start_accuracy` (`mmrl.stats.mean_interval` over the held-out prompts)."""
    final_interval: tuple[float, float] = (float("nan"), float("nan"))
    """95% interval of `final_accuracy`."""
    eval_size: int = 0
    """Held-out prompts of each evaluation."""
    tools: dict[str, float] = field(default_factory=dict)
    """Tool tasks: the tool-call rate of the first and last evaluations (`start_tool_call_rate`,
    `final_tool_call_rate`) and, with `trainer.eval_without_tools`, the accuracy with the tools
    switched off and its interval (`start_no_tools`, `..._low`, `..._high`, and `final_...`)."""

    def summary_line(self) -> str:
        """The line `mmrl train` ends with: both accuracies with their intervals and the size."""

        def figure(acc: float, interval: tuple[float, float]) -> str:
            return f"{acc:.3f} [{interval[0]:.3f}-{interval[1]:.3f}]"

        if math.isnan(self.start_accuracy):  # trainer.eval_at_start=false
            return (
                f"done in {self.seconds:.0f}s: greedy held-out accuracy {figure(self.final_accuracy, self.final_interval)}"
                f" ({self.eval_size} prompts, 95% interval; the start was not evaluated: trainer.eval_at_start=false);"
                f" run directory {self.run_dir}"
            )
        gain = 100 * (self.final_accuracy - self.start_accuracy)
        return (
            f"done in {self.seconds:.0f}s: greedy held-out accuracy {figure(self.start_accuracy, self.start_interval)}"
            f" -> {figure(self.final_accuracy, self.final_interval)} ({gain:+.1f} points; {self.eval_size} prompts "
            f"each, 95% intervals){self._tool_figures()}; run directory {self.run_dir}"
        )

    def _tool_figures(self) -> str:
        t = self.tools
        out = ""
        if "start_tool_call_rate" in t:
            out += f"; tool-call rate {t['start_tool_call_rate']:.3f} -> {t.get('final_tool_call_rate', float('nan')):.3f}"
        if "start_no_tools" in t:
            out += (
                f"; with the tools off {t['start_no_tools']:.3f} [{t['start_no_tools_low']:.3f}-"
                f"{t['start_no_tools_high']:.3f}] -> {t.get('final_no_tools', float('nan')):.3f} "
                f"[{t.get('final_no_tools_low', float('nan')):.3f}-{t.get('final_no_tools_high', float('nan')):.3f}]"
            )
        return out

    """Stopped early by SIGINT / SIGTERM (a checkpoint was written)."""


@dataclass
class Trainee:
    """What one GRPO step works on."""

    policy: Policy
    reference: torch.nn.Module | str | None
    """A frozen copy, "adapters_disabled" (the LoRA base model), or None (no KL)."""
    engine: HFRolloutEngine
    router: Router
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    run_dir: Path | None = None
    reward_models: RewardPlacement | None = None
    """Model-based rewards, placed beside the policy (None: the run configures none)."""
    stability: StabilityState = field(default_factory=StabilityState)
    """Adaptive entropy coefficient and reference resets, carried across steps."""
    value_head: torch.nn.Module | None = None
    """The critic (`algo.advantage` gae / turn_gae): a value head on the policy's last hidden
    state (`mmrl.train.forward.ValueHead`), in the optimizer's `critic` group; None otherwise."""
    sealing: PendingCheckpoint | None = None
    """A checkpoint being written in the background (`trainer.async_checkpoint`) whose Hugging
    Face weights are read from the live model: the update waits for them before changing it."""

    # The learner: the policy's log-probs and update. Here, in this process; a training group
    # across processes (`mmrl.distributed`) overrides these two.
    def old_and_ref_logprobs(
        self, cfg: Config, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [N, R] of the sampling policy ("old") and of the reference (step c)."""
        return old_and_ref_logprobs(cfg, self.policy, self.reference, batch, old_from_update(cfg))

    def old_ref_and_values(
        self, cfg: Config, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`old_and_ref_logprobs` plus the value head's values [N, R] of the rollout, from the
        same forward as the old log-probs (PPO with a critic)."""
        return old_ref_and_values(
            cfg, self.policy, self.reference, batch, old_from_update(cfg), self.value_head
        )

    def update_policy(
        self,
        cfg: Config,
        batch: RolloutBatch,
        advantages: torch.Tensor,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        weights: torch.Tensor | None,
        before_minibatch: Callable[[list[int]], None] | None = None,
        critic: CriticTargets | None = None,
    ) -> dict[str, float]:
        """The mini-batched policy update (step f); returns its `actor/...` metrics.
        `before_minibatch`: see `mmrl.train.update.update_policy` (only where
        `updates_while_scoring`); `critic`: the value loss's targets (PPO with a critic)."""
        return update_policy(
            cfg, self.policy, self.optimizer, batch, advantages, old_logprobs, ref_logprobs, weights,
            before_minibatch, reference=self.reference, old_from_first_pass=old_from_update(cfg), critic=critic,
        )  # fmt: skip

    updates_while_scoring = True
    """Whether `update_policy` takes `before_minibatch` (a remote training group does not)."""

    @property
    def shards_state(self) -> bool:
        """Whether checkpoints hold the trained weights and optimizer state as a sharded DCP
        checkpoint (`save_sharded`; resumable on another number of training processes), rather
        than the optimizer state in `trainer_state.pt`. Here: a plain torch optimizer over the
        policy's parameters alone (the critic's value head has its own group outside the model)."""
        return isinstance(self.optimizer, torch.optim.Optimizer) and self.value_head is None

    def save_sharded(self, folder: Path, background: bool = False) -> Callable[[], None] | None:
        """Write the trained weights and optimizer state into `folder` (`mmrl.train.sharded`);
        with `background`, start writing a copy and return a function that waits until the files
        are complete (raising the write's error)."""
        if not background:
            save_sharded(self.policy.model, self.optimizer, folder)
            return None
        future = start_save_sharded(self.policy.model, self.optimizer, folder)

        def written() -> None:
            try:
                future.result()
            except BaseException as exc:  # a full disk is raised as the OSError it is (StorageError)
                inner = os_error_of(exc)
                if inner is None or inner is exc:
                    raise
                raise inner from exc

        return written

    def load_sharded(self, folder: Path) -> None:
        """Read what `save_sharded` wrote, by whatever number of processes wrote it."""
        if not self.shards_state:
            raise ValueError(
                f"{folder} is a sharded checkpoint, which this run's optimizer cannot read (a DeepSpeed "
                "optimizer or a critic's value head): resume with the strategy and algo.advantage it was written with"
            )
        load_sharded(self.policy.model, self.optimizer, folder)

    def evaluation_engine(self) -> HFRolloutEngine:
        """The engine that evaluates the current policy (here the rollout engine, which holds it)."""
        return self.engine

    def checkpoint_state(self) -> dict[str, Any]:
        """What else a checkpoint holds to resume this trainee exactly (a composition's own
        state, e.g. the Ray rollout workers' random generators); merged into the trainer state."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        """After `resume_from` loaded a checkpoint's weights, optimizer and schedule (`state`: its
        trainer state): put back what `checkpoint_state` saved, and whatever lives elsewhere."""

    def close(self) -> None:
        """Stop what the trainee started (verifier workers; actors and threads in other modes)."""
        self.router.close()


@dataclass
class Composition:
    """How a run is put together from the same pieces: what builds the trainee and what one step
    is. The default is the single-process, on-policy loop (`local_composition`); the others are
    chosen by name in `mmrl.compose`, above this module, which imports none of them."""

    make_trainee: Callable[[Config, Policy, Path | None], Trainee]
    step: Callable[..., dict[str, float]]


def local_composition() -> Composition:
    """The default: the single-process, on-policy loop of this module."""
    return Composition(make_trainee=make_trainee, step=grpo_step)


def asks_for_another_composition(cfg: Config) -> str | None:
    """The setting that chooses a composition other than this module's loop (None: none does)."""
    t = cfg.trainer
    for key, value, default in (
        ("trainer.backend", t.backend, "local"),
        ("trainer.mode", t.mode, "sync"),
        ("trainer.strategy", t.strategy, "fsdp2"),
        ("rollout.engine", cfg.rollout.engine, "hf"),
    ):
        if value != default:
            return f"{key}={value}"
    return None


def train(cfg: Config, compose: Composition | None = None) -> TrainResult:
    """Train `cfg`'s run with `compose` (None: this module's loop, in this process).

    The other compositions (Ray, async, DeepSpeed, colocated vLLM) are chosen by name above this
    loop, in `mmrl.compose`; `mmrl.compose.train(cfg)` picks the one `cfg` asks for."""
    t_start = time.monotonic()
    skip_unused_deepspeed_probe()  # saves need not import DeepSpeed (mmrl.models.saving)
    if compose is None:
        other = asks_for_another_composition(cfg)
        if other is not None:
            raise ValueError(f"{other} is a composition of mmrl.compose: run it with mmrl.compose.train(cfg)")
        compose = local_composition()
    # 1. Setup: seeds, threads.
    if cfg.trainer.threads > 0:
        torch.set_num_threads(cfg.trainer.threads)
    seed_everything(cfg.trainer.seed)

    # 2. Data: every record is validated here, before anything is written or trained.
    train_samples, heldout, data_report = load_data_report(cfg)
    if cfg.trainer.eval_size:
        heldout = heldout[: cfg.trainer.eval_size]
    check_model_reward_names(cfg, train_samples + heldout)
    sampler = PromptSampler(train_samples, seed=cfg.trainer.seed, cot_pool=cot_pool(cfg))
    # The checkpoint to resume from, if any: refused here (all damaged, config changed) before
    # the run directory is touched.
    check_paths(cfg)
    check_trackers_installed(cfg.trainer.loggers)
    run_dir = run_dir_path(cfg)
    # One run writes a run directory at a time, a resumed one too: the lock comes before anything
    # there is read or cleaned (a second trainer is refused at once, naming the first).
    with hold_run_dir(run_dir, "mmrl train"):
        return _train_holding(cfg, compose, sampler, heldout, run_dir, t_start, data_report)


def _train_holding(
    cfg: Config,
    compose: Composition,
    sampler: PromptSampler,
    heldout: list,
    run_dir: Path,
    t_start: float,
    data_report: dict,
) -> TrainResult:
    """`train` from the run directory on, while this process holds its lock."""
    resume_path = plan_resume(cfg, run_dir)
    run_dir = create_run_dir(cfg, run_dir)

    # 3. Policy (LoRA / frozen parts), reference, rollout engine, router, optimizer; then the
    #    checkpoint to resume from, if any (its weights replace the policy's, not the reference's).
    model_path = cfg.model.path or builtin_base(cfg)
    t = compose.make_trainee(cfg, load_policy_for(cfg, model_path), run_dir)
    progress = RunProgress()
    resumed = resume_path is not None and resume_from(cfg, t, sampler, progress, run_dir, resume_path)
    t.router.warm_up()
    # A resumed run drops what the crashed one logged after its checkpoint; `resume=auto` with
    # no checkpoint yet starts the files over.
    keep_until = progress.step if resumed else (-1 if cfg.trainer.resume else None)
    try:
        metrics_log = open_metrics_log(run_dir, cfg.trainer, config_to_dict(cfg), resume_after=keep_until)
    except BaseException:
        t.close()
        raise
    total = cfg.trainer.total_steps
    stop = StopRequest()
    tool_figures: dict[str, float] = {}  # (TrainResult.tools)
    with_tools = any(s.agent is not None and s.agent.tools for s in heldout)  # (not environments alone)

    def run_eval(step: int) -> float:
        # A stop asked during an evaluation ends it between two responses (EvaluationInterrupted).
        log.info("step %d: held-out evaluation of %d samples", step, len(heldout))
        engine = t.evaluation_engine()
        evaluation = run_evaluation(
            engine, t.router, heldout, cfg.rollout.max_new_tokens, VerifyContext(step, total),
            progress=cfg.trainer.progress, should_stop=lambda: stop.requested,
            generations=cfg.trainer.log_generations, agent=cfg.agent,
        )  # fmt: skip
        metrics = evaluation.metrics
        tr = cfg.trainer
        if tr.eval_without_tools and (step == 0 or step == total) and with_tools:
            # The same held-out prompts with the tools switched off, side by side (the task's
            # own tool-free wording where it has one: `mmrl.datasets.visual_search.without_tools`).
            from mmrl.datasets.visual_search import without_tools

            plain = run_evaluation(
                engine, t.router, [without_tools(s) for s in heldout], cfg.rollout.max_new_tokens,
                VerifyContext(step, total), agent=cfg.agent,
            ).metrics  # fmt: skip
            metrics.update({f"eval_no_tools/{k.removeprefix('eval/')}": v for k, v in plain.items()})
            log.info("step %d: held-out accuracy without tools %.3f [%.3f-%.3f]", step, plain["eval/accuracy"],
                     plain["eval/accuracy_low"], plain["eval/accuracy_high"])  # fmt: skip
        if tr.eval_suite and (step % tr.eval_suite_every == 0 or step == total):
            from mmrl.eval.runner import evaluate_suite

            suite = None if tr.eval_suite == "builtin" else tr.eval_suite
            metrics.update(evaluate_suite(engine, suite, max_queries=tr.eval_suite_max_queries))
        metrics_log.log(step, metrics)
        metrics_log.log_generations(step, evaluation.generations)
        log.info("step %d: greedy held-out accuracy %.3f [%.3f-%.3f] (%d prompts)", step, metrics["eval/accuracy"],
                 metrics["eval/accuracy_low"], metrics["eval/accuracy_high"], metrics["eval/n"])  # fmt: skip
        interval = [metrics["eval/accuracy_low"], metrics["eval/accuracy_high"]]
        when = "start" if step == 0 else "final"
        if with_tools and "eval/agent/tool_call_rate" in metrics:
            tool_figures[f"{when}_tool_call_rate"] = metrics["eval/agent/tool_call_rate"]
        if "eval_no_tools/accuracy" in metrics:
            for key in ("", "_low", "_high"):
                tool_figures[f"{when}_no_tools{key}"] = metrics[f"eval_no_tools/accuracy{key}"]
        if step == 0:
            progress.start_interval = interval
        progress.final_interval, progress.eval_size = interval, int(metrics["eval/n"])
        return metrics["eval/accuracy"]

    # 4. The loop: one step per rollout batch, greedy evaluation every `eval_every` steps,
    #    a checkpoint every `checkpoint_every` steps and when SIGINT / SIGTERM asks to stop
    #    (before the first step, a stop ends the run like Ctrl-C: nothing to resume yet).
    sealing: PendingCheckpoint | None = None  # the last checkpoint, maybe still being sealed
    with metrics_log:  # every sink closed on the way out; the trackers told "failed" on an error
        try:
            with stop.installed():
                if not resumed and cfg.trainer.eval_at_start:
                    progress.start_acc = progress.best_acc = progress.final_acc = run_eval(0)
                first = progress.step + 1
                bar = ProgressBar(
                    range(first, total + 1), desc="GRPO", disable=not cfg.trainer.progress, dynamic_ncols=True
                )
                for step in bar:
                    metrics = compose.step(cfg, t, sampler, VerifyContext(step - 1, total), step=step)
                    metrics_log.log(step, metrics)
                    progress.step = step
                    guard_skips(cfg, progress, metrics, step, run_dir)
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{progress.final_acc:.3f}")
                    if step % cfg.trainer.eval_every == 0 or step == total:
                        with contextlib.suppress(EvaluationInterrupted):  # stop.requested: checkpoint below
                            progress.final_acc = run_eval(step)
                            progress.best_acc = max(progress.best_acc, progress.final_acc, key=_nan_last)
                    every = cfg.trainer.checkpoint_every
                    if (every and step % every == 0) or step == total or stop.requested:
                        if sealing is not None:  # one at a time, in order
                            sealing.wait()
                        # The last one (and one a signal asks for) is sealed before going on.
                        background = cfg.trainer.async_checkpoint and step < total and not stop.requested
                        sealing = t.sealing = start_write_checkpoint(
                            cfg, t, sampler, progress, run_dir, background
                        )
                    if stop.requested:
                        log.warning("stopping at step %d on %s; checkpoint written", step, stop.signal_name)
                        break
                bar.close()
                if sealing is not None:
                    sealing.wait()
        finally:
            if sealing is not None and not sealing.done():  # an error left it sealing: let it finish
                with contextlib.suppress(Exception):
                    sealing.wait()
            t.close()

        # 5. Final policy (HF format; LoRA adapters merged, and saved alone too), curves, summary.
        if cfg.trainer.save_final:
            with storage_errors(
                "save the final policy to", run_dir / "final", "The last checkpoint is intact"
            ):
                merged_copy_for_saving(t.policy.model).save_pretrained(run_dir / "final")
                t.policy.processor.save_pretrained(run_dir / "final")
                if is_lora(t.policy.model):
                    t.policy.model.save_pretrained(run_dir / "final_adapter")
        plot_training_curves(run_dir / "metrics.jsonl", run_dir / "training_curves.png")
        metrics_log.log_image("plots/training_curves", run_dir / "training_curves.png", progress.step)
        metrics_log.status = "interrupted" if stop.requested else "finished"
    result = TrainResult(
        run_dir=run_dir,
        start_accuracy=progress.start_acc,
        final_accuracy=progress.final_acc,
        best_accuracy=progress.best_acc,
        steps=progress.step,
        start_interval=tuple(progress.start_interval),
        final_interval=tuple(progress.final_interval),
        eval_size=progress.eval_size,
        seconds=time.monotonic() - t_start,
        interrupted=stop.requested,
        tools=tool_figures,
    )
    summary = {k: (str(v) if isinstance(v, Path) else v) for k, v in result.__dict__.items()}
    summary["model_path"] = str(model_path)
    summary["data"] = data_report
    with storage_errors("write the summary to", run_dir / "summary.json"):
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return result


def _nan_last(x: float) -> float:
    """Sort key under which NaN (not evaluated) is below every accuracy."""
    return -math.inf if math.isnan(x) else x


@dataclass
class RunProgress:
    """Counters a resumed run must continue from."""

    step: int = 0
    start_acc: float = float("nan")
    best_acc: float = float("nan")
    final_acc: float = float("nan")
    start_interval: list[float] = field(default_factory=lambda: [float("nan"), float("nan")])
    final_interval: list[float] = field(default_factory=lambda: [float("nan"), float("nan")])
    eval_size: int = 0
    consecutive_skips: int = 0
    skipped_steps: int = 0


class StopRequest:
    """SIGINT / SIGTERM set a flag; the loop writes a checkpoint after the current step and
    stops. A second signal while stopping is not caught again (the default action runs)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum, frame):
            self.requested, self.signal_name = True, signal.Signals(signum).name
            signal.signal(signum, previous[signum])  # a second signal is not swallowed

        for sig in previous:
            signal.signal(sig, handler)
        try:
            yield
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)


def write_checkpoint(
    cfg: Config, t: Trainee, sampler: PromptSampler, progress: RunProgress, run_dir: Path
) -> Path:
    """Write the run's checkpoint of `progress.step` (and apply retention); returns its folder."""
    return start_write_checkpoint(cfg, t, sampler, progress, run_dir).wait()


def start_write_checkpoint(
    cfg: Config,
    t: Trainee,
    sampler: PromptSampler,
    progress: RunProgress,
    run_dir: Path,
    background: bool = False,
) -> PendingCheckpoint:
    """`write_checkpoint`; with `background` (`trainer.async_checkpoint`), the sharded state is
    written by a thread from a copy and the checkpoint sealed on another (`start_checkpoint`):
    the loop goes on after the copy. Retention runs only once it is sealed, so an older
    checkpoint is deleted only after the new one is complete and in place."""
    sharded = t.shards_state
    state = {
        **({} if sharded else {"optimizer": t.optimizer.state_dict()}),
        "scheduler": t.scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "progress": progress.__dict__.copy(),
        "stability": t.stability.state_dict(),
        **t.checkpoint_state(),
    }
    if t.value_head is not None:  # the critic's head: not part of the policy's HF weights
        state["value_head"] = {k: v.detach().cpu().clone() for k, v in t.value_head.state_dict().items()}
    if t.stability.resets and isinstance(t.reference, torch.nn.Module):
        # A reset reference is the policy of its reset step, which nothing else can rebuild: it
        # travels with the checkpoint (in its own dtype) so a resumed run keeps it.
        state["reference"] = {k: v.detach().cpu() for k, v in t.reference.state_dict().items()}
    return start_checkpoint(
        run_dir,
        progress.step,
        t.policy.model,
        t.policy.processor,
        state,
        config_to_yaml(cfg),
        metric=progress.final_acc,
        write_more=(lambda folder: t.save_sharded(folder / SHARDED, background)) if sharded else None,
        background=background,
        then=lambda _: apply_retention(run_dir, cfg.trainer.keep_last, cfg.trainer.keep_best),
    )


def resume_from(
    cfg: Config,
    t: Trainee,
    sampler: PromptSampler,
    progress: RunProgress,
    run_dir: Path,
    checkpoint: Path | None = None,
) -> bool:
    """Restore weights, optimizer, scheduler, sampler position, RNG states and counters from
    `checkpoint` (as `mmrl.train.preflight.plan_resume` chose it), or without it from
    `trainer.resume` (`auto`: the newest complete checkpoint of the run). True if resumed."""
    if checkpoint is not None:
        path = Path(checkpoint)
    elif not cfg.trainer.resume:
        return False
    elif cfg.trainer.resume == "auto":
        ckpt = find_resume_checkpoint(run_dir)
        if ckpt is None:
            log.info("resume=auto: no complete checkpoint in %s; starting fresh", run_dir)
            return False
        path = ckpt.path
    else:
        path = Path(cfg.trainer.resume)
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"trainer.resume={path}: not a usable checkpoint: {problem}")
    load_model_weights(t.policy.model, path / "model")
    state = load_trainer_state(path)
    if t.value_head is not None:
        if "value_head" not in state:
            raise ValueError(
                f"trainer.resume={path}: the checkpoint has no value head (algo.advantage={cfg.algo.advantage})"
            )
        t.value_head.load_state_dict(state["value_head"])
    if (path / SHARDED).is_dir():  # each training process reads its own shards
        t.load_sharded(path / SHARDED)
    else:  # written before sharded checkpoints, or by a DeepSpeed group / a critic run
        if "optimizer" not in state:
            raise ValueError(
                f"trainer.resume={path}: the checkpoint has neither {SHARDED}/ nor an optimizer state"
            )
        t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    sampler.load_state_dict(state["sampler"])
    progress.__dict__.update(state["progress"])
    if "stability" in state:  # checkpoints written before the stability options have none
        t.stability.load_state_dict(state["stability"])
    if "reference" in state and isinstance(t.reference, torch.nn.Module):
        t.reference.load_state_dict(state["reference"])
    set_rng_state(state["rng"])
    t.restore(state)
    log.info("resumed from %s at step %d", path, progress.step)
    return True


def guard_skips(
    cfg: Config, progress: RunProgress, metrics: dict[str, float], step: int, run_dir: Path
) -> None:
    """Count steps that did not update the policy; too many in a row stop the run."""
    updates = cfg.trainer.mini_batches * cfg.trainer.ppo_epochs
    skipped = metrics.get("guard/skipped_step", 0.0) > 0 or metrics.get("actor/skipped_steps", 0.0) >= updates
    progress.skipped_steps += int(skipped)
    progress.consecutive_skips = progress.consecutive_skips + 1 if skipped else 0
    if progress.consecutive_skips >= cfg.trainer.max_consecutive_skips:
        last = find_resume_checkpoint(run_dir)
        raise RuntimeError(
            f"{progress.consecutive_skips} steps in a row (up to step {step}) were skipped for non-finite "
            f"rewards, losses or gradients; stopping. The last good checkpoint is "
            f"{last.path if last else 'none (set trainer.checkpoint_every)'}; see the warnings above for the sample ids."
        )


def check_model_reward_names(cfg: Config, samples: list) -> None:
    """Every reward model a sample names must be configured (`reward.model_rewards.models`)."""
    configured = {m.name for m in cfg.reward.model_rewards.models}
    for sample in samples:
        for entry in sample.reward_model.models:
            if entry["name"] not in configured:
                raise ValueError(
                    f"sample {sample.id}: field 'reward_model.models': reward model {entry['name']!r} is not "
                    f"configured (reward.model_rewards.models: {sorted(configured) or 'none'})"
                )


def policy_precision(cfg: Config) -> Precision:
    """The policy's device and dtypes from `trainer.device`, `model.dtype`, `model.master_dtype`."""
    return precision_from(cfg.trainer.device, cfg.model.dtype, cfg.model.master_dtype)


def load_policy_for(cfg: Config, path: str | Path) -> Policy:
    """The policy at `path` (a folder or hub id at `model.revision`), loaded on the host in the
    dtype most of it will keep: the compute dtype under LoRA (the base never trains), else the
    master dtype; `make_trainee` then places it."""
    precision = policy_precision(cfg)
    dtype = precision.compute if cfg.model.lora_rank > 0 else precision.master
    return load_policy(path, dtype=dtype, revision=cfg.model.revision)


def prepare_policy(cfg: Config, policy: Policy) -> torch.nn.Module | str | None:
    """Adapters or frozen parts, the KL reference, then device and dtypes (`mmrl.models.precision`)
    and gradient checkpointing; returns the reference (see `Trainee.reference`)."""
    precision = policy_precision(cfg)
    if cfg.model.lora_rank > 0:
        policy.model = apply_lora(policy.model, cfg)
    freeze_parts(policy.model, cfg)
    reference: torch.nn.Module | str | None = None
    if cfg.algo.kl_coef > 0:
        if is_lora(policy.model):
            reference = "adapters_disabled"
        else:  # copied on the host, before the policy is placed: never two copies on the device
            reference = copy.deepcopy(policy.model).to(dtype=precision.compute).eval().requires_grad_(False)
            if not cfg.model.reference_on_cpu:
                reference.to(precision.device)
    place(policy.model, precision)
    policy.precision = precision
    policy.blocked = policy.blocked.to(precision.device)
    if cfg.model.gradient_checkpointing:
        # transformers >= 5.x names it activation checkpointing (the old name warns).
        enable = getattr(policy.model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            policy.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.model.train()
    log.info("policy: %s", precision.describe())
    return reference


def make_trainee(cfg: Config, policy: Policy, run_dir: Path | None = None) -> Trainee:
    """Wire a policy into what a step needs: adapters or frozen parts, reference, device and
    precision, engine, router, optimizer (a parameter group per part, each with its learning
    rate)."""
    reference = prepare_policy(cfg, policy)
    groups, value_head = param_groups(policy.model, cfg), None
    if cfg.algo.advantage in CRITIC_ESTIMATORS:  # PPO with a critic: its head, its own group
        value_head = value_head_for(policy.model, policy.device)
        groups.append(
            {
                "params": list(value_head.parameters()),
                "lr": cfg.algo.critic_lr or cfg.optim.lr,
                "name": "critic",
            }
        )
    optimizer = adamw(
        groups,
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        weight_decay=cfg.optim.weight_decay,
    )
    reward_models = None
    mr = cfg.reward.model_rewards
    if mr.models:
        budget = None if mr.placement.budget_mb is None else int(mr.placement.budget_mb * 2**20)
        reward_models = RewardPlacement(
            build_reward_models(mr, policy.device),
            accelerator=accelerator_device(mr.placement, policy.device),
            host=mr.placement.host,
            budget_bytes=budget,
        )
    return Trainee(
        reward_models=reward_models,
        policy=policy,
        reference=reference,
        engine=HFRolloutEngine.from_policy(policy, rollout=cfg.rollout),
        router=make_router(cfg),
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg)),
        run_dir=run_dir,
        value_head=value_head,
    )


def grpo_step(
    cfg: Config, t: Trainee, sampler: PromptSampler, context: VerifyContext, step: int = 0
) -> dict[str, float]:
    """One step on B prompts x G responses; returns its metrics."""
    t0 = time.monotonic()
    # a. Rollout and rewards (scoring overlaps generation, and the old/reference log-probs when
    #    `reward.overlap`; DAPO may draw more prompts).
    batch, rewards, rollout_metrics = rollout_and_score(cfg, t, sampler, context, defer=True)
    return learn_from_rollouts(cfg, t, batch, rewards, rollout_metrics, step, t0)


def learn_from_rollouts(
    cfg: Config,
    t: Trainee,
    batch: RolloutBatch,
    rewards: RewardBatch | DeferredRewards,
    rollout_metrics: dict[str, float],
    step: int,
    t0: float,
) -> dict[str, float]:
    """Steps b-g of `grpo_step` on scored rollouts that began at time `t0` (the asynchronous mode
    passes rollouts of an older policy here). `rewards` may still be being computed
    (`DeferredRewards`): the old and reference log-probs need no rewards, so they are computed
    first, while the last responses are scored; then, with `reward.update_while_scoring` where
    it applies (`pipelined_update`), each mini-batch's update starts as soon as its groups are
    scored."""
    a, G = cfg.algo, cfg.rollout.group_size
    t1 = time.monotonic()
    batch = batch.to(t.policy.device)  # engines that hold their own copy (vLLM, Ray) return host tensors
    deferred = rewards if isinstance(rewards, DeferredRewards) else None
    batch.response_mask = batch.response_mask.clone()  # masked row by row below
    # c. Old and reference log-probs, before any reward is needed (masked rows set to 0 below);
    #    with a critic, its values of the rollout from the same forward.
    old_values = critic = None
    if a.advantage in CRITIC_ESTIMATORS:
        old_logprobs, ref_logprobs, old_values = t.old_ref_and_values(cfg, batch)
    else:
        old_logprobs, ref_logprobs = t.old_and_ref_logprobs(cfg, batch)
    inputs = StepInputs.empty(
        len(batch), old_logprobs, ref_logprobs, tis=tis_applies(cfg), rejection=cfg.algo.rejection != "off"
    )
    baseline_metrics: dict[str, float] = {}
    if a.advantage in NEEDS_BASELINE:  # ReMax: a greedy response per prompt, scored (step d's input)
        context = VerifyContext(max(step - 1, 0), cfg.trainer.total_steps)
        inputs.baselines, baseline_metrics = greedy_baselines(
            cfg, t.engine, lambda greedy: score_rollouts(t, greedy, context), batch
        )
    hook = None
    if deferred is not None and pipelined_update(cfg, t, batch):
        hook = inputs.filler(cfg, batch, deferred)
    else:
        if deferred is not None:
            rewards, _ = deferred()
        # Numeric guard: a non-finite reward means a broken verifier or reward model; the step
        # is skipped (no update), counted, and the offending samples named.
        if (skipped := nonfinite_guard(rewards.scores)) is not None:
            ids = sorted(
                {s.id for s, r in zip(batch.samples, rewards.scores.tolist()) if not math.isfinite(r)}
            )
            log.warning("step %d: non-finite reward for samples %s: step skipped", step, ids[:20])
            return {**skipped, "time/step_s": time.monotonic() - t0}
        inputs.fill(cfg, batch, range(len(batch)), rewards)
        inputs.normalize_weights(cfg, batch)
        if old_values is not None:  # d. the critic's advantages, over the whole batch's tokens
            env_parts = [r.components.get("env_return", 0.0) for r in rewards.results]
            inputs.advantages, critic = critic_targets(
                cfg, batch, inputs.scores, old_values, t.value_head, env_parts
            )
    t2 = time.monotonic()
    step_cfg = t.stability.step_config(cfg)  # the adaptive entropy coefficient, if on
    # f. Policy update over mini-batches (with `hook`, each first waits for its groups' rewards
    #    and steps b-e on them), then the learning-rate schedule.
    placed = t.reward_models.training() if t.reward_models is not None else contextlib.nullcontext()
    if t.sealing is not None:  # a background checkpoint still reading the weights the update changes
        t.sealing.wait_for_weights()
    try:
        with placed:  # offloadable reward models leave the accelerator while the policy trains
            metrics = t.update_policy(
                step_cfg, batch, inputs.advantages, inputs.old, inputs.ref, inputs.weights, hook,
                **({} if critic is None else {"critic": critic}),
            )  # fmt: skip
    except NonFiniteRewards as exc:
        # Every row is waited for (its error logged) and every non-finite reward counted, not
        # only the mini-batch's that raised. Mini-batches updated before it stay applied (undoing
        # them would need a copy of the weights and optimizer state): a partial step, reported
        # as one; with none applied the step is skipped.
        everything, _ = deferred()
        bad = ~torch.isfinite(everything.scores)
        metrics = {**exc.metrics, "guard/nonfinite_rewards": float(bad.sum())}
        ids = sorted({batch.samples[i].id for i in bad.nonzero().flatten().tolist()})
        if exc.applied:
            log.warning(
                "step %d: non-finite reward for samples %s after %d mini-batch(es) had been "
                "applied: a partial step (guard/partial_step)",
                step,
                ids[:20],
                exc.applied,
            )
            metrics.update(
                {
                    "guard/skipped_step": 0.0,
                    "guard/partial_step": 1.0,
                    "guard/applied_minibatches": float(exc.applied),
                    "actor/lr": t.scheduler.get_last_lr()[0],
                }
            )
            t.scheduler.step()  # the weights did change: the schedule moves on as for any step
        else:
            log.warning("step %d: non-finite reward for samples %s: step skipped", step, ids[:20])
        return {**metrics, "time/step_s": time.monotonic() - t0}
    if deferred is not None:  # every reward is in by now; the time waited for them in all
        rewards, waited = deferred()
        rollout_metrics = {**rollout_metrics, "time/reward_wait_s": waited}
    if t.reward_models is not None:
        metrics.update(t.reward_models.metrics())
    metrics["actor/lr"] = t.scheduler.get_last_lr()[0]
    t.scheduler.step()
    metrics.update(t.stability.after_update(cfg, t, metrics, step))  # entropy control, ref reset
    t3 = time.monotonic()
    # g. Metrics (and the step dump).
    metrics.update(rollout_metrics)
    metrics.update(baseline_metrics)
    metrics.update(inputs.mismatch_metrics(cfg, batch))
    engine_facts = getattr(t.engine, "rollout_metrics", None)  # the HF engine's: LoRA merged, decode form
    metrics.update(engine_facts() if callable(engine_facts) else {})
    metrics.update(mismatch_source_metrics(cfg, batch, inputs.old, inputs.rejected))
    metrics.update(step_metrics(batch, rewards, row_advantages(inputs.advantages, batch.response_mask), G))
    if critic is not None:
        metrics.update(critic_metrics(batch, inputs.advantages, critic))
    metrics.update(trajectory_metrics(batch, G))  # multi-turn: turns, tool calls, terminations
    if cfg.rollout.tokenization_check and batch.trajectories is not None:
        metrics.update(tokenization_drift(batch, t.policy.processor))
    metrics["verifier/dropped"] = float(inputs.dropped.sum())
    metrics["guard/skipped_step"] = 0.0
    if a.overlong_buffer > 0 or a.kl_in_reward:
        metrics["reward/shaped_mean"] = float(inputs.scores.mean())
    if cfg.trainer.dump_steps and t.run_dir is not None:
        write_step_dump(
            t.run_dir, step, batch, rewards, inputs.scores, row_advantages(inputs.advantages, batch.response_mask),
            inputs.old, inputs.ref,
        )  # fmt: skip
    generated = float(batch.response_mask.sum())
    metrics.update(
        {
            "time/rollout_s": t1 - t0,
            "time/prep_s": t2 - t1,
            "time/update_s": t3 - t2,
            "time/step_s": t3 - t0,
            "throughput/samples_per_s": len(batch) / (t3 - t0),
            "throughput/generated_tokens_per_s": generated / (t3 - t0),
        }
    )
    return metrics


class NonFiniteRewards(Exception):
    """Raised from the update's `before_minibatch` hook: a non-finite reward arrived."""

    def __init__(self, metrics: dict[str, float], applied: int = 0):
        super().__init__("non-finite rewards")
        self.metrics = metrics
        self.applied = applied
        """Mini-batches already updated on when it was raised."""


def nonfinite_guard(scores: torch.Tensor) -> dict[str, float] | None:
    """The skipped step's metrics if any of `scores` is not finite, else None (the caller
    names the offending samples in the log, with what became of the step)."""
    bad = ~torch.isfinite(scores)
    if not bad.any():
        return None
    return {
        "guard/skipped_step": 1.0,
        "guard/nonfinite_rewards": float(bad.sum()),
        "reward/mean": float(scores[~bad].mean()) if (~bad).any() else float("nan"),
    }


def tis_applies(cfg: Config) -> bool:
    """Whether the loss is weighted by truncated importance-sampling weights."""
    return cfg.algo.old_logprobs == "recompute" and cfg.algo.tis != "off"


def pipelined_update(cfg: Config, t: Trainee, batch: RolloutBatch) -> bool:
    """Whether this step's update may start on scored groups while others are still being
    scored (`reward.update_while_scoring`): the advantages must be group-local, there must be
    more than one mini-batch, no reward model may score the batch (it scores the whole batch at
    once) and the update must run here."""
    return (
        cfg.reward.update_while_scoring
        and cfg.algo.advantage in GROUP_LOCAL
        and cfg.trainer.mini_batches > 1
        and not cfg.algo.tis_batch_norm  # needs every row's weight first
        and t.updates_while_scoring
        and (t.reward_models is None or not any(s.reward_model.models for s in batch.samples))
    )


@dataclass
class StepInputs:
    """Steps b-e of a GRPO step, row by row: shaped rewards, dropped rows, advantages, the
    masked old/reference log-probs and TIS weights, all [N] or [N, R]. Filled for the whole
    batch at once, or group by group as rewards arrive (`filler`); either way each row's
    values depend only on its own group, so the two ways give the same tensors."""

    scores: torch.Tensor
    dropped: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor | None
    weights: torch.Tensor | None
    rejected: torch.Tensor | None = None
    """[N] bool: responses dropped by rollout rejection (`algo.rejection`; None when off)."""
    baselines: torch.Tensor | None = None
    """[N] the greedy baseline reward of each row's prompt (ReMax; None otherwise)."""
    norm_stats: tuple[torch.Tensor, torch.Tensor] | None = None
    """(truncated IS weights, loss mask) before rollout rejection and IS masking: what
    `algo.tis_batch_norm` averages in veRL's order (scope `verl`; None otherwise)."""

    @classmethod
    def empty(
        cls, n: int, old: torch.Tensor, ref: torch.Tensor | None, tis: bool, rejection: bool = False
    ) -> StepInputs:
        device = old.device  # the batch's, hence the policy's
        return cls(
            rejected=torch.zeros(n, dtype=torch.bool, device=device) if rejection else None,
            scores=torch.zeros(n, device=device),
            dropped=torch.zeros(n, dtype=torch.bool, device=device),
            advantages=torch.zeros(n, device=device),
            old=old,  # fresh from the old/ref pass: masked in place, row by row
            ref=ref,
            weights=torch.zeros_like(old, dtype=torch.float32) if tis else None,
        )

    def fill(self, cfg: Config, batch: RolloutBatch, rows: Iterable[int], rewards: RewardBatch) -> None:
        """Steps b-e for `rows` (whole groups), whose rewards are `rewards` (in `rows` order);
        also masks those rows of `batch.response_mask` (dropped and truncated rows)."""
        a = cfg.algo
        rows = list(rows)
        # b. Reward shaping and loss masks.
        device = self.old.device  # rewards come from the verifier workers, on the host
        # Rows that were scored: no error, or an answer refused by a size cap (a verdict, scored 0).
        valid = torch.tensor(
            [r.error is None or is_refusal(r.error) for r in rewards.results], dtype=torch.bool, device=device
        )
        dropped = ~valid if cfg.reward.on_error == "drop" else torch.zeros_like(valid)
        scores = rewards.scores.to(device, copy=True)
        lengths = batch.response_mask[rows].sum(dim=1)
        if a.overlong_buffer > 0:
            scores = scores + overlong_penalty(
                lengths, cfg.rollout.max_new_tokens, a.overlong_buffer, a.overlong_penalty
            )
        keep = (~dropped).float()
        if a.mask_truncated:
            keep = keep * truncation_mask(batch.truncated[rows])
        mask = batch.response_mask[rows] * keep.unsqueeze(1).long()
        batch.response_mask[rows] = mask
        # c. The log-probs computed before the rewards, masked like the batch; the KL may go
        #    into the reward.
        masked_out = mask == 0
        self.old[rows] = self.old[rows].masked_fill(masked_out, 0.0)
        if self.ref is not None:
            self.ref[rows] = self.ref[rows].masked_fill(masked_out, 0.0)
            if a.kl_in_reward:
                kl = kl_estimate(self.old[rows], self.ref[rows], "k1")
                scores = kl_penalized_rewards(scores, kl, mask.float(), a.kl_coef)
        # d. Advantages within each prompt's group (a critic's come after, over the whole batch).
        if a.advantage not in CRITIC_ESTIMATORS:
            self.advantages[rows] = compute_advantages(
                cfg, scores, rewards, ~dropped, token_counts=mask.sum(dim=1),
                baselines=None if self.baselines is None else self.baselines[rows],
            )  # fmt: skip
        self.scores[rows] = scores
        self.dropped[rows] = dropped
        # e. Rollout rejection (whole responses out of the loss; their rewards stayed in their
        #    groups' statistics above), then importance-sampling weights against the rollout
        #    engine's log-probs.
        pre_rejection = mask
        if self.rejected is not None:
            keep, _ = rejection_keep(
                self.old[rows], batch.rollout_logprobs[rows], mask.float(), level=a.rejection,
                low=a.rejection_low or 1.0 / a.rejection_high, high=a.rejection_high,
            )  # fmt: skip
            self.rejected[rows] = ~keep
            mask = mask * keep.unsqueeze(1).long()
            batch.response_mask[rows] = mask
        if self.weights is not None and a.tis_batch_norm and a.tis_batch_norm_scope == "verl":
            if self.norm_stats is None:
                self.norm_stats = (torch.zeros_like(self.weights), torch.zeros_like(batch.response_mask))
            # veRL's order: the batch mean is of the truncated weights over the tokens before
            # rejection (`pre_rejection`) and before IS masking.
            self.norm_stats[0][rows], _ = tis_weights(
                self.old[rows],
                batch.rollout_logprobs[rows],
                pre_rejection.float(),
                level=a.tis,
                cap=a.tis_cap,
            )
            self.norm_stats[1][rows] = pre_rejection
        if self.weights is not None:
            self.weights[rows], _ = tis_weights(
                self.old[rows], batch.rollout_logprobs[rows], mask.float(),
                level=a.tis, cap=a.tis_cap, mode=a.tis_mode, low=a.tis_low or None,
            )  # fmt: skip

    def normalize_weights(self, cfg: Config, batch: RolloutBatch) -> None:
        """`algo.tis_batch_norm`: the IS weights of the whole batch divided by their mean (over
        what `algo.tis_batch_norm_scope` says)."""
        if self.weights is not None and cfg.algo.tis_batch_norm:
            stat_weights, stat_mask = self.norm_stats if self.norm_stats is not None else (None, None)
            self.weights, _ = batch_normalize_weights(
                self.weights,
                batch.response_mask,
                cfg.algo.tis,
                stat_weights=stat_weights,
                stat_mask=stat_mask,
            )

    def filler(
        self, cfg: Config, batch: RolloutBatch, deferred: DeferredRewards
    ) -> Callable[[list[int]], None]:
        """The update's `before_minibatch` hook: waits for the rewards of the groups a mini-batch
        touches that are not filled yet and fills them (raises `NonFiniteRewards` instead of
        filling if one is not finite)."""
        G = cfg.rollout.group_size
        filled = [False] * (len(batch) // G)
        calls = [0]  # mini-batches let through so far (each is then updated on)

        def before_minibatch(mb_rows: list[int]) -> None:
            groups = sorted({r // G for r in mb_rows if not filled[r // G]})
            if not groups:
                calls[0] += 1
                return
            rows = [g * G + j for g in groups for j in range(G)]
            rewards = deferred.rows(rows)
            if (skipped := nonfinite_guard(rewards.scores)) is not None:
                raise NonFiniteRewards(skipped, applied=calls[0])
            calls[0] += 1
            self.fill(cfg, batch, rows, rewards)
            for g in groups:
                filled[g] = True

        return before_minibatch

    def mismatch_metrics(self, cfg: Config, batch: RolloutBatch) -> dict[str, float]:
        """Rollout-vs-trainer mismatch (`tis/...`, `rollout/kl_...`) over the whole batch; the
        `rollout/` part alone when TIS is off (still worth watching)."""
        a = cfg.algo
        if a.old_logprobs != "recompute":
            return {}
        _, metrics = tis_weights(
            self.old, batch.rollout_logprobs, batch.response_mask.float(),
            level="token" if a.tis == "off" else a.tis, cap=a.tis_cap, mode=a.tis_mode,
            low=a.tis_low or None,
        )  # fmt: skip
        if a.tis == "off":
            metrics = {k: v for k, v in metrics.items() if k.startswith("rollout/")}
        if self.rejected is not None:
            metrics["rejection/seq_frac"] = float(self.rejected.float().mean())
        if self.weights is not None and a.tis_batch_norm:
            m = batch.response_mask > 0
            metrics["tis/normalized_weight_mean"] = float(self.weights[m].mean()) if m.any() else 1.0
        return metrics


class DeferredRewards:
    """A batch's rewards while its last responses are still being scored: `rows(rows)` waits
    for some rows only; calling it waits for all and returns them with the seconds spent
    waiting in all (errors logged and counted then, once per step)."""

    def __init__(
        self,
        pending: Any,
        batch: RolloutBatch,
        reward_models: RewardPlacement | None,
        agent: AgentConfig | None = None,
    ):
        self.pending = pending
        self.batch = batch
        self.reward_models = reward_models
        self.agent = agent
        self.waited = 0.0
        self._all: RewardBatch | None = None

    def _shaped(self, results: list, rows: list[int]) -> list:
        """Multi-turn rows get their tools' part of the reward (`mmrl.rollout.multiturn`)."""
        if self.batch.trajectories is None or self.agent is None:
            return results
        return shape_results(results, [self.batch.trajectories[r] for r in rows], self.agent)

    def rows(self, rows: list[int]) -> RewardBatch:
        """The verifier results of `rows` (model rewards are not added: callers check that no
        sample names one)."""
        start = time.monotonic()
        samples, texts = self.batch.samples, self.batch.texts
        results = self._shaped(self.pending.wait(rows, samples, texts), list(rows))
        self.waited += time.monotonic() - start
        return RewardBatch.of(results, [samples[r] for r in rows])

    def __call__(self) -> tuple[RewardBatch, float]:
        if self._all is None:
            start = time.monotonic()
            rewards = self.pending.result(self.batch.samples, self.batch.texts)
            if self.batch.trajectories is not None and self.agent is not None:
                shaped = self._shaped(rewards.results, list(range(len(self.batch))))
                rewards.results = shaped
                rewards.scores = torch.tensor(
                    [r.score for r in shaped], dtype=torch.float32, device=rewards.scores.device
                )
            if self.reward_models is not None:
                add_model_rewards(self.reward_models, self.batch, rewards)
            self.waited += time.monotonic() - start
            self._all = rewards
        return self._all, self.waited


def generate_and_score(
    cfg: Config,
    t: Trainee,
    samples: list,
    context: VerifyContext,
    defer: bool = False,
    interrupt: Interrupt | None = None,
) -> tuple[RolloutBatch, RewardBatch | DeferredRewards, float]:
    """G responses per sample, each handed to the router the moment it is finished. With
    `defer`, the rewards are returned still being computed (`DeferredRewards`), so that other
    work can go on while the last responses are scored. `interrupt`: partial rollouts (the
    asynchronous mode's generators)."""
    G = cfg.rollout.group_size
    params = SamplingParams(
        n=G, temperature=cfg.rollout.temperature, max_new_tokens=cfg.rollout.max_new_tokens
    )
    rows = [s for s in samples for _ in range(G)]
    pending = t.router.start(context, len(rows))
    on_response = (lambda r, text: pending.add(r, rows[r], text)) if overlap_rewards(cfg) else None
    batch = generate_trajectories(
        t.engine, samples, params, cfg.agent, on_response=on_response, interrupt=interrupt
    )
    deferred = DeferredRewards(pending, batch, t.reward_models, cfg.agent)
    if defer:
        return batch, deferred, 0.0
    rewards, waited = deferred()
    return batch, rewards, waited


def add_model_rewards(placement: RewardPlacement, batch: RolloutBatch, rewards: RewardBatch) -> None:
    """Score the responses whose samples name reward models; add each row's weighted total to
    its reward and keep every model's output as a `model/<name>` component. A model that
    raises is treated like a verifier error (`mmrl.router.model_reward_failed`): its rows get
    an error result, counted, and the step goes on."""
    if not any(s.reward_model.models for s in batch.samples):
        return
    failures: dict[int, tuple[str, str]] = {}
    rows = placement.score_rows(batch.samples, batch.texts, failures)
    for i, row in enumerate(rows):
        if row:
            rewards.results[i].components.update({f"model/{k}": float(v) for k, v in row.items()})
        if i in failures:
            continue
        if row:
            rewards.results[i].score += float(row["total"])
            rewards.scores[i] += float(row["total"])
    if failures:
        model_reward_failed(rewards, batch.samples, failures)


def rollout_and_score(
    cfg: Config, t: Trainee, sampler: PromptSampler, context: VerifyContext, defer: bool = False
) -> tuple[RolloutBatch, RewardBatch | DeferredRewards, dict[str, float]]:
    """B groups of G scored responses. With DAPO dynamic sampling, groups whose rewards are all
    equal (no learning signal) are dropped and more prompts are drawn, at most
    `algo.max_resample_batches` extra rounds; a step may end with fewer groups. `defer` (taken
    when scores overlap generation and DAPO does not need them here): the rewards come back
    still being computed, as `DeferredRewards`."""
    B, G = cfg.trainer.prompts_per_step, cfg.rollout.group_size
    defer = defer and overlap_rewards(cfg) and not cfg.algo.dynamic_sampling
    batch, rewards, waited = generate_and_score(cfg, t, sampler.next(B), context, defer=defer)
    if defer:
        return batch, rewards, {}
    if not cfg.algo.dynamic_sampling:
        return batch, rewards, {"time/reward_wait_s": waited}
    kept_batches, kept_rewards, n_kept, rounds, generated = [], [], 0, 1, B
    while True:
        informative = informative_groups(rewards.scores, G).tolist()
        groups = [g for g, ok in enumerate(informative) if ok][: B - n_kept]
        if groups:
            rows = [g * G + j for g in groups for j in range(G)]
            kept_batches.append(select_rows(batch, rows))
            kept_rewards.append(rewards.select(rows))
            n_kept += len(groups)
        if n_kept >= B or rounds > cfg.algo.max_resample_batches:
            break
        batch, rewards, more_wait = generate_and_score(cfg, t, sampler.next(B), context)
        waited += more_wait
        rounds += 1
        generated += B
    if not kept_batches:  # nothing informative at all: train on the last batch (advantages 0)
        kept_batches, kept_rewards = [batch], [rewards]
    batch = (
        kept_batches[0] if len(kept_batches) == 1 else concat_rollouts(kept_batches, t.policy.pad_token_id)
    )
    batch.group_size = G
    metrics = {
        "time/reward_wait_s": waited,
        "dapo/rounds": float(rounds),
        "dapo/informative_groups": float(n_kept),
        "dapo/informative_fraction": n_kept / generated,
    }
    return batch, RewardBatch.concat(kept_rewards), metrics


def compute_advantages(
    cfg: Config,
    scores: torch.Tensor,
    rewards: RewardBatch,
    valid: torch.Tensor,
    token_counts: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N] advantages by `algo.advantage`; GDPO reads the named reward components separately
    (a component a row lacks is left out of that component's statistics only); token-weighted
    estimators (REINFORCE++-baseline, OPO) get each row's loss-token count, ReMax the greedy
    `baselines`, pass@k its k."""
    a, G = cfg.algo, cfg.rollout.group_size
    estimator = get_advantage_estimator(a.advantage)
    if a.advantage == "gdpo":
        components = torch.stack([rewards.component(name) for name in a.gdpo_components], dim=1)  # [N, K]
        components = components.to(scores.device)
        advantages = estimator(
            components,
            G,
            eps=a.adv_eps,
            valid=valid,
            weights=a.gdpo_weights or None,
            batch_norm=a.gdpo_batch_norm,
        )
    else:
        extra: dict[str, Any] = {}
        if a.advantage in TOKEN_WEIGHTED and token_counts is not None:
            extra["token_counts"] = token_counts
        if a.advantage in NEEDS_BASELINE:
            extra["baselines"] = baselines
        if a.advantage == "pass_at_k":
            extra["k"] = a.passk_k
        advantages = estimator(scores, G, eps=a.adv_eps, valid=None if bool(valid.all()) else valid, **extra)
    return clip_advantages(advantages, a.adv_clip or None)


def score_rollouts(t: Trainee, batch: RolloutBatch, context: VerifyContext) -> RewardBatch:
    """Verifier (and reward-model) rewards of a rollout batch, all at once (the greedy baseline)."""
    rewards = t.router.score(batch.samples, batch.texts, context)
    if t.reward_models is not None:
        add_model_rewards(t.reward_models, batch, rewards)
    return rewards


def overlap_rewards(cfg: Config) -> bool:
    """Score responses while generation goes on (needs worker processes or a reward server)."""
    return cfg.reward.overlap and (cfg.reward.num_workers > 0 or bool(cfg.reward.remote_url))


def lr_lambda(cfg: Config):
    """`LambdaLR`'s factor for the run's `optim.schedule` (`mmrl.train.schedule`)."""
    o, total = cfg.optim, cfg.trainer.total_steps
    return lambda step: schedule_factor(o.schedule, step, total, o.warmup_steps)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

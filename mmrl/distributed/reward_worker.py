"""The Ray backend's reward worker (`trainer.reward_workers`): a verifier router in its own actor.

A module of its own so that the actor imports only what scoring needs. Ray starts an actor by
importing its class's module; from `ray_backend.py` that meant the trainer, torch and
transformers (3.4 CPU-seconds and 840 MiB resident per actor, measured) for a process that
runs verifiers. Here nothing imports torch unless the run has model rewards, which this worker
then places and runs (`RewardPlacement`). Tested: `tests/test_distributed_ray.py` asks running
reward workers what they have loaded, and `tests/test_cli.py` imports this module alone; measured
by `benchmarks/reward_worker_start.py`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from mmrl.router import log_errors
from mmrl.routing import make_router
from mmrl.types import Sample, VerifierResult, VerifyContext

if TYPE_CHECKING:
    from mmrl.config import Config


class RewardWorker:
    """A verifier router (or a reward-server client) in its own actor; one of
    `trainer.reward_workers`, each scoring the rows the driver sends it."""

    def __init__(self, cfg: Config, threads: int):
        self.router = make_router(cfg)
        self.pending: dict[str, Any] = {}
        self.rows_scored = 0
        self.placement = None
        mr = cfg.reward.model_rewards
        if mr.models:  # model rewards, placed by the local rules on this actor's device
            from mmrl.heap import imports_without_gc

            with imports_without_gc():
                import torch

                from mmrl.rewards.catalog import build_reward_models
                from mmrl.rewards.config import accelerator_device
                from mmrl.rewards.placement import RewardPlacement
                from mmrl.verifier_pool import import_plugins

            if threads > 0:
                torch.set_num_threads(threads)
            import_plugins(cfg.reward.plugins)  # reward model types registered by plugins
            device = "cuda" if torch.cuda.is_available() else "cpu"  # Ray exposes its GPU as cuda:0
            budget = None if mr.placement.budget_mb is None else int(mr.placement.budget_mb * 2**20)
            self.placement = RewardPlacement(
                build_reward_models(mr, device), accelerator=accelerator_device(mr.placement, device),
                host=mr.placement.host, budget_bytes=budget,
            )  # fmt: skip

    def warm_up(self) -> float:
        return self.router.warm_up()

    def start(self, key: str, context: VerifyContext, n_rows: int) -> None:
        self.pending[key] = self.router.start(context, n_rows)

    def add(self, key: str, row: int, sample: Sample, text: str) -> None:
        self.pending[key].add(row, sample, text)

    def wait(
        self, key: str, rows: list[int], samples: list[Sample | None], texts: list[str | None]
    ) -> list[VerifierResult]:
        """The results of `rows` of batch `key` (`samples` and `texts` are the batch's, filled
        at these rows); a row never added here is scored now."""
        results = self.pending[key].wait(rows, samples, texts)
        self.rows_scored += len(rows)
        return results

    def release(self, key: str) -> None:
        self.pending.pop(key, None)

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> list[VerifierResult]:
        """Every row's result, in order (errors logged here, with their sample ids; the driver
        gathers the rows into a `RewardBatch`)."""
        self.rows_scored += len(samples)
        results = self.router.submit(samples, texts, context).wait(range(len(samples)), samples, texts)
        log_errors(samples, results)
        return results

    def scored(self) -> int:
        """Rows this worker returned results for."""
        return self.rows_scored

    def score_models(
        self, samples: list[Sample], texts: list[str]
    ) -> tuple[list[dict[str, float]], dict[int, tuple[str, str]]]:
        """The model rewards of these rows (`RewardPlacement.score_rows`) and the failed rows."""
        failures: dict[int, tuple[str, str]] = {}
        return self.placement.score_rows(samples, texts, failures), failures

    def before_update(self) -> None:
        """The policy is about to train: offloaded reward models go to host memory."""
        self.placement.before_update()

    def placement_metrics(self) -> dict[str, float]:
        return self.placement.metrics()

    def node(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        self.router.close()

    def pid(self) -> int:
        return os.getpid()

"""The reward router a run scores with, chosen from its config: local verifier workers
(`mmrl.router.Router`) or remote `mmrl serve` servers (`mmrl.server.client.RemoteRouter`, the
same interface). Above both, so neither imports the other; loads no torch (Ray's reward workers
import it, `mmrl.distributed.reward_worker`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmrl.router import Router

if TYPE_CHECKING:
    from mmrl.config import Config
    from mmrl.server.client import RemoteRouter


def make_router(cfg: Config) -> Router | RemoteRouter:
    """The run's reward router: local verifier workers, or (`reward.remote_url`) remote reward
    servers."""
    r = cfg.reward
    if r.remote_url:
        from mmrl.server.client import RemoteRouter

        return RemoteRouter(
            r.remote_url, time_limit_s=r.time_limit_s, plugins=r.plugins, batch_size=r.remote_batch_size
        )
    return Router(r.num_workers, r.time_limit_s, r.plugins, answer_limits=r.answer_limits)

"""The Hugging Face hub, asked once: is an id there, is it cached, is the hub reachable at all.

transformers and datasets retry an unreachable hub file by file with back-off (measured: 162 s
and ~60 warning lines before a model failed, 222 s for `mmrl eval`). mmrl asks first, once, with
a short time-out (`MMRL_HUB_TIMEOUT`, seconds, default `DEFAULT_TIMEOUT_S`): an unreachable hub
then ends in one clear error that says what to do (`HF_HUB_OFFLINE=1`, or a local folder), or,
for a model already in the local cache, in loading that copy without asking the hub again.

Nothing here imports huggingface_hub at module level (`mmrl check` and `--help` stay light).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
"""Seconds the one hub request waits for an answer when `MMRL_HUB_TIMEOUT` is not set."""

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""A hub repository id: `name` or `org/name`."""


def hub_offline() -> bool:
    """Whether huggingface_hub is told not to reach the hub (`HF_HUB_OFFLINE`)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_timeout_s() -> float:
    """`MMRL_HUB_TIMEOUT` (seconds), else `DEFAULT_TIMEOUT_S`; a bad value is an error naming it."""
    raw = os.environ.get("MMRL_HUB_TIMEOUT", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"MMRL_HUB_TIMEOUT={raw!r}: expected a number of seconds") from None
    if value <= 0:
        raise ValueError(f"MMRL_HUB_TIMEOUT={raw!r}: must be > 0 seconds")
    return value


def hub_endpoint() -> str:
    """The hub's address (`HF_ENDPOINT`, else huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def is_cached(repo_id: str, repo_type: str = "model", revision: str | None = None) -> bool:
    """Whether the local hub cache holds `repo_id` (a model's `config.json` at `revision`; for a
    dataset, any snapshot of the repo)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if repo_type == "model":
        found = try_to_load_from_cache(repo_id, "config.json", revision=revision, repo_type="model")
        return isinstance(found, str)
    folder = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots"
    return folder.is_dir() and any(folder.iterdir())


@dataclass
class HubAnswer:
    """What the hub said about one repository."""

    state: str
    """`found`, `missing` (no such repository or revision, or gated: `detail` says which) or
    `unreachable` (no answer within the time-out, or no connection)."""
    detail: str = ""
    """The cause, in one line."""


def ask_hub(repo_id: str, repo_type: str = "model", revision: str | None = None) -> HubAnswer:
    """One request (no retries) for the repository's info, waiting `hub_timeout_s()` at most.

    It goes out without huggingface_hub's telemetry: building a request's user agent otherwise
    first fetches the hub's agent-harness registry (once a day, with a 3 s time-out of its own),
    a second wait on a hub that does not answer (`mmrl check` ended after 9.7 s; 6.5 s without)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi()
    info = api.model_info if repo_type == "model" else api.dataset_info
    was_disabled = constants.HF_HUB_DISABLE_TELEMETRY
    constants.HF_HUB_DISABLE_TELEMETRY = True
    try:
        info(repo_id, revision=revision, timeout=hub_timeout_s())
    except GatedRepoError:
        return HubAnswer("missing", "gated: accept its conditions on the hub and log in (`hf auth login`)")
    except RevisionNotFoundError:
        return HubAnswer("missing", f"no revision {revision!r}")
    except RepositoryNotFoundError:
        return HubAnswer("missing", "no such repository (or a private one: log in with `hf auth login`)")
    except Exception as exc:  # noqa: BLE001 - timeouts, refused connections, DNS, TLS: all "unreachable"
        return HubAnswer("unreachable", f"{type(exc).__name__}: {exc}".splitlines()[0])
    finally:
        constants.HF_HUB_DISABLE_TELEMETRY = was_disabled
    return HubAnswer("found")


def unreachable_message(what: str, answer: HubAnswer) -> str:
    """The error for a hub that did not answer: what was asked, where, why, and what to do."""
    return (
        f"{what}: the hub at {hub_endpoint()} did not answer within {hub_timeout_s():g} s ({answer.detail}). "
        "Set HF_HUB_OFFLINE=1 to use only the local cache, or pass a local folder instead "
        "(MMRL_HUB_TIMEOUT sets the wait, in seconds)"
    )

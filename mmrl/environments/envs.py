"""Environments: a sample's trajectory acting in a Gymnasium-style env, one model turn per step.

    session = EnvSession(EnvSpec(id="minigrid-empty-5x5"))       # this trajectory's own env
    first = reset_sessions([session], [seed], limits)[0]           # the first user turn
    steps = step_sessions([session], [model_text], limits)         # one action per model turn
    steps[0].observation, steps[0].reward, steps[0].terminated, steps[0].error
    session.close()

An env id is an mmrl-registered name (`register_env`, `env_names`: the MiniGrid tasks of
`mmrl.environments.minigrid_env` register on import) or else a Gymnasium id, made with
`gymnasium.make(id, render_mode="rgb_array", **kwargs)`. A Gymnasium env of the user's own is
known once its module is imported (`agent.plugins`), or named as `"module:EnvId"`.

Each turn, an *action adapter* `(env, text) -> action` turns the model's text into the env's
action and an *observation adapter* `(env, obs, info) -> Observation` turns the env's
observation into the next user turn (text and images). The defaults (`default_action`,
`default_observation`) fit most envs; a registered env or a session may bring its own.

Failures are observations, never a crash of the caller or a hang (`EnvStep.error`):

- 'bad_action': the text named no valid action; the env is NOT stepped, the trajectory goes on.
- 'env_error': the env (or an adapter) raised; the trajectory ends (terminated).
- 'env_timeout': the env did not answer within `ToolLimits.timeout_s`; the trajectory ends and
  the env is abandoned (its thread cannot be killed; the session never touches it again).
- 'episode_over': a step asked of an episode that already ended; nothing is run.
- 'text_too_long': the observation's text was cut (images too large or too many are capped as
  for tools, `apply_limits`, noted in the text); the trajectory goes on.

Each session records the actions that stepped its env (`EnvSession.actions`, JSON-able), so a
trajectory is re-created exactly from its seed and actions (`EnvSession.replay`), e.g. on resume.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import enum
import importlib
import logging
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from mmrl.environments.executor import _error_text, apply_limits
from mmrl.environments.tools import _POOL, Observation, ToolLimits, to_observation
from mmrl.types import EnvSpec

log = logging.getLogger(__name__)

ObservationAdapter = Callable[[Any, Any, dict[str, Any]], Any]
"""`(env, obs, info) -> Observation` (or anything `to_observation` reads: a str, an image, a
(text, images) tuple, a dict with "text" and "image"/"images")."""
ActionAdapter = Callable[[Any, str], Any]
"""`(env, text) -> action`; raises ValueError, naming the valid actions, for a malformed one."""
EnvFactory = Callable[..., Any]
"""`factory(**kwargs) -> env`: an object with Gymnasium 1.x's `reset(seed=...) -> (obs, info)`,
`step(action) -> (obs, reward, terminated, truncated, info)` and `close()`."""

ERROR_KINDS = ("bad_action", "env_error", "env_timeout", "episode_over", "text_too_long")
"""Every value `EnvStep.error` takes besides None."""
ENDING_ERRORS = ("env_error", "env_timeout")
"""The error kinds that end a trajectory."""


@dataclass
class EnvStep:
    """What one model turn did to its environment."""

    observation: Observation
    """The next user turn (text and images); for an error, a short message naming what was wrong
    (its `error`, `reward` and `seconds` agree with this step's)."""
    reward: float = 0.0
    """The env's reward for this step (0 when the env was not stepped)."""
    terminated: bool = False
    """The episode ended in the env (goal, failure), or the env crashed or hung."""
    truncated: bool = False
    """The episode was cut short (a time limit of the env's own)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The env's info dict of this step."""
    error: str | None = None
    """None, or one of `ERROR_KINDS`."""
    action: Any = None
    """The action the env was stepped with (JSON-able), None if it was not stepped."""

    @property
    def done(self) -> bool:
        """The trajectory ends here (terminated or truncated)."""
        return self.terminated or self.truncated


class UnknownEnvError(ValueError):
    """An env id that is neither an mmrl-registered name nor a Gymnasium id."""


# ---------------------------------------------------------------------------------------------
# Registry


@dataclass
class EnvEntry:
    """One mmrl-registered environment."""

    name: str
    factory: EnvFactory
    observation: ObservationAdapter | None = None
    """Its observation adapter; None: `default_observation`."""
    action: ActionAdapter | None = None
    """Its action adapter; None: `default_action`."""


@dataclass
class _GymFamily:
    prefix: str
    observation: ObservationAdapter | None
    action: ActionAdapter | None
    load: Callable[[], Any] | None


_ENVS: dict[str, EnvEntry] = {}
_FAMILIES: list[_GymFamily] = []


def register_env(
    name: str,
    factory: EnvFactory,
    *,
    observation: ObservationAdapter | None = None,
    action: ActionAdapter | None = None,
    replace: bool = False,
) -> EnvFactory:
    """Register an environment under `name`: a sample's `EnvSpec(id=name, kwargs=...)` makes its
    env as `factory(**kwargs)`, read through the given adapters (None: the defaults).

    ValueError if `name` is taken (unless `replace`). Returns `factory`."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"an environment needs a non-empty name, got {name!r}")
    if not callable(factory):
        raise TypeError(f"the factory of environment {name!r} is not callable: {factory!r}")
    if name in _ENVS and not replace:
        raise ValueError(f"environment {name!r} is already registered")
    _ENVS[name] = EnvEntry(name, factory, observation, action)
    return factory


def unregister_env(name: str) -> None:
    """Remove an mmrl-registered environment (no error if absent); for tests and reloads."""
    _ENVS.pop(name, None)


def env_names() -> list[str]:
    """The mmrl-registered environment names, sorted (Gymnasium's ids are not listed)."""
    return sorted(_ENVS)


def register_gym_family(
    prefix: str,
    *,
    observation: ObservationAdapter | None = None,
    action: ActionAdapter | None = None,
    load: Callable[[], Any] | None = None,
) -> None:
    """Adapters for the Gymnasium ids that start with `prefix` (e.g. "MiniGrid-"), used when a
    sample names such an id directly; `load()` is called first to register the ids (an import).
    A later registration of the same prefix replaces the earlier one."""
    _FAMILIES[:] = [f for f in _FAMILIES if f.prefix != prefix]
    _FAMILIES.append(_GymFamily(prefix, observation, action, load))


def _family(name: str) -> _GymFamily | None:
    for family in _FAMILIES:
        if name.startswith(family.prefix):
            return family
    return None


def _gym_lookup(env_id: str) -> tuple[str | None, str]:
    """The registered Gymnasium id that `env_id` names (None if none) and, if none, why.

    "module:EnvId" imports `module` first (as `gymnasium.make` does); an id of a registered
    family loads the family; an id without a version takes the highest registered one."""
    import gymnasium
    from gymnasium.envs.registration import find_highest_version, get_env_id, parse_env_id

    module, name = env_id.split(":", 1) if ":" in env_id else (None, env_id)
    if module:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return None, f"importing module {module!r} failed ({_error_text(exc, 200)})"
    family = _family(name)
    if family is not None and family.load is not None and name not in gymnasium.registry:
        try:
            family.load()
        except ImportError as exc:
            return None, f"loading the {family.prefix}* environments failed ({_error_text(exc, 200)})"
    if name in gymnasium.registry:
        return name, ""
    try:
        namespace, base, version = parse_env_id(name)
    except Exception:  # noqa: BLE001 - a malformed id is just unknown
        return None, ""
    if version is None:
        latest = find_highest_version(namespace, base)
        if latest is not None:
            return get_env_id(namespace, base, latest), ""
    return None, ""


def env_known(env_id: str) -> bool:
    """Whether `env_id` is an mmrl-registered name or an id in Gymnasium's registry (a
    "module:EnvId" imports its module to find out)."""
    return env_id in _ENVS or _gym_lookup(env_id)[0] is not None


def _unknown_message(env_id: str, problem: str = "") -> str:
    import gymnasium

    names = env_names()
    gym_ids = sorted(gymnasium.registry)
    by_lower = {n.lower(): n for n in [*gym_ids, *names]}
    close = [by_lower[c] for c in difflib.get_close_matches(env_id.lower(), list(by_lower), n=5, cutoff=0.6)]
    message = (
        f"unknown environment {env_id!r}: neither an mmrl environment (registered: "
        f"{', '.join(names) or 'none'}) nor a Gymnasium id ({len(gym_ids)} registered; "
        "gymnasium.pprint_registry() lists them)"
    )
    if problem:
        message += f"; {problem}"
    message += (
        ". A Gymnasium env of your own is known once its module is imported (agent.plugins), "
        "or named as 'module:EnvId'."
    )
    return message + (f" Did you mean: {', '.join(close)}?" if close else "")


def _gym_renders_rgb(gym_id: str) -> bool | None:
    """Whether the Gymnasium env's class lists the 'rgb_array' render mode (None: unknown)."""
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    spec = gymnasium.registry[gym_id]
    try:
        creator = spec.entry_point if callable(spec.entry_point) else load_env_creator(spec.entry_point)
    except Exception:  # noqa: BLE001 - make reports it
        return None
    metadata = getattr(creator, "metadata", None)
    if not isinstance(metadata, dict):
        return None
    return "rgb_array" in (metadata.get("render_modes") or ())


def make_env(spec: EnvSpec) -> tuple[Any, ObservationAdapter | None, ActionAdapter | None]:
    """A new env instance for `spec` and its registered adapters (None: the defaults).

    mmrl's registry first (`factory(**spec.kwargs)`), else `gymnasium.make(id,
    render_mode="rgb_array", **spec.kwargs)` (no render mode where the env lists none, and a
    `render_mode` in the kwargs wins). `UnknownEnvError` for an unknown id; the env's own
    exceptions (bad kwargs) propagate, with the id in the message."""
    entry = _ENVS.get(spec.id)
    if entry is not None:
        try:
            return entry.factory(**dict(spec.kwargs)), entry.observation, entry.action
        except Exception as exc:
            message = f"making environment {spec.id!r} with {dict(spec.kwargs)}: {exc}"
            try:
                named = type(exc)(message)
            except Exception:  # noqa: BLE001 - an exception type that takes other arguments
                raise exc from None
            raise named from exc
    gym_id, problem = _gym_lookup(spec.id)
    if gym_id is None:
        raise UnknownEnvError(_unknown_message(spec.id, problem))
    import gymnasium

    kwargs = dict(spec.kwargs)
    renders = _gym_renders_rgb(gym_id)
    if "render_mode" not in kwargs and renders is not False:
        kwargs["render_mode"] = "rgb_array"
    try:
        env = gymnasium.make(gym_id, **kwargs)
    except TypeError as exc:
        if renders is not None or "render_mode" in spec.kwargs or "render_mode" not in str(exc):
            raise
        kwargs.pop("render_mode")  # a creator that lists no render modes and takes none
        env = gymnasium.make(gym_id, **kwargs)
    family = _family(gym_id)
    return env, (family.observation if family else None), (family.action if family else None)


# ---------------------------------------------------------------------------------------------
# The default adapters


def _is_image(value: Any) -> bool:
    """An RGB(A) picture: a PIL image, or a uint8 ndarray of shape HxWx3 or HxWx4."""
    if isinstance(value, Image.Image):
        return True
    return (
        isinstance(value, np.ndarray)
        and value.dtype == np.uint8
        and value.ndim == 3
        and value.shape[2] in (3, 4)
        and value.shape[0] > 0
        and value.shape[1] > 0
    )


def _to_image(value: Any) -> Image.Image:
    if isinstance(value, np.ndarray):
        value = Image.fromarray(np.ascontiguousarray(value[..., :3]))
    return value if value.mode == "RGB" else value.convert("RGB")


def _short(value: Any, limit: int = 300) -> str:
    """A plain value as short text (arrays rounded and elided)."""
    if isinstance(value, (np.ndarray, np.generic)):
        text = np.array2string(np.asarray(value), precision=4, threshold=64, separator=", ")
    elif isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, tuple)):
        inner = ", ".join(_short(v, limit) for v in value)
        text = f"[{inner}]" if isinstance(value, list) else f"({inner})"
    else:
        text = str(value)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _render_frame(env: Any) -> Image.Image | None:
    if getattr(env, "render_mode", None) not in ("rgb_array", "rgb_array_list"):
        return None
    frame = env.render()
    if isinstance(frame, list):
        frame = frame[-1] if frame else None
    return _to_image(frame) if _is_image(frame) else None


TEXT_KEYS = ("mission", "text")
"""Entries of a dict observation read as its text, in this order."""


def default_observation(env: Any, obs: Any, info: dict[str, Any]) -> Observation:
    """The next user turn for an observation: its image, else the env's rendered frame; its text.

    - an image (HxWx3/4 uint8 ndarray or PIL image): that image, no text;
    - a dict: its 'image' entry if it is an image, its 'mission' and 'text' entries as text, and
      every other entry as "key: value" (short);
    - a str: that text; any other value (numbers, vectors): short text;
    - no image in the observation and `env.render_mode == "rgb_array"`: the rendered frame."""
    texts: list[str] = []
    images: list[Image.Image] = []
    if isinstance(obs, dict):
        texts += [str(obs[key]) for key in TEXT_KEYS if isinstance(obs.get(key), str) and obs[key]]
        if _is_image(obs.get("image")):
            images.append(_to_image(obs["image"]))
        texts += [
            f"{key}: {_short(value)}"
            for key, value in obs.items()
            if key not in TEXT_KEYS and not (key == "image" and images)
        ]
    elif _is_image(obs):
        images.append(_to_image(obs))
    elif isinstance(obs, str):
        texts.append(obs)
    elif obs is not None:
        texts.append(_short(obs))
    if not images:
        frame = _render_frame(env)
        if frame is not None:
            images.append(frame)
    return Observation(text="\n".join(texts), images=images)


_OPEN = re.compile(r"<action>", re.IGNORECASE)
_CLOSE = re.compile(r"</action>", re.IGNORECASE)
_WORD = re.compile(r"[-+]?\d+(?:\.\d+)?|[A-Za-z_][\w-]*")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def tagged_action(text: str) -> str | None:
    """The text inside the last `<action>...</action>` (an unclosed last tag: to the end), or None."""
    opens = list(_OPEN.finditer(text))
    if not opens:
        return None
    rest = text[opens[-1].end() :]
    close = _CLOSE.search(rest)
    return (rest[: close.start()] if close else rest).strip()


def _last_word(text: str) -> str | None:
    words = _WORD.findall(text)
    return words[-1] if words else None


def action_words(env: Any) -> dict[str, Any]:
    """The env's action names -> actions: its (or a wrapper's) `action_words` attribute (a dict
    word -> action, or a list whose i-th word is action i), else the members of its `actions`
    Enum (MiniGrid's `Actions`: name -> value), else `get_action_meanings()` (-> index), else {}."""
    getter = getattr(env, "get_wrapper_attr", None)
    try:
        words = getter("action_words") if getter is not None else getattr(env, "action_words", None)
    except AttributeError:
        words = None
    if words:
        return dict(words) if isinstance(words, dict) else {str(w): i for i, w in enumerate(words)}
    base = getattr(env, "unwrapped", env)
    actions = getattr(base, "actions", None)
    if isinstance(actions, type) and issubclass(actions, enum.Enum):
        return {member.name: member.value for member in actions}
    meanings = getattr(base, "get_action_meanings", None)
    if callable(meanings):
        try:
            return {str(name): i for i, name in enumerate(meanings())}
        except Exception:  # noqa: BLE001 - an env without meanings after all
            return {}
    return {}


def _norm(word: str) -> str:
    return re.sub(r"[\s\-]+", "_", word.strip().lower())


def default_action(env: Any, text: str) -> Any:
    """The env's action for the model's text (ValueError naming the valid actions if none).

    The text read is the one inside the last `<action>...</action>` if any, else the last word.
    It matches, case-insensitively, one of `action_words(env)`, or an integer of a `Discrete`
    space (only the words' actions where the env names them). A Box, MultiDiscrete or
    MultiBinary space takes the numbers inside the tag (else on the last line), as many as the
    space has entries, within its bounds. TypeError for any other space (give an adapter)."""
    from gymnasium import spaces

    space = getattr(env, "action_space", None)
    words = action_words(env)
    tagged = tagged_action(text)
    if words or isinstance(space, spaces.Discrete):
        by_name = {_norm(name): action for name, action in words.items()}
        if words:
            allowed = {int(a) for a in words.values() if isinstance(a, (int, np.integer))}
            valid = ", ".join(words)
        else:
            start, n = int(space.start), int(space.n)
            allowed = set(range(start, start + n))
            valid = f"an integer from {start} to {start + n - 1}"
        last = _last_word(tagged if tagged is not None else text)
        for candidate in dict.fromkeys(c for c in (tagged, last) if c):
            key = _norm(candidate)
            if key in by_name:
                return by_name[key]
            if re.fullmatch(r"[-+]?\d+", key) and int(key) in allowed:
                return int(key)
        if not (tagged or last):
            raise ValueError(f"no action found in the reply; valid actions: {valid}.")
        shown = tagged or last or ""
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise ValueError(f"{shown!r} is not a valid action; valid actions: {valid}.")
    if isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
        return _numeric_action(space, tagged, text)
    raise TypeError(
        f"the default action adapter does not read a {type(space).__name__} action space: "
        "register the environment with its own action adapter (action=...)"
    )


def _numeric_action(space: Any, tagged: str | None, text: str) -> np.ndarray:
    from gymnasium import spaces

    lines = text.strip().splitlines()
    source = tagged if tagged is not None else (lines[-1] if lines else "")
    size = int(np.prod(space.shape))
    if isinstance(space, spaces.Box):
        low, high = np.min(space.low), np.max(space.high)
        valid = f"{size} number(s) within [{low:g}, {high:g}], shape {tuple(space.shape)}"
    elif isinstance(space, spaces.MultiBinary):
        valid = f"{size} integer(s), each 0 or 1"
    else:
        valid = f"{size} integer(s), the i-th from 0 to nvec[i] - 1 (nvec {np.asarray(space.nvec).tolist()})"
    numbers = _NUMBER.findall(source)
    if len(numbers) != size:
        raise ValueError(f"expected {size} number(s), found {len(numbers)}; a valid action is {valid}.")
    values = np.asarray([float(n) for n in numbers], dtype=np.float64)
    if np.issubdtype(space.dtype, np.integer) and not np.all(values == np.round(values)):
        raise ValueError(f"expected integers; a valid action is {valid}.")
    action = values.reshape(space.shape).astype(space.dtype)
    if not space.contains(action):
        raise ValueError(f"{_short(action.tolist(), 60)} is out of bounds; a valid action is {valid}.")
    return action


# ---------------------------------------------------------------------------------------------
# Actions as plain values (for the history, JSON and replay)


def _plain(action: Any) -> Any:
    """An action as a JSON-able value (enum -> its value, numpy -> Python)."""
    if isinstance(action, enum.Enum):
        action = action.value
    if isinstance(action, np.generic):
        return action.item()
    if isinstance(action, np.ndarray):
        return action.tolist()
    if isinstance(action, tuple):
        return [_plain(a) for a in action]
    return action


def _from_plain(space: Any, action: Any) -> Any:
    """A plain action as the env's space takes it (arrays for Box-like spaces)."""
    from gymnasium import spaces

    if isinstance(space, (spaces.Box, spaces.MultiDiscrete, spaces.MultiBinary)):
        return np.asarray(action, dtype=space.dtype).reshape(space.shape)
    if isinstance(space, spaces.Discrete):
        return int(action)
    return action


# ---------------------------------------------------------------------------------------------
# Sessions

_NOT_STEPPED = object()


def _failure(kind: str, text: str, seconds: float = 0.0) -> EnvStep:
    """A step that ended the trajectory ('env_error', 'env_timeout'), or ran nothing."""
    ends = kind in ENDING_ERRORS or kind == "episode_over"
    return EnvStep(
        observation=Observation(text=text, error=kind, seconds=seconds),
        terminated=ends,
        error=kind,
    )


class EnvSession:
    """One trajectory's own environment instance, made from an `EnvSpec`.

    `reset(seed)` gives the first observation, `step(text)` one turn; `close()` at the end (or
    use it as a context manager). Not thread-safe: one call at a time per session (the
    concurrent, time-limited entries are `reset_sessions` and `step_sessions`).

    Bookkeeping of the current episode: `seed`, `actions` (every action that stepped the env,
    JSON-able, in order), `rewards` (per step), `errors` (a Counter of error kinds), `done` and
    `ended` ('terminated', 'truncated', 'env_error' or 'env_timeout')."""

    def __init__(
        self,
        spec: EnvSpec | str,
        *,
        observation: ObservationAdapter | None = None,
        action: ActionAdapter | None = None,
    ) -> None:
        """Make the env (`make_env`): `UnknownEnvError` for an unknown id; the env's own errors
        (bad kwargs) propagate. `observation`/`action` override the registered adapters."""
        self.spec = EnvSpec(id=spec) if isinstance(spec, str) else spec
        self.env, registered_obs, registered_action = make_env(self.spec)
        self.observation_adapter: ObservationAdapter = observation or registered_obs or default_observation
        self.action_adapter: ActionAdapter = action or registered_action or default_action
        self.seed: int | None = None
        self.actions: list[Any] = []
        self.rewards: list[float] = []
        self.errors: Counter[str] = Counter()
        self.done = False
        self.ended: str | None = None
        self.abandoned = False
        """The env hung past a time limit: its thread may still run in it, so it is never used again."""
        self._closed = False

    # -- what this episode did

    @property
    def episode_return(self) -> float:
        """The sum of this episode's rewards so far."""
        return float(sum(self.rewards))

    @property
    def steps(self) -> int:
        """How many times the env was stepped this episode."""
        return len(self.actions)

    def history(self) -> dict[str, Any]:
        """The episode as JSON-able data: `{"seed": ..., "actions": [...]}` (for `replay`)."""
        return {"seed": self.seed, "actions": list(self.actions)}

    # -- the work (touches only the env; runs in a worker thread under step_sessions)

    def _observe(self, obs: Any, info: Any) -> Observation:
        info = info if isinstance(info, dict) else {}
        out = to_observation(self.observation_adapter(self.env, obs, info))
        return Observation(
            text=out.text, images=list(out.images), error=out.error, reward=out.reward, metrics=out.metrics
        )

    def _do_reset(self, seed: int | None) -> EnvStep:
        start = time.perf_counter()
        try:
            obs, info = self.env.reset(seed=seed)
            observation = self._observe(obs, info)
        except Exception as exc:  # noqa: BLE001 - an env's failure ends its trajectory, never the run
            log.debug("env %s failed to reset", self.spec.id, exc_info=True)
            return _failure(
                "env_error", f"the environment failed: {_error_text(exc)}", time.perf_counter() - start
            )
        observation.seconds = time.perf_counter() - start
        return EnvStep(observation=observation, info=dict(info) if isinstance(info, dict) else {})

    def _do_action(self, action: Any, start: float) -> tuple[EnvStep, Any]:
        try:
            plain = _plain(action)
            obs, reward, terminated, truncated, info = self.env.step(
                _from_plain(getattr(self.env, "action_space", None), plain)
            )
            reward = float(reward)
            if not math.isfinite(reward):
                raise ValueError(f"the environment returned a non-finite reward ({reward})")
            observation = self._observe(obs, info)
        except Exception as exc:  # noqa: BLE001 - an env's failure ends its trajectory, never the run
            log.debug("env %s failed to step", self.spec.id, exc_info=True)
            return (
                _failure(
                    "env_error", f"the environment failed: {_error_text(exc)}", time.perf_counter() - start
                ),
                _NOT_STEPPED,
            )
        observation.reward = reward
        observation.seconds = time.perf_counter() - start
        step = EnvStep(
            observation=observation,
            reward=reward,
            terminated=bool(terminated),
            truncated=bool(truncated),
            info=dict(info) if isinstance(info, dict) else {},
            action=plain,
        )
        return step, plain

    def _do_step(self, text: str) -> tuple[EnvStep, Any]:
        start = time.perf_counter()
        try:
            action = self.action_adapter(self.env, text)
        except ValueError as exc:
            message = str(exc) or "malformed action"
            return EnvStep(
                observation=Observation(text=message, error="bad_action"), error="bad_action"
            ), _NOT_STEPPED
        except Exception as exc:  # noqa: BLE001 - a broken adapter ends the trajectory
            return (
                _failure(
                    "env_error", f"the action adapter failed: {_error_text(exc)}", time.perf_counter() - start
                ),
                _NOT_STEPPED,
            )
        return self._do_action(action, start)

    # -- the bookkeeping (the caller's thread)

    def _refuse_step(self) -> EnvStep | None:
        if self.abandoned:
            return _failure("env_timeout", "the environment stopped answering; the episode is over.")
        if self.done:
            return _failure("episode_over", f"the episode is over ({self.ended}); nothing was done.")
        return None

    def _refuse_reset(self) -> EnvStep | None:
        if self.abandoned:
            return _failure("env_timeout", "the environment stopped answering; it cannot be reset.")
        return None

    def _commit_reset(self, seed: int | None, step: EnvStep) -> Observation:
        if step.error in ENDING_ERRORS:
            self.abandoned = self.abandoned or step.error == "env_timeout"
            self.done, self.ended = True, step.error
        else:
            self.done, self.ended = False, None
        self.seed = seed
        self.actions, self.rewards = [], []
        self.errors = Counter()
        if step.observation.error:
            self.errors[step.observation.error] += 1
        return step.observation

    def _commit_step(self, step: EnvStep, action: Any) -> EnvStep:
        if step.error:
            self.errors[step.error] += 1
        if action is not _NOT_STEPPED:
            self.actions.append(action)
            self.rewards.append(step.reward)
        if step.error == "env_timeout":
            self.abandoned = True
        if step.done and not self.done:
            self.done = True
            if step.error in ENDING_ERRORS:
                self.ended = step.error
            else:
                self.ended = "terminated" if step.terminated else "truncated"
        return step

    # -- the sync entries

    def reset(self, seed: int | None = None, limits: ToolLimits | None = None) -> Observation:
        """Start a new episode: the first observation (capped by `limits` if given).

        `seed` None: the spec's seed (None there too: the env's own randomness, not replayable).
        A failing env gives an 'env_error' observation and a done session. No time limit here:
        `reset_sessions` has one."""
        seed = self.spec.seed if seed is None else seed
        step = self._refuse_reset() or self._do_reset(seed)
        if limits is not None:
            _cap([step], limits)
        return self._commit_reset(seed, step)

    def step(self, text: str, limits: ToolLimits | None = None) -> EnvStep:
        """One model turn: `text` through the action adapter, then the env's step (a malformed
        action does not step it: 'bad_action'). Capped by `limits` if given. Never raises for
        what the env or the text does. No time limit here: `step_sessions` has one."""
        refused = self._refuse_step()
        step, action = (refused, _NOT_STEPPED) if refused is not None else self._do_step(text)
        if limits is not None:
            _cap([step], limits)
        return self._commit_step(step, action)

    def close(self) -> None:
        """Close the env (once; its errors are logged, not raised). An abandoned env (it hung) is
        left alone: its thread may still be inside it."""
        if self._closed:
            return
        self._closed = True
        if self.abandoned:
            log.debug("env %s hung; not closing it", self.spec.id)
            return
        try:
            self.env.close()
        except Exception:  # noqa: BLE001 - closing must not end the run
            log.warning("closing env %s failed", self.spec.id, exc_info=True)

    def __enter__(self) -> EnvSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = self.ended or ("running" if self.seed is not None or self.actions else "new")
        return f"EnvSession({self.spec.id!r}, seed={self.seed}, steps={self.steps}, {state})"

    @classmethod
    def replay(
        cls,
        spec: EnvSpec | str,
        seed: int | None,
        actions: Sequence[Any],
        *,
        observation: ObservationAdapter | None = None,
        action: ActionAdapter | None = None,
        limits: ToolLimits | None = None,
    ) -> tuple[EnvSession, Observation]:
        """A new session re-created from an episode's seed and actions (`history()`): reset with
        `seed`, then stepped with each action directly (no adapter). Returns it and the last
        observation (the first one if `actions` is empty), capped by `limits` if given.

        Exact for an env that is deterministic given its seed. RuntimeError if the env fails
        or the episode ends before the last action (the env was not deterministic)."""
        session = cls(spec, observation=observation, action=action)
        try:
            obs = session.reset(seed, limits)
            if obs.error in ENDING_ERRORS:
                raise RuntimeError(f"replaying {session.spec.id!r}: reset failed: {obs.text}")
            for n, act in enumerate(actions):
                if session.done:
                    raise RuntimeError(
                        f"replaying {session.spec.id!r}: the episode ended ({session.ended}) after "
                        f"{n} of {len(actions)} actions"
                    )
                step, plain = session._do_action(act, time.perf_counter())
                if limits is not None:
                    _cap([step], limits)
                session._commit_step(step, plain)
                if step.error in ENDING_ERRORS:
                    raise RuntimeError(f"replaying {session.spec.id!r}: action {n}: {step.observation.text}")
                obs = step.observation
        except BaseException:
            session.close()
            raise
        return session, obs


# ---------------------------------------------------------------------------------------------
# Many sessions at once: threads, time limits, caps


def _cap(steps: Sequence[EnvStep], limits: ToolLimits) -> None:
    """Cap each step's observation as tools' are (`apply_limits`); large images are downscaled
    in the worker threads (concurrently), the rest inline. A cut text sets the step's error."""
    needs_pool = [
        step
        for step in steps
        if any(
            im.width * im.height > limits.max_image_pixels
            for im in step.observation.images[: limits.max_images]
        )
    ]
    futures = [_POOL.submit(apply_limits, step.observation, limits) for step in needs_pool]
    for step, future in zip(needs_pool, futures):
        step.observation = future.result()
    pooled = {id(step) for step in needs_pool}
    for step in steps:
        if id(step) not in pooled:
            step.observation = apply_limits(step.observation, limits)
        if step.error is None and step.observation.error is not None:
            step.error = step.observation.error


def _run_guarded(
    sessions: Sequence[EnvSession],
    refusals: list[EnvStep | None],
    work: list[Callable[[], tuple[EnvStep, Any]]],
    limits: ToolLimits,
) -> list[tuple[EnvStep, Any]]:
    """Run each session's work in the daemon pool, all under one deadline `limits.timeout_s`
    from now: a step past it is 'env_timeout' (its thread abandoned). Then the caps."""
    results: list[tuple[EnvStep, Any] | None] = [
        (refused, _NOT_STEPPED) if refused is not None else None for refused in refusals
    ]
    start = time.perf_counter()
    futures = {i: _POOL.submit(fn) for i, fn in enumerate(work) if results[i] is None}
    done, _ = concurrent.futures.wait(list(futures.values()), timeout=limits.timeout_s)
    seconds = time.perf_counter() - start
    for i, future in futures.items():
        if future in done:
            exc = future.exception()
            if exc is None:
                results[i] = future.result()
            else:  # only a BaseException the pool turned into an error gets here
                results[i] = (
                    _failure("env_error", f"the environment failed: {_error_text(exc)}"),
                    _NOT_STEPPED,
                )
        else:
            future.cancel()  # a job still queued never runs; a running one is abandoned
            log.warning("env %s did not answer within %g s", sessions[i].spec.id, limits.timeout_s)
            results[i] = (
                _failure(
                    "env_timeout",
                    f"the environment did not answer within {limits.timeout_s:g} s; the episode is over.",
                    seconds,
                ),
                _NOT_STEPPED,
            )
    out = [r for r in results if r is not None]
    _cap([step for step, _ in out], limits)
    return out


def _check_sessions(sessions: Sequence[EnvSession], others: Sequence[Any], what: str) -> None:
    if len(sessions) != len(others):
        raise ValueError(f"{len(sessions)} sessions but {len(others)} {what}")
    if len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("a session appears more than once")


def reset_sessions(
    sessions: Sequence[EnvSession],
    seeds: Sequence[int | None] | None = None,
    limits: ToolLimits | None = None,
) -> list[Observation]:
    """Reset every session concurrently (threads), each under `limits.timeout_s`: the first
    observations, capped. A failing env gives an 'env_error' observation, a hung one an
    'env_timeout' one; either leaves its session done. Seeds None: each spec's seed."""
    limits = limits or ToolLimits()
    seeds = list(seeds) if seeds is not None else [None] * len(sessions)
    _check_sessions(sessions, seeds, "seeds")
    seeds = [s.spec.seed if seed is None else seed for s, seed in zip(sessions, seeds)]
    work = [lambda s=s, seed=seed: (s._do_reset(seed), _NOT_STEPPED) for s, seed in zip(sessions, seeds)]
    results = _run_guarded(sessions, [s._refuse_reset() for s in sessions], work, limits)
    return [s._commit_reset(seed, step) for s, seed, (step, _) in zip(sessions, seeds, results)]


def step_sessions(
    sessions: Sequence[EnvSession], texts: Sequence[str], limits: ToolLimits | None = None
) -> list[EnvStep]:
    """Step every session with its model turn's text, concurrently (threads), each under
    `limits.timeout_s`; one `EnvStep` per session, in order, observations capped as tools' are.

    Never raises for what an env or a text does and never hangs: a malformed action is
    'bad_action' (env not stepped, trajectory goes on), an env that raises is 'env_error' with
    its message and one past the time limit 'env_timeout' (both end the trajectory: terminated).
    Each session at most once per call."""
    limits = limits or ToolLimits()
    _check_sessions(sessions, texts, "texts")
    work = [lambda s=s, text=text: s._do_step(text) for s, text in zip(sessions, texts)]
    results = _run_guarded(sessions, [s._refuse_step() for s in sessions], work, limits)
    return [s._commit_step(step, action) for s, (step, action) in zip(sessions, results)]

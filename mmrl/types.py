"""The few data types shared across mmrl: samples, verifier results, rollouts.

`Sample` follows V-Triune's sample-level format, so their records load unchanged:

    {"data_source": "...", "prompt": [{"role": "user", "content": "<image>Question"}],
     "images": [...], "ability": "...",
     "reward_model": {"ground_truth": "...", "verifier": "math", "verifier_params": {},
                      "accuracy_ratio": 1.0, "format_ratio": 0.0},
     "extra_info": {"id": "..."}}
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

if TYPE_CHECKING:  # annotations only: `import mmrl.types` stays free of torch (config errors are instant)
    from collections.abc import Callable

    import torch

IMAGE_PLACEHOLDER = "<image>"

ImageSource = Image.Image | bytes | str
"""An image as a decoded PIL image, encoded bytes, or a path on disk."""


@dataclass
class RewardSpec:
    """How a sample is scored: V-Triune's `reward_model` field."""

    ground_truth: Any
    """The reference answer; its form depends on the verifier (a string for `math`)."""
    verifier: str
    """Name of a registered verifier (see `mmrl.verifiers.registry`)."""
    verifier_params: dict[str, Any] = field(default_factory=dict)
    """Per-sample options for the verifier."""
    accuracy_ratio: float = 1.0
    """Weight of the verifier's accuracy component in the final reward."""
    format_ratio: float = 0.0
    """Weight of the verifier's format component in the final reward."""
    models: list[dict[str, Any]] = field(default_factory=list)
    """Model-based rewards that also score the sample: `{"name", "weight", "params"}` entries
    naming reward models configured for the run (`reward.models`); see `mmrl.rewards`."""


@dataclass
class EnvSpec:
    """The environment a sample's trajectory acts in (the record's `agent.env`): each model turn
    is an action, each observation (image and text) the next user turn, the reward the env's."""

    id: str
    """A registered environment name (`mmrl.environments.env_names()`) or a Gymnasium id."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the environment's constructor (`gymnasium.make(id, **kwargs)`)."""
    seed: int | None = None
    """The seed of the episode's `reset(seed=...)`; None: the trajectory's row seed."""

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id}
        if self.kwargs:
            out["kwargs"] = dict(self.kwargs)
        if self.seed is not None:
            out["seed"] = self.seed
        return out


@dataclass
class AgentSpec:
    """A sample's tools and the limits of its multi-turn trajectory: the record's `agent` field,
    beside `reward_model` (V-Triune style: samples with and without tools mix in one batch).
    A limit left None takes the run's default (`agent.*` in the config)."""

    tools: list[str] = field(default_factory=list)
    """Names of registered tools (`mmrl.environments.tool_names()`) the model may call."""
    max_turns: int | None = None
    """Most model turns in the trajectory (a tool call in the last one is not run)."""
    max_tokens: int | None = None
    """Most response tokens, the model's and the observations' together."""
    max_images: int | None = None
    """Most observation images added to the trajectory (the prompt's are not counted)."""
    env: EnvSpec | None = None
    """The environment the trajectory acts in; None: tools only (or a single turn)."""

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tools": list(self.tools)}
        for name in ("max_turns", "max_tokens", "max_images"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.env is not None:
            out["env"] = self.env.to_record()
        return out


@dataclass
class Sample:
    """One training or evaluation prompt with everything needed to score a response to it."""

    data_source: str
    """Where the sample comes from; metrics are also reported per data source."""
    prompt: list[dict[str, Any]]
    """Chat messages; user text may hold `<image>` placeholders, one per entry of `images`."""
    images: list[ImageSource]
    """The sample's images, in placeholder order."""
    ability: str
    """Coarse skill label (`math`, `counting`, `detection`, ...)."""
    reward_model: RewardSpec
    """How responses are scored."""
    extra_info: dict[str, Any]
    """Free-form metadata; must hold a unique `id`."""
    agent: AgentSpec | None = None
    """Tools and limits for a multi-turn trajectory; None: one turn, no tools."""

    @property
    def id(self) -> str:
        return str(self.extra_info["id"])

    def pil_images(self) -> list[Image.Image]:
        """The images decoded as RGB PIL images."""
        return [load_image(src) for src in self.images]

    def chat_messages(self) -> list[dict[str, Any]]:
        """The prompt as structured chat content (`{"type": "image"}` / `{"type": "text"}` parts)."""
        messages = []
        for message in self.prompt:
            content = message["content"]
            if isinstance(content, str):
                parts: list[dict[str, Any]] = []
                pieces = content.split(IMAGE_PLACEHOLDER)
                for i, piece in enumerate(pieces):
                    if i > 0:
                        parts.append({"type": "image"})
                    if piece:
                        parts.append({"type": "text", "text": piece})
                content = parts
            messages.append({"role": message["role"], "content": content})
        return messages

    def to_record(self) -> dict[str, Any]:
        """A JSON-friendly dict in the on-disk format (images as PNG bytes if decoded)."""
        images = []
        for src in self.images:
            if isinstance(src, Image.Image):
                buf = io.BytesIO()
                src.save(buf, format="PNG")
                images.append(buf.getvalue())
            else:
                images.append(src)
        rm = self.reward_model
        return {
            "data_source": self.data_source,
            "prompt": self.prompt,
            "images": images,
            "ability": self.ability,
            "reward_model": {
                "ground_truth": rm.ground_truth,
                "verifier": rm.verifier,
                "verifier_params": rm.verifier_params,
                "accuracy_ratio": rm.accuracy_ratio,
                "format_ratio": rm.format_ratio,
                **({"models": rm.models} if rm.models else {}),
            },
            "extra_info": self.extra_info,
            **({"agent": self.agent.to_record()} if self.agent is not None else {}),
        }


class ImageError(ValueError):
    """An image that cannot be used: unreadable, truncated, or too large."""


MAX_IMAGE_PIXELS = 64_000_000
"""Images with more pixels are refused (a decompression bomb, or a mistake): 64 megapixels is
far beyond what a VLM processor keeps (Qwen2-VL caps at ~1 megapixel by default)."""


ALLOWED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The only formats `load_image` opens (Pillow's format names). Pillow knows some forty, and
some hand the bytes to other programs or to little-used parsers (EPS runs Ghostscript): image
data may come from anyone (a dataset, a reward-server client), so the rest are refused."""

_FORMAT_NAMES = {"WEBP": "WebP"}


def image_format_name(fmt: str) -> str:
    """How a Pillow format name is written in messages (`WEBP` -> `WebP`)."""
    return _FORMAT_NAMES.get(fmt, fmt)


def sniff_image_format(head: bytes) -> str | None:
    """The Pillow format whose signature `head` (a file's first bytes) matches, or None. Only
    the plugins' signature checks run: nothing is decoded, no program is started."""
    Image.init()
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        if accept is None:
            continue
        try:
            if accept(head):
                return fmt
        except Exception:  # noqa: BLE001 - a signature check that cannot read this prefix
            continue
    return None


def _refused_format(src: bytes | bytearray | str | Path) -> str | None:
    """The disallowed format `src` is in (for the error message), or None if it is none known."""
    try:
        if isinstance(src, (bytes, bytearray)):
            head = bytes(src[:64])
        else:
            with open(src, "rb") as f:
                head = f.read(64)
    except OSError:
        return None
    fmt = sniff_image_format(head)
    return fmt if fmt is not None and fmt not in ALLOWED_IMAGE_FORMATS else None


def load_image(src: ImageSource, *, before_decode: Callable[[int, int], None] | None = None) -> Image.Image:
    """Decode an image source to an RGB PIL image (any mode converted: palette, alpha, 16-bit,
    CMYK, ...). Raises `ImageError` naming the problem for unreadable, truncated or huge images,
    and for formats other than `ALLOWED_IMAGE_FORMATS` (naming the format: "EPS images are not
    accepted").

    `before_decode(width, height)` is called with the size read from the header, before the
    pixels are decoded; what it raises propagates (the reward server's per-request pixel
    budget)."""
    what = (
        "image"
        if isinstance(src, Image.Image)
        else (f"{len(src)} bytes" if isinstance(src, (bytes, bytearray)) else str(src))
    )
    try:
        if isinstance(src, Image.Image):
            image = src
        elif isinstance(src, (bytes, bytearray)):
            image = Image.open(io.BytesIO(src), formats=ALLOWED_IMAGE_FORMATS)
        elif isinstance(src, (str, Path)):
            image = Image.open(src, formats=ALLOWED_IMAGE_FORMATS)
        else:
            raise TypeError(f"unsupported image source of type {type(src).__name__}")
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ImageError(
                f"{what}: {width}x{height} pixels is more than the limit of {MAX_IMAGE_PIXELS:,}"
            )
        if width == 0 or height == 0:
            raise ImageError(f"{what}: empty image ({width}x{height})")
        if before_decode is not None:
            try:
                before_decode(width, height)
            except BaseException:
                if image is not src:
                    image.close()
                raise
        image.load()  # decode now: a truncated file fails here, not inside the processor
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{what}: refused as a decompression bomb ({exc})") from None
    except FileNotFoundError:
        raise ImageError(f"{what}: image file not found") from None
    except Image.UnidentifiedImageError as exc:
        refused = None if isinstance(src, Image.Image) else _refused_format(src)
        if refused is not None:
            allowed = ", ".join(image_format_name(f) for f in ALLOWED_IMAGE_FORMATS)
            raise ImageError(
                f"{what}: {image_format_name(refused)} images are not accepted (allowed formats: {allowed})"
            ) from None
        raise ImageError(f"{what}: unreadable or truncated image ({exc})") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageError(f"{what}: unreadable or truncated image ({exc})") from None
    if image.mode != "RGB":
        if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
            # Transparent pixels become white (what a viewer shows), not black.
            background = Image.new("RGB", image.size, (255, 255, 255))
            background.paste(image.convert("RGBA"), mask=image.convert("RGBA").getchannel("A"))
            image = background
        else:
            image = image.convert("RGB")
    return image


@dataclass
class VerifierResult:
    """What a verifier says about one response."""

    score: float
    """Final reward in [0, 1]: accuracy and format mixed with the sample's ratios."""
    components: dict[str, float] = field(default_factory=dict)
    """Named parts of the score (`accuracy`, `format`, `iou`, ...)."""
    error: str | None = None
    """Why scoring failed (time-out, exception); the score is then 0 and the error is counted."""
    extracted: str | None = None
    """The answer the verifier extracted from the response, for debugging dumps."""


@dataclass
class AnswerLimits:
    """Caps on a response's final answer (its `\\boxed{}` or `<answer>` text), checked before a
    verifier parses it (`mmrl.verifiers.limits`). math-verify's time grows with an answer's
    length and steeply with its bracket nesting (its LaTeX grammar's look-ahead: ten bare `{`
    levels take about a second, fourteen more than ten), so a policy that learns to babble
    would otherwise cost a verifier time-out per response. An answer past a cap scores 0 with
    an error of its own kind (`answer_too_long`, `answer_too_deep`, `answer_too_many_tokens`),
    counted like any verifier error and by kind. 0 switches a cap off."""

    max_chars: int = 1000
    """Most characters in the answer (0: no cap)."""
    max_depth: int = 10
    """Deepest nesting of brackets `{ ( [` in the answer (0: no cap)."""
    max_tokens: int = 400
    """Most tokens in the answer: numbers, words, LaTeX commands and other single non-space
    characters each count one (0: no cap)."""


@dataclass
class VerifyContext:
    """Training-time information a verifier may depend on."""

    step: int = 0
    """Current training step (0-based)."""
    total_steps: int = 1
    """Total training steps; schedules such as the dynamic IoU threshold use step/total_steps."""
    limits: AnswerLimits = field(default_factory=AnswerLimits)
    """Caps on the answer's size, set by whoever runs the verifiers (`reward.answer_limits`,
    the server's `answer_limits`)."""


@dataclass
class VisionLayout:
    """How a batch's vision inputs (processor outputs) map to its N rows; made by the policy's
    family adapter (`mmrl.models.families`). An input named in neither field has one entry per
    row ([N, ...]); rows are joined by padding its other dimensions with zeros (Idefics3's
    images per row, LLaVA-NeXT's tiles per image)."""

    extents: dict[str, list[int]] = field(default_factory=dict)
    """Inputs concatenated over the rows' images or patches: each row's number of leading
    entries (LLaVA's `pixel_values`: images; Qwen-VL's: patches)."""
    per_token: tuple[str, ...] = ()
    """Inputs [N, P] aligned with the prompt ids, left padded as they are (`token_type_ids`)."""

    def rows(self, rows: list[int]) -> VisionLayout:
        """The layout of the sub-batch of `rows`."""
        return VisionLayout({k: [e[r] for r in rows] for k, e in self.extents.items()}, self.per_token)

    def check(self, vision: dict[str, torch.Tensor], n_rows: int, where: str) -> None:
        """Raise if a tensor's leading size is not what this layout says for `n_rows` rows."""
        for key, value in vision.items():
            extent = self.extents.get(key)
            if extent is None and value.shape[0] != n_rows:
                raise ValueError(
                    f"{where}: vision input {key!r} has {value.shape[0]} entries for {n_rows} rows, and the "
                    "family adapter does not say how they map to rows (mmrl.models.families)"
                )
            if extent is not None and (len(extent) != n_rows or sum(extent) != value.shape[0]):
                raise ValueError(
                    f"{where}: vision input {key!r} has {value.shape[0]} entries, but the family adapter gives "
                    f"its rows {extent} (mmrl.models.families)"
                )


@dataclass
class RolloutBatch:
    """G responses for each of B prompts, laid out as [B x G, ...] rows.

    Rows are prompt-major: rows i*G .. i*G+G-1 belong to prompt i. Prompt tokens are left
    padded and response tokens right padded, so `input_ids = cat(prompt_ids, response_ids)`
    is exactly the sequence the model saw while generating.
    """

    samples: list[Sample]
    """One entry per row (each prompt's sample repeated G times)."""
    prompt_ids: torch.Tensor
    """[N, P] left-padded prompt token ids."""
    prompt_mask: torch.Tensor
    """[N, P] 1 for real prompt tokens."""
    response_ids: torch.Tensor
    """[N, R] right-padded response token ids (the stop token included)."""
    response_mask: torch.Tensor
    """[N, R] 1 for generated tokens that count in the loss."""
    rollout_logprobs: torch.Tensor
    """[N, R] log-probabilities of the response tokens under the rollout policy."""
    vision_inputs: dict[str, torch.Tensor]
    """Processor outputs besides ids and mask (pixel_values, image_grid_thw, token type ids, ...),
    laid out over rows as `vision_layout` says."""
    texts: list[str]
    """Decoded responses."""
    truncated: torch.Tensor
    """[N] True where the response hit the length limit without a stop token."""
    images_per_row: list[int] = field(default_factory=list)
    """How many images each row's prompt holds."""
    group_size: int = 1
    """G, responses per prompt."""
    vision_layout: VisionLayout = field(default_factory=VisionLayout)
    """How `vision_inputs` map to rows (to select and join rows)."""
    observation_mask: torch.Tensor | None = None
    """[N, R] 1 on observation tokens (tool responses) inside a multi-turn response: the model
    saw them (they are attended to) but did not generate them, so they enter no loss, KL,
    entropy, length or importance-weight term. None: single-turn, every response token is the
    model's. The forward attends to `response_mask | observation_mask` (`response_attention`)."""
    trajectories: list[Trajectory] | None = None
    """Per row, what the multi-turn loop recorded (turns, tool calls, termination); None for
    single-turn batches."""
    token_versions: torch.Tensor | None = None
    """[N, R] int64, asynchronous mode: the policy version that sampled each model token (-1 on
    observation and padding positions). A partial rollout's tokens carry the version of the
    weights each was sampled with. None: the on-policy loop (every token the current policy's)."""

    def response_attention(self) -> torch.Tensor:
        """[N, R] the response positions the model attends to: its own tokens and observations."""
        if self.observation_mask is None:
            return self.response_mask
        return self.response_mask | self.observation_mask

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def device(self) -> torch.device:
        return self.response_ids.device

    def to(self, device: torch.device) -> RolloutBatch:
        """The batch with its tensors on `device` (itself when they are there already)."""
        if self.device == device:
            return self
        move = {
            name: getattr(self, name).to(device)
            for name in (
                "prompt_ids",
                "prompt_mask",
                "response_ids",
                "response_mask",
                "rollout_logprobs",
                "truncated",
            )
        }
        if self.observation_mask is not None:
            move["observation_mask"] = self.observation_mask.to(device)
        if self.token_versions is not None:
            move["token_versions"] = self.token_versions.to(device)
        vision = {k: v.to(device) for k, v in self.vision_inputs.items()}
        return dataclasses.replace(self, **move, vision_inputs=vision)


@dataclass
class Trajectory:
    """What the multi-turn loop records of one response besides its tokens (`RolloutBatch`
    holds the ids, masks and log-probs)."""

    turns: int = 1
    """Model turns generated."""
    tool_calls: int = 0
    """Tool calls parsed and run (malformed ones included: they get error observations)."""
    tool_errors: dict[str, int] = field(default_factory=dict)
    """Error observations by kind (`bad_json`, `unknown_tool`, `timeout`, ...)."""
    observation_tokens: int = 0
    """Tokens of observations appended to the response."""
    images: list[Any] = field(default_factory=list)
    """Every observation image appended, in order (the prompt's are the sample's)."""
    turn_texts: list[str] = field(default_factory=list)
    """Each model turn's text, as decoded (special tokens dropped)."""
    tool_reward: float = 0.0
    """Sum of the tools' own rewards (veRL `calc_reward`)."""
    termination: str = "answer"
    """Why it ended: `answer` (a turn without a tool call), `length` (a turn hit the per-turn
    token limit), `max_turns`, `token_budget`, `image_budget`; in an environment also
    `env_done` (the env terminated), `env_truncated` (its own step limit), `env_error` (it
    raised), `env_timeout` (a reset or step past `agent.env_timeout_s`)."""
    env_id: str | None = None
    """The environment the trajectory acted in (`agent.env.id`), else None."""
    env_steps: int = 0
    """Environment steps taken (model turns whose action was valid and ran)."""
    env_errors: dict[str, int] = field(default_factory=dict)
    """Environment errors by kind (`bad_action`: not stepped, the trajectory goes on;
    `env_error`, `env_timeout`: the trajectory ends)."""
    turn_rewards: list[float] = field(default_factory=list)
    """The environment's reward after each model turn (0 for a turn whose action was invalid)."""
    env_return: float = 0.0
    """sum_t agent.turn_discount^t x turn_rewards[t]."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation after the prompt, as chat messages (for the tokenization check and
    dumps): each model turn as an assistant message, each observation as tool messages."""

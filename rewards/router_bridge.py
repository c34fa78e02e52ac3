"""Model rewards for samples: the bridge between the sample format and the reward models.

The sample field (`RewardSpec.models`, checked when records are loaded): a list under
`reward_model.models`, one entry per reward model that scores the sample::

    {"reward_model": {"ground_truth": "...", "verifier": "math", ...,
                      "models": [{"name": "aesthetic", "weight": 0.5},
                                 {"name": "ocr", "weight": 1.0, "params": {"text": "Open 24h"}},
                                 {"name": "vlm_judge", "weight": 0.2, "params": {"reference": "4"}}]}}

- `name`: a reward model instance of the run (`RewardModelConfig.name`, usually its type);
- `weight` (default 1): its weight in the sample's model-reward total;
- `params` (default {}): per-sample inputs; a param `x` is passed to the model as the per-item
  field `xs` (`text` -> `texts` for OCR, `reference` -> `references` for the judge).

`check_model_entries(raw, where)` validates the list (the schema check at load time).

What each model sees for row i: `images[i]` (the generated image, for flow-GRPO / DDPO) if
given, else the sample's first image; the sample's prompt text (placeholders removed); and
`responses[i]` (the VLM's answer) if given. The judge's `reference` defaults to the sample's
ground truth. Rows asking for the same model are scored in one batched call.

Calling it, in the trainer (after the verifiers, inside `placement.scoring()`) or the reward
server::

    rows = score_model_rewards(samples, responses, images, placement.models)
    rows[i] == {"aesthetic": 5.1, "ocr": 1.0, "ocr/ocr_chars": 8.0, "total": 3.55}   # {} if none

and then, e.g., the row's reward = verifier score + rows[i]["total"] (or feed each model's
column to `mmrl.rewards.combine.gdpo_advantages`); log each key as `reward/<key>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mmrl.rewards.base import RewardModel, RewardModelError
from mmrl.types import IMAGE_PLACEHOLDER, Sample


@dataclass
class ModelRewardEntry:
    """One entry of a sample's `reward_model.models`."""

    name: str
    """Reward model instance name."""
    weight: float = 1.0
    """Weight in the sample's model-reward total."""
    params: dict[str, Any] = field(default_factory=dict)
    """Per-sample inputs (`text`, `reference`, ...)."""


def check_model_entries(raw: Any, where: str = "reward_model.models") -> list[ModelRewardEntry]:
    """Validate a sample's model-reward list; raises ValueError naming the field."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(
            f"{where}: must be a list of {{name, weight, params}} objects, got {type(raw).__name__}"
        )
    entries = []
    for i, item in enumerate(raw):
        here = f"{where}[{i}]"
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict):
            raise ValueError(f"{here}: must be an object with 'name', got {type(item).__name__}")
        unknown = sorted(set(item) - {"name", "weight", "params"})
        if unknown:
            raise ValueError(f"{here}: unknown key(s) {unknown} (known: name, weight, params)")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{here}.name: missing (the name of a reward model)")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{here}.weight: must be a number, got {weight!r}")
        params = item.get("params", {}) or {}
        if not isinstance(params, dict):
            raise ValueError(f"{here}.params: must be an object, got {type(params).__name__}")
        entries.append(ModelRewardEntry(name, float(weight), dict(params)))
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: a reward model is listed twice: {names}")
    return entries


def model_entries(sample: Sample) -> list[ModelRewardEntry]:
    """The sample's model-reward entries (`reward_model.models`)."""
    try:
        return check_model_entries(sample.reward_model.models, "reward_model.models")
    except ValueError as exc:
        raise ValueError(f"sample {sample.id}: {exc}") from None


def prompt_text(sample: Sample) -> str:
    """The sample's user text, placeholders removed (what the image or answer should match)."""
    parts = []
    for message in sample.prompt:
        if message.get("role", "user") != "user":
            continue
        content = message["content"]
        if isinstance(content, str):
            parts.append(content.replace(IMAGE_PLACEHOLDER, ""))
        else:
            parts += [p.get("text", "") for p in content if p.get("type") == "text"]
    return "\n".join(p.strip() for p in parts if p.strip())


def score_model_rewards(
    samples: Sequence[Sample],
    responses: Sequence[str | None] | None,
    images: Sequence[Any] | None,
    models: Mapping[str, RewardModel],
    failures: dict[int, tuple[str, str]] | None = None,
) -> list[dict[str, float]]:
    """Per row: `{model name: reward, "<name>/<component>": value, ..., "total": sum_k w_k r_k}`
    for the models the row's sample asks for (`{}` when it asks for none).

    A model that raises raises `RewardModelError` naming the samples, unless `failures` is
    given: then the rows it was to score get `failures[row] = (model name, error message)`
    (the first failing model of the row), keep what the other models gave, and have no "total";
    the others are scored as usual (the trainer counts these like verifier errors).

    Args:
        samples: [N] one sample per row (repeat a sample for its G responses: prompt-major).
        responses: [N] the responses (VLM rows), or None (image generation).
        images: [N] the generated image of each row, or None (then the sample's own image).
        models: name -> built reward model (e.g. `RewardPlacement.models`).
    """
    n = len(samples)
    for what, seq in (("responses", responses), ("images", images)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"score_model_rewards: {len(seq)} {what} for {n} samples")
    entries = [model_entries(s) for s in samples]
    # Group rows by (model, has image, has response) so each group is one batched call.
    groups: dict[tuple[str, bool, bool], list[int]] = {}
    for i, row_entries in enumerate(entries):
        for entry in row_entries:
            if entry.name not in models:
                raise KeyError(
                    f"sample {samples[i].id}: reward model {entry.name!r} is not configured "
                    f"(configured: {sorted(models)})"
                )
            image = images[i] if images is not None else None
            if image is None and samples[i].images:
                image = samples[i].images[0]
            response = responses[i] if responses is not None else None
            groups.setdefault((entry.name, image is not None, response is not None), []).append(i)
    values: list[dict[str, float]] = [{} for _ in range(n)]
    for (name, has_image, has_response), rows in groups.items():
        model = models[name]
        row_images = None
        if has_image:
            row_images = [
                images[i] if images is not None and images[i] is not None else samples[i].images[0]
                for i in rows
            ]
        fields: dict[str, list[Any]] = {}
        params_by_row = [next(e for e in entries[i] if e.name == name).params for i in rows]
        for key in sorted({k for p in params_by_row for k in p}):
            fields[key + "s"] = [p.get(key) for p in params_by_row]
        if model_type_name(model) == "vlm_judge":  # the reference defaults to the ground truth
            given = fields.get("references", [None] * len(rows))
            fields["references"] = [
                ref if ref is not None else samples[i].reward_model.ground_truth
                for ref, i in zip(given, rows)
            ]
        try:
            out = model.score_with_components(
                images=row_images,
                prompts=[prompt_text(samples[i]) for i in rows],
                responses=[responses[i] for i in rows] if has_response else None,
                **fields,
            )
        except Exception as exc:
            ids = [samples[i].id for i in rows[:5]]
            error = RewardModelError(
                f"reward model {name!r} failed on samples {ids}{' ...' if len(rows) > 5 else ''}: "
                f"{type(exc).__name__}: {exc}"
            )
            if failures is None:
                raise error from exc
            for i in rows:
                failures.setdefault(i, (name, f"{type(exc).__name__}: {exc}"))
            continue
        for j, i in enumerate(rows):
            values[i][name] = float(out.scores[j])
            for comp, vals in out.components.items():
                if comp not in (name, model_type_name(model)):  # those repeat the score
                    values[i][f"{name}/{comp}"] = float(vals[j])
    for i, row_entries in enumerate(entries):
        if row_entries and (failures is None or i not in failures):
            values[i]["total"] = sum(e.weight * values[i][e.name] for e in row_entries)
    return values


def model_type_name(model: RewardModel) -> str:
    """The registered type of `model` (its class's registry name)."""
    return getattr(type(model), "name", "") or model.name

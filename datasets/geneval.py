"""GenEval-style text-to-image prompts: a structured spec, its prompt text, and a drawing of it.

The built-in prompt-following task of flow-GRPO (`mmrl train --task text_to_image`). Every prompt
comes from a small grammar whose parse is the spec the `geneval` verifier checks::

    a red circle                             single    one object
    three blue squares                       count     2-3 objects of one colour and shape
    a green triangle left of a yellow square position  two objects and their relation
    the text "cat"                           text      a rendered word (the OCR reward)

    spec = parse_prompt("two red circles")  # ImageSpec(objects=[ObjectSpec("red", "circle", 2)])
    prompt_text(spec) == "two red circles"
    image = draw(spec, np.random.default_rng(0), size=32)   # a drawing that satisfies it

`draw` is what the built-in image base is warmed up on (`mmrl.models.image_base`): flat shapes
in the six colours of the VLM's procedural data on a light grey background, placed so that
counts are countable (distinct cells of a 2x2 grid) and relations hold with a margin.

`geneval_prompts(split)` gives the built-in prompts, deterministic: `heldout` (what training is
judged on) is disjoint from `train`: every prompt with one of the `WITHHELD_PAIRS` colour-shape
combinations (compositional generalisation: "a red square" when red and squares were each seen,
never together), and a fixed share of the other count and position prompts (counts and
relations never trained). Nothing of `heldout` is drawn by the image base's warm-up either (it
draws `train`). `validation` (what the warm-up stops on, and the training-prompt accuracy of a
run) is a sample of the training prompts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from mmrl.datasets.vision_reasoning import COLOURS

SHAPES = ("circle", "square", "triangle")
RELATIONS = ("left of", "right of", "above", "below")
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
WORDS = ("cat", "sun", "dog", "hat", "box", "cup", "red", "map")
"""Words of the `text` kind (short: a tiny model renders few pixels)."""
VOCABULARY = tuple(dict.fromkeys((
    *COUNT_WORDS.values(), *COLOURS,
    *SHAPES, *(s + "s" for s in SHAPES), "left", "right", "of", "above", "below", "the", "text", '"', *WORDS,
)))  # fmt: skip
"""Every word of the prompt grammar (the built-in image base's word-level tokenizer)."""
KINDS = ("single", "count", "position", "text")
DEFAULT_KINDS = ("single", "count", "position")
"""The kinds of the built-in prompts (`text` needs a resolution OCR can read: not at 32 px)."""
BACKGROUND = (236, 236, 236)
"""Mean background grey of the drawings (each drawing jitters it)."""


@dataclass(frozen=True)
class ObjectSpec:
    """`count` objects of one colour and shape."""

    colour: str
    shape: str
    count: int = 1


@dataclass(frozen=True)
class ImageSpec:
    """What an image must show: objects (one or two groups), their relation, or a word."""

    objects: tuple[ObjectSpec, ...] = ()
    relation: str | None = None
    """`left of`, `right of`, `above` or `below`: objects[0] relative to objects[1]."""
    text: str | None = None
    """A word to render (scored by OCR)."""
    kind: str = field(default="single", compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly (a sample's `reward_model.ground_truth`)."""
        return {
            "objects": [{"colour": o.colour, "shape": o.shape, "count": o.count} for o in self.objects],
            "relation": self.relation,
            "text": self.text,
        }


def spec_from_dict(raw: Any, where: str = "spec") -> ImageSpec:
    """The inverse of `ImageSpec.to_dict`, validated; ValueError naming the bad field."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a dict with objects / relation / text, got {type(raw).__name__}")
    unknown = set(raw) - {"objects", "relation", "text"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)} (allowed: objects, relation, text)")
    objects = []
    for i, o in enumerate(raw.get("objects") or []):
        at = f"{where}.objects[{i}]"
        if not isinstance(o, dict) or set(o) - {"colour", "shape", "count"}:
            raise ValueError(f"{at}: expected {{colour, shape, count}}, got {o!r}")
        colour, shape, count = o.get("colour"), o.get("shape"), o.get("count", 1)
        if colour not in COLOURS:
            raise ValueError(f"{at}.colour: {colour!r} is not one of {', '.join(COLOURS)}")
        if shape not in SHAPES:
            raise ValueError(f"{at}.shape: {shape!r} is not one of {', '.join(SHAPES)}")
        if not isinstance(count, int) or isinstance(count, bool) or count not in COUNT_WORDS:
            raise ValueError(f"{at}.count: {count!r} must be 1, 2 or 3")
        objects.append(ObjectSpec(colour, shape, count))
    relation, text = raw.get("relation"), raw.get("text")
    if relation is not None:
        if relation not in RELATIONS:
            raise ValueError(f"{where}.relation: {relation!r} is not one of {', '.join(RELATIONS)}")
        if len(objects) != 2 or any(o.count != 1 for o in objects):
            raise ValueError(f"{where}.relation: needs exactly two single objects, got {len(objects)} groups")
        if objects[0].colour == objects[1].colour:
            raise ValueError(f"{where}.objects: the two objects of a relation need different colours")
    elif len(objects) > 1:
        raise ValueError(f"{where}.objects: two groups need a relation")
    if text is not None and (not isinstance(text, str) or not text.strip() or '"' in text):
        raise ValueError(f"{where}.text: {text!r} must be a non-empty word without quotes")
    if not objects and text is None:
        raise ValueError(f"{where}: nothing to draw (no objects and no text)")
    if objects and text is not None:
        raise ValueError(f"{where}: objects and text together are not supported")
    kind = (
        "text"
        if text is not None
        else "position"
        if relation
        else "count"
        if objects[0].count > 1
        else "single"
    )
    return ImageSpec(tuple(objects), relation, text, kind)


# --- prompt text ----------------------------------------------------------------------------
def _noun(o: ObjectSpec) -> str:
    return f"{COUNT_WORDS[o.count]} {o.colour} {o.shape}{'s' if o.count > 1 else ''}"


def prompt_text(spec: ImageSpec) -> str:
    """The prompt of `spec` (the grammar in the module docs)."""
    if spec.text is not None:
        return f'the text "{spec.text}"'
    if spec.relation is not None:
        return f"{_noun(spec.objects[0])} {spec.relation} {_noun(spec.objects[1])}"
    return _noun(spec.objects[0])


_COLOUR = "|".join(COLOURS)
_SHAPE = "|".join(SHAPES)
_OBJECT = rf"(a|two|three) ({_COLOUR}) ({_SHAPE})(s?)"
_RELATION = "|".join(RELATIONS)
_PROMPT = re.compile(rf"^{_OBJECT}(?: ({_RELATION}) {_OBJECT})?$")
_TEXT = re.compile(r'^the text "([^"]+)"$')
_NUMBER = {w: n for n, w in COUNT_WORDS.items()}


def parse_prompt(prompt: str) -> ImageSpec:
    """The spec of a prompt of the grammar (case and surrounding spaces ignored); ValueError
    quoting the prompt if it is not one."""
    text = " ".join(str(prompt).strip().split())
    m = _TEXT.match(text)
    if m:
        return spec_from_dict({"text": m.group(1)}, where=f"prompt {prompt!r}")
    m = _PROMPT.match(text.lower())
    if not m:
        raise ValueError(
            f"prompt {prompt!r} is not a GenEval-style prompt (e.g. 'a red circle', 'two blue squares', "
            "'a green triangle left of a yellow square', 'the text \"cat\"')"
        )
    groups = m.groups()
    objects = []
    for number, colour, shape, plural in (groups[0:4], groups[5:9]):
        if number is None:
            continue
        count = _NUMBER[number]
        if (count > 1) != (plural == "s"):
            raise ValueError(f"prompt {prompt!r}: '{number} ... {shape}{plural}' does not agree in number")
        objects.append({"colour": colour, "shape": shape, "count": count})
    return spec_from_dict({"objects": objects, "relation": groups[4]}, where=f"prompt {prompt!r}")


# --- the prompt space and its splits -----------------------------------------------------------
def all_specs(kinds: tuple[str, ...] | list[str] = DEFAULT_KINDS) -> list[ImageSpec]:
    """Every spec of the given kinds, in a fixed order."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown GenEval kind(s) {unknown}: choose from {list(KINDS)}")
    out: list[ImageSpec] = []
    for kind in kinds:
        if kind == "text":
            out += [ImageSpec(text=w, kind="text") for w in WORDS]
            continue
        for c in COLOURS:
            for s in SHAPES:
                if kind == "single":
                    out.append(ImageSpec((ObjectSpec(c, s, 1),), kind="single"))
                elif kind == "count":
                    out += [ImageSpec((ObjectSpec(c, s, n),), kind="count") for n in (2, 3)]
                else:
                    for c2 in COLOURS:
                        if c2 == c:
                            continue
                        for s2 in SHAPES:
                            for rel in RELATIONS:
                                objects = (ObjectSpec(c, s, 1), ObjectSpec(c2, s2, 1))
                                out.append(ImageSpec(objects, rel, kind="position"))
    return out


WITHHELD_PAIRS = (
    ("red", "square"),
    ("green", "circle"),
    ("blue", "triangle"),
    ("yellow", "circle"),
    ("purple", "square"),
    ("cyan", "triangle"),
)
"""Colour-shape combinations never trained on (nor drawn by the image base's warm-up): one per
colour, two per shape, so every colour and every shape is still trained, in other combinations.
Every prompt with one of them is held out (the 6 such single-object prompts of 18, their count
prompts, the relations they take part in)."""
HELDOUT_FRACTION = {"single": 0.0, "count": 0.25, "position": 0.1, "text": 0.25}
"""Share of each kind's other prompts (no withheld pair) also held out: counts and relations of
trained combinations that are never trained (`single`: none beyond the withheld pairs)."""


def withheld(spec: ImageSpec) -> bool:
    """Whether `spec` has an object of a withheld colour-shape combination (`WITHHELD_PAIRS`)."""
    return any((o.colour, o.shape) in WITHHELD_PAIRS for o in spec.objects)


def geneval_prompts(
    split: str, kinds: tuple[str, ...] | list[str] = DEFAULT_KINDS, n: int | None = None, seed: int = 0
) -> list[str]:
    """The built-in prompts of `split` (`train`, `validation` or `heldout`), deterministic.

    Per kind: every prompt with a withheld colour-shape pair (`WITHHELD_PAIRS`) is `heldout`;
    of the others, after a seeded shuffle, the first `HELDOUT_FRACTION` are `heldout` too and
    the rest `train`. `validation` is a seeded sample of the training prompts. `heldout` and
    `validation` interleave the kinds (so a prefix of them covers every kind, each equally often:
    a kind with fewer prompts repeats them); `n` keeps the first n (default: as many as the split
    has prompts)."""
    if split not in ("train", "validation", "heldout"):
        raise ValueError(f"unknown GenEval split {split!r}: choose train, validation or heldout")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown GenEval kind(s) {unknown}: choose from {list(KINDS)}")
    per_kind = []
    for kind in kinds:
        specs = all_specs((kind,))
        novel = [prompt_text(s) for s in specs if withheld(s)]
        rest = [prompt_text(s) for s in specs if not withheld(s)]
        k = KINDS.index(kind)  # a kind's split does not depend on which other kinds are asked for
        rng = np.random.default_rng([seed, k, 7])
        rest = [rest[i] for i in rng.permutation(len(rest))]
        cut = int(round(HELDOUT_FRACTION[kind] * len(rest)))
        if split == "heldout":
            per_kind.append(novel + rest[:cut])
        else:
            train = rest[cut:]
            if split == "validation":
                train = [train[i] for i in np.random.default_rng([seed, k, 11]).permutation(len(train))]
            per_kind.append(train)
    if split == "train":
        out = [p for group in per_kind for p in group]
        return out[:n] if n is not None else out
    # interleaved, a kind that runs out starting over (a prompt then recurs: sampled with other
    # noise, it is another image), so any n keeps the kinds balanced
    k = len(per_kind)
    n = sum(map(len, per_kind)) if n is None else n
    return [per_kind[i % k][(i // k) % len(per_kind[i % k])] for i in range(n)]


# --- drawing --------------------------------------------------------------------------------
def draw(spec: ImageSpec, rng: np.random.Generator, size: int = 32, scale: float = 1.0) -> Image.Image:
    """A drawing that satisfies `spec` (random placement, sizes and colour jitter from `rng`).
    `scale` multiplies the shapes' sizes (capped where they would no longer fit their cell or
    their relation's margin); larger shapes span more of a patch-4 model's tokens, so their
    outline is easier for a tiny model to draw and for the verifier to tell apart."""
    grey = int(rng.integers(226, 247))
    image = Image.new("RGB", (size, size), (grey, grey, grey))
    d = ImageDraw.Draw(image)
    if spec.text is not None:
        font = ImageFont.load_default(size=max(8, int(size * 0.9 / max(2, len(spec.text)) * 1.6)))
        left, top, right, bottom = d.textbbox((0, 0), spec.text, font=font)
        x = (size - (right - left)) / 2 - left + rng.uniform(-1, 1) * size * 0.04
        y = (size - (bottom - top)) / 2 - top + rng.uniform(-1, 1) * size * 0.04
        d.text((x, y), spec.text, fill=(20, 20, 20), font=font)
        return image
    if spec.relation is not None:
        places = _relation_places(rng, size, spec.relation, scale)
        colours = [o.colour for o in spec.objects]
        shapes = [o.shape for o in spec.objects]
    else:
        o = spec.objects[0]
        places = _cell_places(rng, size, o.count, scale)
        colours, shapes = [o.colour] * o.count, [o.shape] * o.count
    for (cx, cy, r), colour, shape in zip(places, colours, shapes):
        draw_shape(d, shape, cx, cy, r, _jitter(COLOURS[colour], rng))
    return image


def draw_shape(d: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    """One filled shape of half-size `r` centred at (cx, cy); triangles point up."""
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}: choose from {', '.join(SHAPES)}")


def _jitter(rgb: tuple[int, int, int], rng: np.random.Generator, amount: int = 15) -> tuple[int, ...]:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in rgb)


def _cell_places(
    rng: np.random.Generator, size: int, n: int, scale: float = 1.0
) -> list[tuple[float, float, float]]:
    """`n` shapes in distinct cells of a 2x2 grid (one shape: anywhere, larger)."""
    if n == 1:
        r = min(size * rng.uniform(0.16, 0.24) * scale, size * 0.34)
        cx, cy = rng.uniform(r + 1, size - r - 1, size=2)
        return [(cx, cy, r)]
    cell = size / 2
    out = []
    for c in rng.permutation(4)[:n]:
        r = min(cell * rng.uniform(0.28, 0.36) * scale, cell * 0.38)  # three stay under MAX_FOREGROUND
        slack = cell / 2 - r - 1
        cx = (c % 2 + 0.5) * cell + rng.uniform(-slack, slack)
        cy = (c // 2 + 0.5) * cell + rng.uniform(-slack, slack)
        out.append((cx, cy, r))
    return out


def _relation_places(
    rng: np.random.Generator, size: int, relation: str, scale: float = 1.0
) -> list[tuple[float, float, float]]:
    """Two shapes, the first `relation` the second: apart along the relation's axis (a gap of at
    least two pixels between them), within a fifth of the image of each other across it."""
    r1, r2 = (min(size * rng.uniform(0.13, 0.19) * scale, (size - 4) / 4) for _ in range(2))
    gap = r1 + r2 + 2
    along1 = rng.uniform(r1 + 1, size - r2 - 1 - gap)
    along2 = rng.uniform(along1 + gap, size - r2 - 1)
    mid = rng.uniform(size * 0.3, size * 0.7)
    across1 = float(np.clip(mid + rng.uniform(-1, 1) * size * 0.1, r1 + 1, size - r1 - 1))
    across2 = float(np.clip(mid + rng.uniform(-1, 1) * size * 0.1, r2 + 1, size - r2 - 1))
    if relation in ("right of", "below"):
        along1, along2 = size - along1, size - along2
    if relation in ("left of", "right of"):
        return [(along1, across1, r1), (along2, across2, r2)]
    return [(across1, along1, r1), (across2, along2, r2)]

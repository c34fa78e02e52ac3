"""The config reference: every field of every config dataclass, its type, default and doc.

`docs/reference/config.md` is this module's output (`make docs` writes it), from the same field
docstrings the code carries; `tests/test_docs.py` fails when the file differs from what the code
gives now, so the page cannot drift from the code. `python -m mmrl.config_reference` prints it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator
from typing import Any

from mmrl.config import field_docs


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _nested_type(cls: type, f: dataclasses.Field, default: Any) -> type | None:
    """The config dataclass a field holds, or holds a list of (None for plain fields)."""
    if dataclasses.is_dataclass(default):
        return type(default)
    hint = typing.get_type_hints(cls).get(f.name)
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
        for inner in typing.get_args(arg):
            if isinstance(inner, type) and dataclasses.is_dataclass(inner):
                return inner
    return None


def walk_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, str, Any, str]]:
    """`(key, type, default, doc)` for every leaf field of `cls`, nested configs flattened into
    dotted keys (a list of configs as `key[]`)."""
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        default = _default(f)
        nested = _nested_type(cls, f, default)
        key = f"{prefix}{f.name}"
        if nested is not None:
            sub = f"{key}[]." if isinstance(default, list) else f"{key}."
            yield from walk_fields(nested, sub)
            continue
        yield key, str(f.type), default, docs.get(f.name, "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _value(default: Any) -> str:
    if isinstance(default, str):
        return f'`"{default}"`' if default else '`""`'
    if default is None:
        return "`null`"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    return _cell(f"`{default!r}`")


def config_sections() -> list[tuple[str, str, type]]:
    """`(title, how it is used, config class)` for each command's configuration."""
    from mmrl.config import Config
    from mmrl.eval.config import CurveConfig, EvalConfig
    from mmrl.server.config import ServeConfig
    from mmrl.train.flow_config import DecoupledConfig, FlowConfig

    return [
        ("mmrl train (VLM GRPO)", "`mmrl train --task vision_reasoning key=value ...`", Config),
        ("mmrl train (flow-GRPO)", "`mmrl train --task text_to_image key=value ...`", FlowConfig),
        (
            "mmrl train (decoupled)",
            "`mmrl train --task text_to_image_decoupled key=value ...`",
            DecoupledConfig,
        ),
        ("mmrl eval", "`mmrl eval --suite ... --model ...` (flags)", EvalConfig),
        ("mmrl eval --curves", "`mmrl eval --curves RUN ...`", CurveConfig),
        ("mmrl serve", "`mmrl serve --config serve.yaml`", ServeConfig),
    ]


def reference_markdown() -> str:
    """The whole reference page (Markdown)."""
    lines = [
        "# Config reference",
        "",
        "Generated from the field docstrings in the code (`mmrl/config.py`, `mmrl/train/flow_config.py`, "
        "`mmrl/train/flow_config.py`, `mmrl/eval/config.py`, `mmrl/server/config.py`); every default "
        "lives there. Set a field with `key=value` on the command line or as a YAML key under `--config`.",
        "",
    ]
    for title, usage, cls in config_sections():
        lines += [
            f"## {title}",
            "",
            usage,
            "",
            "| key | type | default | what it does |",
            "|---|---|---|---|",
        ]
        for key, type_, default, doc in walk_fields(cls):
            lines.append(f"| `{key}` | `{_cell(type_)}` | {_value(default)} | {_cell(doc)} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())

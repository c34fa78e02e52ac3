"""The documentation stays true to the code: the generated config reference is current, every
relative link of the README and the docs points at a file that exists, the README stays a front
door (at most 300 lines). `mkdocs build --strict` (make docs, in CI) checks the site itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_config_reference_is_the_codes():
    from mmrl.config_reference import reference_markdown

    page = REPO / "docs" / "reference" / "config.md"
    assert page.read_text(encoding="utf-8") == reference_markdown() + "\n", (
        "docs/reference/config.md is out of date: run `make docs` (python -m mmrl.config_reference)"
    )


def test_the_reference_lists_every_field_with_its_doc():
    from mmrl.config_reference import config_sections, walk_fields

    for title, _, cls in config_sections():
        rows = list(walk_fields(cls))
        assert len(rows) >= 4, title
        missing = [key for key, _, _, doc in rows if not doc]
        assert not missing, f"{title}: fields without a docstring: {missing}"
    keys = {key for key, *_ in walk_fields(config_sections()[0][2])}
    assert {"trainer.total_steps", "algo.advantage", "reward.model_rewards.models[].name"} <= keys


def test_the_readme_is_a_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_that_exist(path):
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#", 1)[0]
        if file and not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(REPO)}: links to missing files: {broken}"

"""mkdocs hook: the config reference page is generated from the code at every build."""

from __future__ import annotations

from mkdocs.structure.files import File, Files


def on_files(files: Files, config) -> Files:
    from mmrl.config_reference import reference_markdown

    files.append(File.generated(config, "reference/config.md", content=reference_markdown()))
    return files

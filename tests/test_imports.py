"""The house's arrows point one way: no import cycle anywhere in the package, and the training
loop imports none of the compositions that wrap it (they are chosen above it, in mmrl.compose)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOTS = {  # import name -> folder, as setup.py installs them
    "mmrl": REPO / "mmrl",
    "mmrl.verifiers": REPO / "verifiers",
    "mmrl.rewards": REPO / "rewards",
    "mmrl.datasets": REPO / "datasets",
    "mmrl.configs": REPO / "configs",
}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _source(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The module a `from ... import` in module `name` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports, at any depth of its code (a function-level
    import is an arrow too: it runs; one under `if TYPE_CHECKING:` is not: it never does). `from a import b` points at `a.b` when that is a module,
    else at `a`; a parent package that Python imports on the way is not an arrow."""
    graph = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        deps = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        type_only = {  # `if TYPE_CHECKING:` imports never run: not an arrow
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for inner in ast.walk(stmt)
        }
        for node in ast.walk(tree):
            if id(node) in type_only:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _source(node, name, is_package)
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source for a in node.names
                ]
            else:
                continue
            deps |= {t for t in targets if t in mods and t != name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    mods = modules()
    assert "mmrl.train.grpo" in mods and "mmrl.verifiers.registry" in mods  # the walk sees every root
    found = cycles(import_graph(mods))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_training_loop_imports_no_composition():
    graph = import_graph(modules())
    compositions = {
        "mmrl.compose",
        "mmrl.distributed.ray_backend",
        "mmrl.distributed.deepspeed_group",
        "mmrl.train.async_grpo",
        "mmrl.train.colocated",
    }
    assert not graph["mmrl.train.grpo"] & compositions
    assert not {m for m, deps in graph.items() if "mmrl.compose" in deps} - {"mmrl.cli"}


@pytest.mark.parametrize(
    "override",
    [
        "trainer.backend=ray",
        "trainer.mode=async algo.tis=token",
        "trainer.strategy=deepspeed",
        "rollout.engine=vllm",
    ],
)
def test_the_loop_alone_refuses_a_composition_it_does_not_run(override, tmp_path):
    from mmrl.config import load_config
    from mmrl.train.grpo import train

    cfg = load_config("vision_reasoning", overrides=[*override.split(), f"trainer.run_dir={tmp_path}"])
    with pytest.raises(ValueError, match=f"{override.split()[0]} is a composition of mmrl.compose"):
        train(cfg)
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize(
    "override, module",
    [
        (None, "mmrl.train.grpo"),
        ("trainer.mode=async algo.tis=token", "mmrl.train.async_grpo"),
        ("rollout.engine=vllm", "mmrl.train.colocated"),
    ],
)
def test_compose_picks_the_composition_by_name(override, module):
    from mmrl.compose import composition
    from mmrl.config import load_config

    cfg = load_config("vision_reasoning", overrides=override.split() if override else [])
    assert composition(cfg).make_trainee.__module__ == module


def _from_imports(path: Path, name: str, mods: dict[str, Path]):
    """(line, module, imported name) for every `from <package module> import name` in the file,
    at any depth (a function-level import runs only when its path does: a stale one hides)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = _source(node, name, is_package)
        if source in mods:
            for alias in node.names:
                if alias.name != "*":
                    yield node.lineno, source, alias.name


def test_every_from_import_of_the_package_names_something_that_exists():
    """A name moved or renamed leaves no lazy import behind (a Ray worker once died at start on
    `from mmrl.rewards.config import build_reward_models`, moved to the catalog, which no test
    had run): every file of the package, the tests and the benchmarks is read, imports inside
    functions included, and each name must be defined by its module or be a submodule."""
    import importlib

    mods = modules()
    files = {**mods}
    for folder in ("tests", "benchmarks"):
        for path in (REPO / folder).rglob("*.py"):
            files[f"{folder}.{path.stem}"] = path
    stale, loaded = [], {}
    for name, path in sorted(files.items()):
        for line, source, imported in _from_imports(path, name, mods):
            if f"{source}.{imported}" in mods:
                continue
            if source not in loaded:
                try:
                    loaded[source] = importlib.import_module(source)
                except ImportError as exc:  # an optional package (vLLM, ...) this machine lacks
                    if (exc.name or "").split(".")[0] in ("mmrl", "verifiers", "rewards", "datasets"):
                        raise
                    loaded[source] = None
            module = loaded[source]
            if module is not None and not hasattr(module, imported):
                stale.append(f"{path.relative_to(REPO)}:{line}: {source} has no {imported!r}")
    assert not stale, "imports of names that do not exist:\n" + "\n".join(stale)

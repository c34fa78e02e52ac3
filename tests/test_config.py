"""Config: dataclass defaults, the task recipe, YAML files and key=value overrides."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf.errors import ConfigKeyError, ValidationError

from mmrl.config import Config, load_config, task_names


def test_task_recipe_loads_and_overrides_apply_on_top(tmp_path):
    cfg = load_config("vision_reasoning")
    assert isinstance(cfg, Config)
    assert cfg.data.kinds == ["colour_code"] and cfg.trainer.total_steps == 200
    extra = tmp_path / "extra.yaml"
    extra.write_text("rollout:\n  group_size: 4\noptim:\n  lr: 1.0e-4\n")
    cfg = load_config("vision_reasoning", extra, ["optim.lr=5e-5", "data.kinds=[count,bar_chart]"])
    assert cfg.rollout.group_size == 4  # from the file
    assert cfg.optim.lr == 5e-5  # the override wins over the file
    assert cfg.data.kinds == ["count", "bar_chart"]


def test_unknown_keys_and_wrong_types_name_the_full_key():
    with pytest.raises(ConfigKeyError, match="trainer.totl_steps|totl_steps"):
        load_config("vision_reasoning", overrides=["trainer.totl_steps=3"])
    with pytest.raises(ValidationError, match="rollout.group_size"):
        load_config("vision_reasoning", overrides=["rollout.group_size=many"])


def test_invalid_combinations_are_rejected_with_a_reason():
    with pytest.raises(ValueError, match="mini_batches must divide"):
        load_config("vision_reasoning", overrides=["trainer.mini_batches=3"])
    with pytest.raises(ValueError, match="kl_estimator"):
        load_config("vision_reasoning", overrides=["algo.kl_estimator=k9"])
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        load_config("nope")
    with pytest.raises(ValueError, match="key=value"):
        load_config("vision_reasoning", overrides=["lonely"])


def test_every_config_field_has_a_docstring():
    """Every knob is documented where its default lives: a string right under the field."""
    import ast
    import inspect

    import mmrl.config as config_module
    import mmrl.models.tiny as tiny_module
    import mmrl.rewards.config as rewards_config_module

    documented: dict[str, set[str]] = {}
    for module in (config_module, tiny_module, rewards_config_module):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ClassDef):
                names = documented.setdefault(node.name, set())
                for stmt, nxt in zip(node.body, node.body[1:]):
                    if (
                        isinstance(stmt, ast.AnnAssign)
                        and isinstance(nxt, ast.Expr)
                        and isinstance(nxt.value, ast.Constant)
                    ):
                        names.add(stmt.target.id)

    def check(cls) -> int:
        count = 0
        for f in dataclasses.fields(cls):
            assert f.name in documented[cls.__name__], f"{cls.__name__}.{f.name} has no docstring"
            count += 1
            if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory()):
                count += check(type(f.default_factory()))
        return count

    assert check(Config) > 40


def test_task_names_come_from_the_installed_recipes():
    assert "vision_reasoning" in task_names()

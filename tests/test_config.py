"""Config: dataclass defaults, the task recipe, YAML files and key=value overrides."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf.errors import ConfigKeyError, ValidationError

from mmrl.config import Config, count_fields, load_config, task_names, undocumented_fields


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
    # A lower clip bound of 1 or more removes the floor: CISPO's choice, meaningless for PPO.
    with pytest.raises(ValueError, match=r"clip_low must be in \[0, 1\)"):
        load_config("vision_reasoning", overrides=["algo.clip_low=1.0"])
    assert (
        load_config(
            "vision_reasoning", overrides=["algo.policy_loss=cispo", "algo.clip_low=1.0"]
        ).algo.clip_low
        == 1
    )


CONFIG_ROOTS = [
    ("mmrl.config", "Config"),
    ("mmrl.train.flow_config", "FlowConfig"),
    ("mmrl.train.flow_config", "DecoupledConfig"),
    ("mmrl.eval.config", "EvalConfig"),
    ("mmrl.server.config", "ServeConfig"),
    ("mmrl.rewards.config", "ModelRewardsConfig"),
]


@pytest.mark.parametrize(("module", "root"), CONFIG_ROOTS)
def test_every_config_field_has_a_docstring(module, root):
    """Every knob is documented where its default lives: a string right under the field, in
    every config dataclass reachable from each config root."""
    import importlib

    cls = getattr(importlib.import_module(module), root)
    undocumented = undocumented_fields(cls)
    assert not undocumented, f"fields without a docstring: {undocumented}"
    assert count_fields(cls) >= 5


def test_the_docstring_check_catches_a_missing_docstring():
    @dataclasses.dataclass
    class Knobs:
        documented: int = 1
        """Yes."""
        bare: int = 2

    assert undocumented_fields(Knobs) == ["Knobs.bare"]


def test_task_names_come_from_the_installed_recipes():
    assert "vision_reasoning" in task_names()

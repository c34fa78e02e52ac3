"""Config mistakes are caught when the config is loaded, before anything is written, with one
clear line naming the file (and line) or the key: unknown keys, YAML syntax errors, sizes that
must be positive, unknown advantage estimators."""

from __future__ import annotations

import pytest

from mmrl.cli import main
from mmrl.config import load_config


def _cli_error(capsys, *argv: str) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


def test_an_unknown_key_is_one_clear_line_from_the_cli(capsys, tmp_path):
    err = _cli_error(capsys, "trainer.total_stepz=5", f"trainer.run_dir={tmp_path / 'run'}")
    assert len(err.splitlines()) == 1
    assert "trainer.total_stepz" in err and "unknown key" in err
    assert not (tmp_path / "run").exists()


def test_an_unknown_key_in_a_config_file_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("trainer:\n  total_steps: 5\n  evall_every: 2\n")
    with pytest.raises(ValueError) as info:
        load_config("vision_reasoning", config_file=path)
    assert str(path) in str(info.value) and "trainer.evall_every" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_wrong_type_names_the_key(capsys):
    err = _cli_error(capsys, "trainer.total_steps=many")
    assert len(err.splitlines()) == 1 and "trainer.total_steps" in err


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("trainer:\n  total_steps: 5\n  eval_every: [2\n")
    with pytest.raises(ValueError) as info:
        load_config("vision_reasoning", config_file=path)
    message = str(info.value)
    assert message.startswith(f"{path}:") and "invalid YAML" in message
    assert "<unicode string>" not in message


@pytest.mark.parametrize(
    "override",
    [
        "trainer.eval_every=0",
        "trainer.total_steps=0",
        "trainer.total_steps=-3",
        "trainer.checkpoint_every=-1",
        "trainer.keep_last=-1",
        "trainer.eval_size=-5",
        "trainer.ppo_epochs=0",
        "trainer.max_consecutive_skips=0",
        "rollout.max_new_tokens=0",
        "data.max_prompt_chars=0",
        "optim.lr=-0.1",
    ],
)
def test_sizes_that_must_be_positive_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=f"invalid config: {key.replace('.', '[.]')} must be"):
        load_config("vision_reasoning", overrides=[override])


@pytest.mark.parametrize(
    "override", ["trainer.keep_last=0", "trainer.eval_size=0", "trainer.checkpoint_every=0"]
)
def test_zero_keeps_its_documented_meaning_where_it_has_one(override):
    load_config("vision_reasoning", overrides=[override])


def test_a_mistyped_advantage_is_refused_before_the_run_folder_exists(capsys, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the run went on to load the model")

    monkeypatch.setattr("mmrl.train.grpo.builtin_base", refuse)
    err = _cli_error(capsys, "algo.advantage=gpro", f"trainer.run_dir={tmp_path / 'run'}")
    assert "algo.advantage" in err and "'gpro'" in err and "grpo" in err
    assert not (tmp_path / "run").exists()


def test_a_missing_eval_suite_is_refused_before_the_run_folder_exists(capsys, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the run went on to load the model")

    monkeypatch.setattr("mmrl.train.grpo.builtin_base", refuse)
    err = _cli_error(
        capsys,
        f"trainer.eval_suite={tmp_path / 'no_suite'}",
        "data.num_train=8",
        "data.num_heldout=4",
        f"trainer.run_dir={tmp_path / 'run'}",
    )
    assert "trainer.eval_suite" in err and "no_suite" in err
    assert not (tmp_path / "run").exists()

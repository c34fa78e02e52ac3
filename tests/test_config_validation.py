"""Config mistakes are caught when the config is loaded, before anything is written, with one
clear line naming the file (and line) or the key: unknown keys, YAML syntax errors, sizes that
must be positive, unknown advantage estimators."""

from __future__ import annotations

import re

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


# ---------------------------------------------------------------------------------------------
# Issue 36, defects 1-3: raw tracebacks from config mistakes, "did you mean", `mmrl serve` config.


@pytest.mark.parametrize("key", ["trainer.mini_batches", "trainer.train_workers"])
def test_a_zero_divisor_is_a_config_error_not_a_zero_division(capsys, key):
    # trainer.mini_batches=0 used to raise ZeroDivisionError: the modulo sat in the same list
    # as the >= 1 check.
    err = _cli_error(capsys, f"{key}=0")
    assert len(err.splitlines()) == 1 and key in err and "ZeroDivision" not in err


def test_a_folder_given_as_config_file_is_named(capsys, tmp_path):
    err = _cli_error(capsys, "--config", str(tmp_path))
    assert err == f"mmrl train: config: {tmp_path}: is a folder, not a config file (give a .yaml file)"


def test_an_unreadable_config_file_is_named(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_bytes(b"trainer:\n  total_steps: \xff\n")
    with pytest.raises(ValueError, match=f"{path}: not UTF-8 text"):
        load_config(config_file=path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            f"trainer.total_steps={10**23}",
            re.escape("trainer.total_steps must be within +-(2^63 - 1), got an integer of 24 digits"),
        ),
        (f"trainer.seed=-{10**23}", "trainer.seed must be within"),
        ("optim.lr=inf", "optim.lr must be a finite number, got inf"),
        ("algo.entropy_coef=nan", "algo.entropy_coef must be a finite number, got nan"),
        ("optim.betas=[0.9,.inf]", r"optim.betas\[1\] must be a finite number"),
    ],
)
def test_numbers_no_64_bit_integer_or_float_can_hold_are_refused(override, message):
    with pytest.raises(ValueError, match="invalid config: " + message):
        load_config(overrides=[override])


def _numeric_fields(obj, prefix=""):
    import dataclasses

    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _numeric_fields(value, f"{prefix}{f.name}.")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{f.name}", type(value)


def test_no_numeric_field_value_raises_anything_but_a_config_error():
    # Every int and float field of the training config set to 0, -1, 10^23 and (floats) NaN:
    # the config is accepted or refused with a ValueError, never another exception (the
    # ZeroDivisionError of trainer.mini_batches=0). Built directly (no OmegaConf: fast).
    import dataclasses
    import math

    from mmrl.config import Config

    base = Config()
    fields = list(_numeric_fields(base))
    assert len(fields) > 80
    for key, kind in fields:
        values = [0, -1, 10**23] if kind is int else [0.0, -1.0, math.nan, math.inf]
        for value in values:
            *parents, name = key.split(".")

            def replace(obj, path, value=value, name=name):
                if not path:
                    return dataclasses.replace(obj, **{name: value})
                return dataclasses.replace(obj, **{path[0]: replace(getattr(obj, path[0]), path[1:])})

            try:
                replace(base, parents)
            except ValueError:
                pass
            if value in (10**23,) or (isinstance(value, float) and not math.isfinite(value)):
                with pytest.raises(ValueError, match=key.replace(".", "[.]")):
                    replace(base, parents)


def test_train_suggests_the_closest_key_as_serve_does(capsys, tmp_path):
    err = _cli_error(capsys, "trainer.totl_steps=3")
    assert (
        err
        == "mmrl train: config: overrides: unknown key 'trainer.totl_steps' (did you mean 'trainer.total_steps'?)"
    )
    path = tmp_path / "cfg.yaml"
    path.write_text("algo:\n  kl_coeff: 0.1\n")
    err = _cli_error(capsys, "--config", str(path))
    assert err.endswith(f"{path}: unknown key 'algo.kl_coeff' (did you mean 'algo.kl_coef'?)")
    # Nothing close: no suggestion.
    err = _cli_error(capsys, "trainer.zzzzzz=3")
    assert err.endswith("unknown key 'trainer.zzzzzz'")


def _serve_error(capsys, *argv: str) -> str:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_serve_config_errors_are_one_line_naming_file_line_and_key(capsys, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 8000\nhost: [127.0.0.1\n")
    err = _serve_error(capsys, "--config", str(path))
    assert err.startswith(f"mmrl serve: error: {path}:3:1: invalid YAML: ")
    assert "line 2, column 7" in err and "<unicode string>" not in err
    path.write_text("porrt: 8000\n")
    err = _serve_error(capsys, "--config", str(path))
    assert err == f"mmrl serve: error: {path}: unknown key 'porrt' (did you mean 'port'?)"
    err = _serve_error(capsys, "--config", str(tmp_path))
    assert err == f"mmrl serve: error: {tmp_path}: is a folder, not a config file (give a .yaml file)"
    err = _serve_error(capsys, "--config", str(tmp_path / "missing.yaml"))
    assert "config file not found" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("keep_alive_s: -1\n", "keep_alive_s must be > 0, got -1.0"),
        ("keep_alive_s: 0\n", "keep_alive_s must be > 0"),
        ("keep_alive_s: .inf\n", "keep_alive_s must be a finite number"),
        (f"max_body_bytes: {10**23}\n", "max_body_bytes must be within"),
    ],
)
def test_serve_refuses_unusable_numbers(tmp_path, text, message):
    # Through the loader, not `main`: a setting wrongly accepted would start a server.
    from mmrl.server.config import load_serve_config

    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_serve_config(path)


def test_the_flow_config_refuses_unusable_numbers_too():
    from mmrl.train.flow_config import load_flow_config

    with pytest.raises(ValueError, match="invalid config: trainer.total_steps must be within"):
        load_flow_config(overrides=[f"trainer.total_steps={10**23}"])

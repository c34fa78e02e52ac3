"""A new user's first commands (issue 48, first-day defects): overrides among the options, and
what the command line says when something is wrong. Fast: `mmrl check` loads no model."""

from __future__ import annotations

import pytest

from mmrl.cli import main


@pytest.mark.parametrize(
    "argv",
    [
        # After an option that takes a value, and after a flag (issue 48, item 1).
        ["check", "--task", "vision_reasoning", "trainer.total_steps=3", "--resume", "auto", "trainer.prompts_per_step=4"],
        ["check", "--dump-steps", "trainer.total_steps=3", "trainer.prompts_per_step=4"],
        ["check", "trainer.total_steps=3", "--dump-steps", "trainer.prompts_per_step=4"],
        ["check", "trainer.total_steps=3", "--task", "vision_reasoning", "--dump-steps", "trainer.prompts_per_step=4"],
    ],
)  # fmt: skip
def test_overrides_mix_with_options_in_any_order(argv, tmp_path, capsys):
    if "--resume" in argv:  # resuming needs the run to continue
        argv = [*argv, f"trainer.run_dir={tmp_path / 'run'}"]
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "ready: GRPO-family training" in out
    assert "for 3 steps of 4 prompts" in out  # both overrides applied, wherever they stood


@pytest.mark.parametrize("command", ["check", "train"])  # every subcommand that takes overrides
def test_overrides_after_options_keep_their_order_and_reach_the_config(command, monkeypatch):
    seen = {}

    def fake_check(task, config, overrides, **kwargs):
        seen.update(task=task, overrides=overrides)

        class Report:
            problems = ["stop here"]  # `train` stops after its check

            def print(self, command):
                return 2

        return Report()

    monkeypatch.setattr("mmrl.check.check_train", fake_check)
    argv = [command, "a.b=1", "--task", "perception", "--dump-steps", "a.b=2", "--resume", "auto", "c=3"]
    assert main(argv) == 2
    assert seen["task"] == "perception"
    assert seen["overrides"] == ["a.b=1", "a.b=2", "c=3", "trainer.resume=auto", "trainer.dump_steps=true"]


def test_a_stray_word_is_refused_with_the_subcommand_usage(capsys):
    with pytest.raises(SystemExit) as info:
        main(["check", "--dump-steps", "trainer.total_steps=2", "--no-such-option"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: mmrl check" in err and "unrecognized arguments: --no-such-option" in err

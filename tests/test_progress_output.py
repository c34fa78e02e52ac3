"""What progress bars print: tqdm on a terminal; off one (a log file, a pipe), plain log lines
at an interval and never a carriage return or a cursor code. The image base's warm-up has a
bar with an ETA, and the held-out evaluation's ETA is not extrapolated from its first response.
Time is a fake clock here (tqdm's), so nothing depends on how fast the machine is."""

from __future__ import annotations

import io
import logging
import re
import time

import pytest


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """tqdm's clock, moved by hand (from now, so tqdm's monitor thread sees nothing overdue)."""
    import tqdm.std

    now = [time.time()]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    return now


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "mmrl.progress"]


def test_off_a_terminal_a_bar_logs_one_plain_line_per_interval(clock, caplog):
    from mmrl.progress import LOG_INTERVAL_S, ProgressBar

    caplog.set_level(logging.INFO, logger="mmrl.progress")
    log_file = io.StringIO()
    bar = ProgressBar(total=100, desc="demo", unit="step", file=log_file)
    for i in range(100):
        clock[0] += 1.0
        bar.update(1)
        bar.set_postfix(loss=f"{i:.3f}")  # (refreshes the bar: not a line each time)
    bar.close()
    lines = progress_lines(caplog)
    assert log_file.getvalue() == ""  # tqdm itself wrote nothing, not even a newline
    assert not any("\r" in line or "\x1b" in line or "\n" in line for line in lines)
    # The start, one line per LOG_INTERVAL_S (30 s: 100 steps of 1 s), the end.
    assert LOG_INTERVAL_S == 30
    assert len(lines) == 5, lines
    assert lines[0].startswith("demo:   0% 0/100")
    assert lines[-1].startswith("demo: 100% 100/100 [01:40<00:00") and "loss=99.000" in lines[-1]
    assert "30/100 [00:30<01:10" in lines[1]  # counts, elapsed and ETA


def test_off_a_terminal_a_slower_pace_does_not_stretch_the_interval(clock, caplog):
    """30 steps of 1 s, then steps of 10 s (an evaluation, a slower phase): a line still comes
    at the first step 30 s or more after the last, not after as many steps as the fast phase
    fitted into 30 s (tqdm's adaptive count, 300 s here)."""
    from mmrl.progress import ProgressBar

    caplog.set_level(logging.INFO, logger="mmrl.progress")
    bar = ProgressBar(total=60, desc="pace", file=io.StringIO())
    for i in range(60):
        clock[0] += 1.0 if i < 30 else 10.0
        bar.update(1)
    bar.close()
    elapsed = [
        60 * int(m) + int(s) for m, s in re.findall(r"\[(\d\d):(\d\d)<", "\n".join(progress_lines(caplog)))
    ]
    assert all(b - a <= 40 for a, b in zip(elapsed, elapsed[1:])), elapsed


def test_a_bar_iterated_to_its_end_and_one_left_early_log_their_last_state(clock, caplog):
    from mmrl.progress import ProgressBar

    caplog.set_level(logging.INFO, logger="mmrl.progress")
    for _ in ProgressBar(range(3), desc="loop", file=io.StringIO(), leave=False):
        clock[0] += 1.0
    bar = ProgressBar(total=10, desc="stopped", file=io.StringIO())
    bar.update(4)
    bar.close()
    assert progress_lines(caplog) == [
        "loop:   0% 0/3 [00:00<?, ?it/s]",
        "loop: 100% 3/3 [00:03<00:00,  1.00it/s]",
        "stopped:   0% 0/10 [00:00<?, ?it/s]",
        "stopped:  40% 4/10 [00:00<?, ?it/s]",
    ]


def test_on_a_terminal_the_bar_is_tqdms_and_disable_none_still_means_terminal_only(caplog):
    from mmrl.progress import ProgressBar

    caplog.set_level(logging.INFO, logger="mmrl.progress")
    term = Terminal()
    with ProgressBar(total=3, desc="tty", file=term) as bar:
        bar.update(3)
    assert "\r" in term.getvalue() and "3/3" in term.getvalue()
    assert progress_lines(caplog) == []
    assert ProgressBar(total=3, file=io.StringIO(), disable=None).disable
    assert not ProgressBar(total=3, file=Terminal(), disable=None).disable


def test_the_image_base_warm_up_has_a_bar_and_names_its_warm_up_once(tmp_path, caplog):
    """The warm-up (minutes in the recipe) counts its steps towards `max_steps` with an ETA;
    off a terminal as log lines. The line before it says "warm-up" once."""
    from mmrl.models.image_base import ImageWarmupConfig, builtin_image_base
    from mmrl.train.flow_config import load_flow_config

    caplog.set_level(logging.INFO)
    spec = load_flow_config("text_to_image").model.tiny
    quick = ImageWarmupConfig(max_steps=2, batch_size=4, eval_every=1, eval_size=3, eval_num_steps=2)
    builtin_image_base(spec, quick, str(tmp_path))
    building = [r.getMessage() for r in caplog.records if r.getMessage().startswith("building")]
    assert len(building) == 1 and building[0].count("warm-up") == 1, building
    assert "the built-in image base (flow-matching warm-up) once" in building[0]
    lines = progress_lines(caplog)
    assert lines[0].startswith("warm-up of the built-in image base (stops at ")
    assert re.search(r" 2/2 \[\d\d:\d\d<00:00, .*acc=", lines[-1]), lines


class Finished(Exception):
    pass


class ChunkedEngine:
    """4 chunks of 4 responses, 20 s each on the fake clock: each chunk's responses finish
    together at its end, as the HF engine's do."""

    max_batch_rows = 4

    def __init__(self, clock):
        self.clock = clock

    def generate(self, samples, params, on_response=None):
        for start in range(0, len(samples), self.max_batch_rows):
            self.clock[0] += 20.0  # the chunk's prefill and decode
            for row in range(start, start + self.max_batch_rows):
                self.clock[0] += 0.001
                on_response(row, "")
        raise Finished  # (the bar is all these tests look at)


def test_the_held_out_evaluations_eta_is_not_extrapolated_from_its_first_response(clock, monkeypatch):
    """Counting a chunk's first response alone gave an ETA of (responses left) x (the chunk's
    prefill): 2:37:20 for a few minutes' evaluation. Every ETA shown is within a factor 2 of
    the time truly left."""
    from mmrl.datasets.procedural import make_samples
    from mmrl.train.evaluation import run_evaluation

    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    samples = make_samples(["colour_code"], 16, "heldout")
    with pytest.raises(Finished):
        run_evaluation(ChunkedEngine(clock), None, samples, 4, progress=True)
    shown = re.findall(r" (\d+)/16 \[(\d\d):(\d\d)<(\d\d):(\d\d)", term.getvalue())
    assert [int(n) for n, *_ in shown] == [4, 8, 12, 16]
    for n, *_, m, s in shown:
        truly_left = 20.0 * (16 - int(n)) / 4
        assert 60 * int(m) + int(s) <= 2 * truly_left + 1, (n, m, s)


def test_the_held_out_evaluation_off_a_terminal_writes_log_lines_not_a_bar(clock, monkeypatch, caplog):
    from mmrl.datasets.procedural import make_samples
    from mmrl.train.evaluation import run_evaluation

    caplog.set_level(logging.INFO, logger="mmrl.progress")
    log_file = io.StringIO()
    monkeypatch.setattr("sys.stderr", log_file)
    samples = make_samples(["colour_code"], 16, "heldout")
    with pytest.raises(Finished):
        run_evaluation(ChunkedEngine(clock), None, samples, 4, progress=True)
    assert log_file.getvalue() == ""
    lines = progress_lines(caplog)
    assert lines[0].startswith("held-out eval:   0% 0/16") and "16/16" in lines[-1], lines
    assert not any("\r" in line or "\x1b" in line for line in lines)

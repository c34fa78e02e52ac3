"""Long runs survive: a killed process resumes exactly, a damaged checkpoint is skipped,
non-finite rewards and gradients skip the step (counted), signals write a checkpoint."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmrl.config import load_config
from mmrl.datasets.procedural import make_samples
from mmrl.datasets.readers import write_jsonl
from mmrl.train.checkpoint import find_resume_checkpoint, list_checkpoints
from mmrl.train.grpo import train
from tests.conftest import assert_no_prompt_lost_or_trained_twice, same_checkpoint_state

pytestmark = pytest.mark.slow

SHORT = [
    "trainer.prompts_per_step=4",
    "rollout.group_size=2",
    "trainer.eval_size=8",
    "trainer.eval_every=3",
    "trainer.progress=false",
    "trainer.save_final=false",
    "trainer.threads=1",
]


def _cli(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "mmrl.cli", "train", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock figures (the only thing that may differ)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.append({k: v for k, v in record.items() if not k.startswith(("time/", "throughput/"))})
    return rows


def _wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 900) -> None:
    start = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {path} appeared: {proc.stderr.read()[-3000:]}")
        if time.monotonic() - start > limit_s:  # a hang guard, not a performance check
            proc.kill()
            raise AssertionError(f"{path} never appeared")
        time.sleep(0.05)


def test_a_run_killed_with_sigkill_resumes_with_exactly_the_uninterrupted_metrics(mmrl_cache, tmp_path):
    args = [*SHORT, "trainer.total_steps=6", "trainer.checkpoint_every=2", "trainer.keep_last=0"]
    whole = _cli(*args, f"trainer.run_dir={tmp_path / 'whole'}")
    assert whole.wait() == 0, whole.stderr.read()[-3000:]

    killed = _cli(*args, f"trainer.run_dir={tmp_path / 'killed'}")
    _wait_for(tmp_path / "killed" / "checkpoints" / "step_00000002" / "manifest.json", killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    done = {c.step for c in list_checkpoints(tmp_path / "killed")}
    assert 2 in done and 6 not in done  # really killed mid-run, after a checkpoint

    resumed = _cli(*args, f"trainer.run_dir={tmp_path / 'killed'}", "--resume", "auto")
    assert resumed.wait() == 0, resumed.stderr.read()[-3000:]
    assert "resumed from" in resumed.stderr.read()
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "whole")


def test_a_truncated_newest_checkpoint_is_skipped_with_a_warning(mmrl_cache, tmp_path, caplog):
    run_dir = tmp_path / "run"
    base = [*SHORT, "trainer.checkpoint_every=1", "trainer.keep_last=0", f"trainer.run_dir={run_dir}"]
    train(load_config("vision_reasoning", overrides=[*base, "trainer.total_steps=3"]))
    newest = run_dir / "checkpoints" / "step_00000003" / "trainer_state.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # a crash mid-write, or a full disk
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint(run_dir).step == 2
    assert "skipping damaged checkpoint" in caplog.text and "trainer_state.pt" in caplog.text
    with caplog.at_level(logging.INFO):
        result = train(
            load_config("vision_reasoning", overrides=[*base, "trainer.total_steps=4", "trainer.resume=auto"])
        )
    assert "at step 2" in caplog.text and result.steps == 4
    assert [r["step"] for r in _metrics(run_dir) if "reward/mean" in r] == [1, 2, 3, 4]


def _nan_data(tmp_path: Path, nan_ids: set[int]) -> list[str]:
    samples = make_samples(["colour_code"], 8, "train")
    for i, s in enumerate(samples):
        s.reward_model.verifier = "nan_on_marked"
        s.extra_info["nan"] = i in nan_ids
    write_jsonl(samples, tmp_path / "train.jsonl")
    heldout = make_samples(["colour_code"], 4, "heldout")
    for s in heldout:
        s.reward_model.verifier = "nan_on_marked"
    write_jsonl(heldout, tmp_path / "heldout.jsonl")
    return [
        f"data.train_files=[{tmp_path / 'train.jsonl'}]",
        f"data.heldout_files=[{tmp_path / 'heldout.jsonl'}]",
        "reward.plugins=[hang_verifier]",
    ]


def test_a_nan_reward_skips_the_step_names_the_sample_and_training_goes_on(
    mmrl_cache, tmp_path, monkeypatch, caplog
):
    """With every reward in before the update (`reward.update_while_scoring=false`) a NaN skips
    the whole step. Pipelined, a NaN that arrives after a mini-batch was applied is a partial step
    instead: tests/test_update_while_scoring.py covers that case."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    data = _nan_data(tmp_path, {3})
    overrides = [*SHORT, *data, "trainer.total_steps=2", "reward.update_while_scoring=false"]
    with caplog.at_level(logging.WARNING):
        result = train(
            load_config("vision_reasoning", overrides=[*overrides, f"trainer.run_dir={tmp_path / 'run'}"])
        )
    steps = [r for r in _metrics(result.run_dir) if "guard/skipped_step" in r]
    assert [r["guard/skipped_step"] for r in steps].count(
        1.0
    ) == 1  # sample 3 is drawn in one of the two steps
    skipped = next(r for r in steps if r["guard/skipped_step"] == 1.0)
    assert skipped["guard/nonfinite_rewards"] == 2  # both of its responses
    assert "vision_reasoning/colour_code/train/0/3" in caplog.text and "non-finite reward" in caplog.text


def test_repeated_non_finite_steps_stop_the_run_with_the_last_good_checkpoint_named(
    mmrl_cache, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    data = _nan_data(tmp_path, set(range(8)))  # every reward is NaN
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            *SHORT,
            *data,
            "trainer.total_steps=5",
            "trainer.max_consecutive_skips=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(
        RuntimeError, match=r"2 steps in a row \(up to step 2\) were skipped .* last good checkpoint is none"
    ):
        train(cfg)


class _NaNGradient(torch.autograd.Function):
    """Identity forward; NaN gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def test_a_nan_gradient_skips_the_optimizer_step_and_leaves_the_weights_untouched(
    mmrl_cache, tmp_path, monkeypatch
):
    import mmrl.train.update as update

    original = update.response_logprobs
    calls = {"n": 0}

    def poisoned(model, batch, *args, **kwargs):
        logprobs, entropy = original(model, batch, *args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 1:  # the first mini-batch of the first update
                logprobs = _NaNGradient.apply(logprobs)
        return logprobs, entropy

    monkeypatch.setattr(update, "response_logprobs", poisoned)
    cfg = load_config(
        "vision_reasoning",
        overrides=[
            *SHORT,
            "trainer.total_steps=1",
            "trainer.mini_batches=2",
            f"trainer.run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(cfg)
    (step,) = [r for r in _metrics(result.run_dir) if "actor/skipped_steps" in r]
    assert step["actor/skipped_steps"] == 1.0  # of the step's two optimizer steps, the poisoned one
    assert step["actor/grad_norm"] == step["actor/grad_norm"]  # the other step's norm is finite


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(mmrl_cache, tmp_path):
    args = [*SHORT, "trainer.total_steps=50", f"trainer.run_dir={tmp_path / 'run'}"]
    proc = _cli(*args)
    _wait_for(tmp_path / "run" / "metrics.jsonl", proc)
    while not any(
        '"reward/mean"' in line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ):
        time.sleep(0.05)  # at least one step done
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert "interrupted at step" in out
    ckpt = find_resume_checkpoint(tmp_path / "run")
    assert ckpt is not None and 1 <= ckpt.step < 50
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["interrupted"] is True


# `mmrl train` (mmrl.cli.main) in this process, sending itself SIGINT (Ctrl-C) once, while it
# hashes the files of the checkpoint whose temporary folder name holds MMRL_TEST_SIGINT_IN.
SIGINT_DRIVER = r"""
import os, signal, sys
from mmrl.heap import imports_without_gc
with imports_without_gc():  # as `mmrl train` imports the trainer
    import mmrl.train.checkpoint as ck
    from mmrl.cli import main

where, sent = os.environ["MMRL_TEST_SIGINT_IN"], []
sha_fn = ck._sha256
def _sha256(path):
    if where in str(path) and not sent:
        sent.append(path)
        os.kill(os.getpid(), signal.SIGINT)
    return sha_fn(path)
ck._sha256 = _sha256
sys.exit(main(sys.argv[1:]))
"""


def test_sigint_during_a_checkpoint_write_then_resume_is_bit_exact(mmrl_cache, tmp_path):
    # Issue 36, point 9: Ctrl-C while checkpoint 2 is being written: the write finishes, the run
    # stops there cleanly, and --resume auto ends with the metrics, weights, optimizer and RNG
    # states of the uninterrupted run, bit for bit.
    from safetensors.torch import load_file

    from mmrl.train.checkpoint import verify_checkpoint

    args = [*SHORT, "trainer.total_steps=4", "trainer.checkpoint_every=2", "trainer.keep_last=0"]
    whole = _cli(*args, f"trainer.run_dir={tmp_path / 'whole'}")
    assert whole.wait() == 0, whole.stderr.read()[-3000:]

    def run(*extra: str) -> subprocess.CompletedProcess:
        env = dict(
            os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", MMRL_TEST_SIGINT_IN=".tmp_step_00000002"
        )
        command = [sys.executable, "-c", SIGINT_DRIVER, "train", *args, f"trainer.run_dir={tmp_path / 'cut'}"]
        return subprocess.run([*command, *extra], env=env, capture_output=True, text=True)

    cut = run()
    assert cut.returncode == 130, cut.stderr[-3000:]  # Ctrl-C's status, after the checkpoint
    assert "interrupted at step 2" in cut.stdout and "SIGINT" in cut.stderr
    assert [c.step for c in list_checkpoints(tmp_path / "cut")] == [2]
    assert verify_checkpoint(tmp_path / "cut" / "checkpoints" / "step_00000002") is None
    assert not [p for p in (tmp_path / "cut" / "checkpoints").iterdir() if p.name.startswith(".")]

    resumed = run("--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_00000002" in resumed.stderr
    assert _metrics(tmp_path / "cut") == _metrics(tmp_path / "whole")
    for step in ("step_00000002", "step_00000004"):
        a, b = tmp_path / "cut" / "checkpoints" / step, tmp_path / "whole" / "checkpoints" / step
        wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
        assert wa.keys() == wb.keys() and wa
        for key in wa:
            assert torch.equal(wa[key], wb[key]), f"{step}: {key} differs"
        same_checkpoint_state(a, b, step)


def test_a_multi_turn_run_killed_inside_a_step_resumes_exactly(tmp_path, monkeypatch):
    """Tool samples (`visual_search`: they name `zoom_in`) and environment episodes
    (`minigrid`: each trajectory its own MiniGrid env, made and reset from its seed inside the
    step) on a random tiny model whose turns are read as zoom calls (`agent.plugins`) and end on
    any printable byte: the run is SIGKILLed while step 3's trajectories call their tools (a
    parse after the step-2 checkpoint), then resumed; every metric equals the uninterrupted
    run's, the `agent/` ones included, the environments' among them."""
    from mmrl.models.loading import make_policy
    from mmrl.models.tiny import TinyVLMSpec, build_processor, build_tiny_vlm

    plugins = str(Path(__file__).parent / "plugins")
    monkeypatch.setenv("PYTHONPATH", plugins + os.pathsep + os.environ.get("PYTHONPATH", ""))
    marker = tmp_path / "calls.txt"
    monkeypatch.setenv("MMRL_TEST_CALL_MARKER", str(marker))
    spec, model_dir = TinyVLMSpec(), tmp_path / "model"
    policy = make_policy(build_tiny_vlm(spec, seed=0), build_processor(spec))
    policy.model.generation_config.eos_token_id = [policy.stop_token_ids[0], *range(32, 127)]
    policy.model.save_pretrained(model_dir)
    policy.processor.save_pretrained(model_dir)
    args = [
        *SHORT, "trainer.total_steps=4", "trainer.checkpoint_every=2", "trainer.keep_last=0",
        "rollout.max_new_tokens=6", "data.kinds=[visual_search,minigrid]", f"model.path={model_dir}",
        "agent.plugins=[multiturn_formats]", "agent.call_format=plugin_marked_zoom", "agent.max_turns=2",
        "trainer.eval_every=4",
    ]  # fmt: skip
    whole = _cli(*args, f"trainer.run_dir={tmp_path / 'whole'}")
    assert whole.wait() == 0, whole.stderr.read()[-3000:]

    killed = _cli(*args, f"trainer.run_dir={tmp_path / 'killed'}")
    _wait_for(tmp_path / "killed" / "checkpoints" / "step_00000002" / "manifest.json", killed)
    marker.unlink(missing_ok=True)
    _wait_for(marker, killed)  # a tool call after the checkpoint: inside step 3's rollout
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    done = {c.step for c in list_checkpoints(tmp_path / "killed")}
    assert 2 in done and 4 not in done

    resumed = _cli(*args, f"trainer.run_dir={tmp_path / 'killed'}", "--resume", "auto")
    assert resumed.wait() == 0, resumed.stderr.read()[-3000:]
    whole_metrics = _metrics(tmp_path / "whole")
    assert any("agent/turns" in r and r["agent/turns"] > 1 for r in whole_metrics)
    assert any(r.get("agent/turns/minigrid/minigrid", 0) > 1 for r in whole_metrics)  # episodes in steps
    assert _metrics(tmp_path / "killed") == whole_metrics


# `mmrl train` in this process, SIGKILLing itself while a background thread seals the checkpoint
# whose temporary folder name holds MMRL_TEST_KILL_IN (its shards written, its checksums being
# computed; no manifest yet).
KILL_WHILE_SEALING = r"""
import os, signal, sys
from mmrl.heap import imports_without_gc
with imports_without_gc():
    import mmrl.train.checkpoint as ck
    from mmrl.cli import main

where = os.environ["MMRL_TEST_KILL_IN"]
sha_fn = ck._sha256
def _sha256(path):
    if where in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
    return sha_fn(path)
ck._sha256 = _sha256
sys.exit(main(sys.argv[1:]))
"""


def test_background_checkpoints_equal_synchronous_ones_and_a_kill_while_sealing_keeps_the_last(
    mmrl_cache, tmp_path
):
    """`trainer.async_checkpoint`: a run whose checkpoints are sealed in the background trains and
    checkpoints exactly as one that waits for them. Killed while checkpoint 3 is being sealed
    (after the loop went on), the run still has checkpoints 1 and 2: retention (keep_last=2) had
    not deleted checkpoint 1 for the unfinished 3. Resumed, it ends equal to the uninterrupted run,
    bit for bit (metrics, weights, the sharded optimizer state, the trainer state)."""
    from safetensors.torch import load_file

    args = [*SHORT, "trainer.total_steps=4", "trainer.checkpoint_every=1", "trainer.keep_last=2"]
    whole = _cli(*args, f"trainer.run_dir={tmp_path / 'whole'}")
    assert whole.wait() == 0, whole.stderr.read()[-3000:]

    run = tmp_path / "background"
    command = [sys.executable, "-c", KILL_WHILE_SEALING, "train", *args, "trainer.async_checkpoint=true",
               f"trainer.run_dir={run}"]  # fmt: skip
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", MMRL_TEST_KILL_IN=".tmp_step_00000003")
    killed = subprocess.run(command, env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [c.step for c in list_checkpoints(run)] == [1, 2]
    assert find_resume_checkpoint(run).step == 2
    left = list((run / "checkpoints").glob(".tmp_step_00000003_*"))
    assert left and (left[0] / "sharded" / ".metadata").is_file()  # its shards were written

    resumed = subprocess.run([*command, "--resume", "auto"], env={**env, "MMRL_TEST_KILL_IN": "never"},
                             capture_output=True, text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_00000002" in resumed.stderr
    assert not list((run / "checkpoints").glob(".tmp_step_*"))  # the leftover was removed
    assert (
        [c.step for c in list_checkpoints(run)]
        == [3, 4]
        == [c.step for c in list_checkpoints(tmp_path / "whole")]
    )
    assert _metrics(run) == _metrics(tmp_path / "whole")
    for step in ("step_00000003", "step_00000004"):
        a, b = run / "checkpoints" / step, tmp_path / "whole" / "checkpoints" / step
        wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), step
        same_checkpoint_state(a, b, step)


def test_an_async_run_killed_while_sealing_a_checkpoint_loses_no_prompt_and_trains_none_twice(
    mmrl_cache, tmp_path
):
    """The asynchronous mode, its generator one step ahead, killed while checkpoint 3 is sealed in
    the background: the run resumes from checkpoint 2, re-issues the prompts that were in flight
    there (counted), and over the whole lineage every prompt drawn is trained (or dropped or
    filtered, counted) exactly once, or still in flight in the last checkpoint."""
    args = [*SHORT, "trainer.total_steps=5", "trainer.checkpoint_every=1", "trainer.keep_last=2",
            "trainer.mode=async", "algo.tis=token", "trainer.max_staleness=1",
            "trainer.async_call_prompts=1", "trainer.async_checkpoint=true", "trainer.dump_steps=true"]  # fmt: skip
    run = tmp_path / "async"
    command = [sys.executable, "-c", KILL_WHILE_SEALING, "train", *args, f"trainer.run_dir={run}"]
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1", MMRL_TEST_KILL_IN=".tmp_step_00000003")
    killed = subprocess.run(command, env=env, capture_output=True, text=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert find_resume_checkpoint(run).step == 2
    at_two = torch.load(run / "checkpoints" / "step_00000002" / "trainer_state.pt", weights_only=False)
    in_flight_at_two = [k[0] for k in at_two["async_stream"]["in_flight"]]
    assert in_flight_at_two  # the generator had run ahead: prompts drawn, not trained

    resumed = subprocess.run([*command, "--resume", "auto"], env={**env, "MMRL_TEST_KILL_IN": "never"},
                             capture_output=True, text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_00000002" in resumed.stderr
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if m.get("step") == 5 and "async/reissued_total" in m][-1]
    assert last["async/reissued_total"] == len(in_flight_at_two)

    records = assert_no_prompt_lost_or_trained_twice(run, steps=5)
    after = [d for step in (3, 4, 5) for d in records[step]["trained"]]
    assert after[: len(in_flight_at_two)] == in_flight_at_two  # re-issued first, in draw order
    for step in range(1, 6):  # each dumped token's version, within the bound of its step
        rows = [
            json.loads(line) for line in (run / "dumps" / f"step_{step:06d}.jsonl").read_text().splitlines()
        ]
        versions = [v for row in rows for v in row["versions"]]
        assert versions and all(step - 2 <= v <= step - 1 for v in versions), (step, sorted(set(versions)))

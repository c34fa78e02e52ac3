"""Progress bars of the long stretches: checkpoint writes of large models."""

from __future__ import annotations

import pytest


def test_a_large_models_checkpoint_shows_its_parts_on_a_terminal(tmp_path, monkeypatch):
    """The bar (weights, trainer state, checksums, sync) is on for a model of at least
    `PROGRESS_MIN_BYTES` (lowered here) and off for smaller ones; tqdm's own rule keeps it off
    the logs of a run that is not on a terminal (mmrl's `ProgressBar`: `disable=None`)."""
    import io

    import torch

    import mmrl.progress
    import mmrl.train.checkpoint as checkpoint

    made = []
    real = mmrl.progress.ProgressBar

    def spy(*args, **kwargs):
        bar = real(*args, **{**kwargs, "disable": False, "file": io.StringIO()})
        made.append((kwargs["desc"], kwargs["disable"], bar))
        return bar

    monkeypatch.setattr(mmrl.progress, "ProgressBar", spy)

    class Tiny(torch.nn.Linear):
        def save_pretrained(self, folder):
            torch.save(self.state_dict(), folder / "weights.pt")

    class Processor:
        def save_pretrained(self, folder):
            (folder / "processor.json").write_text("{}")

    model = Tiny(4, 4)  # 80 bytes of parameters
    checkpoint.save_checkpoint(tmp_path, 1, model, Processor(), {}, "a: 1\n")
    monkeypatch.setattr(checkpoint, "PROGRESS_MIN_BYTES", 80)
    checkpoint.save_checkpoint(tmp_path, 2, model, Processor(), {}, "a: 1\n")
    assert [(desc, disable) for desc, disable, _ in made] == [
        ("checkpoint step 1", True),
        ("checkpoint step 2", None),
    ]
    assert made[1][2].n == 4  # every part written


def test_the_held_out_evaluation_counts_its_responses_and_stops_between_two(tiny_policy, monkeypatch):
    import io

    import mmrl.progress
    from mmrl.datasets.procedural import make_samples
    from mmrl.rollout.hf import HFRolloutEngine
    from mmrl.router import Router
    from mmrl.train.evaluation import EvaluationInterrupted, run_evaluation

    bars = []
    real = mmrl.progress.ProgressBar

    def spy(*args, **kwargs):
        bars.append(real(*args, **{**kwargs, "file": io.StringIO()}))
        return bars[-1]

    monkeypatch.setattr(mmrl.progress, "ProgressBar", spy)
    engine = HFRolloutEngine.from_policy(tiny_policy)
    router = Router(0, 5.0, [])
    samples = make_samples(["colour_code"], 6, "heldout")
    evaluation = run_evaluation(engine, router, samples, 4, progress=True, generations=2)
    assert bars[-1].n == 6 and bars[-1].desc == "held-out eval"
    # Watching the responses finish changes nothing in them: the same metrics as without a bar.
    from mmrl.train.evaluation import evaluate

    assert evaluation.metrics == evaluate(engine, router, samples, 4)
    assert [row["id"] for row in evaluation.generations] == [s.id for s in samples[:2]]
    assert set(evaluation.generations[0]) >= {"prompt", "image", "response", "reward", "components"}
    seen = []
    with pytest.raises(EvaluationInterrupted):
        run_evaluation(engine, router, samples, 4, should_stop=lambda: seen.append(1) or True)
    assert len(seen) == 1  # stopped at the first finished response, nothing scored
    router.close()

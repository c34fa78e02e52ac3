"""The math verifier and the router's time limits and error accounting."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mmrl.datasets.procedural import make_samples
from mmrl.router import Router
from mmrl.types import RewardSpec, Sample, VerifyContext
from mmrl.verifiers import get_verifier
from mmrl.verifiers.math import extract_answer, last_boxed


def _sample(gold: str, fmt_ratio: float = 0.0) -> Sample:
    return Sample(
        data_source="toy",
        prompt=[{"role": "user", "content": "q"}],
        images=[],
        ability="math",
        reward_model=RewardSpec(
            ground_truth=gold, verifier="math", accuracy_ratio=1.0, format_ratio=fmt_ratio
        ),
        extra_info={"id": "t"},
    )


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so \\boxed{3}.", "3"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "1, \\frac{1}{2}"),  # two answers: read as their set
        ("<think>hm</think><answer>42</answer>", "42"),
        ("<answer>x \\boxed{7}</answer>", "7"),
        ("\\boxed{\\{a\\}}", "\\{a\\}"),
        ("no answer here", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_answer_extraction(text, answer):
    assert extract_answer(text) == answer


def test_last_boxed_matches_nested_braces():
    assert last_boxed("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"


@pytest.mark.parametrize(
    ("gold", "response", "accuracy"),
    [
        ("3", "\\boxed{3}", 1.0),
        ("3", "\\boxed{3.0}", 1.0),
        ("0.5", "\\boxed{\\frac{1}{2}}", 1.0),
        ("\\frac{1}{2}", "<answer>1/2</answer>", 1.0),
        ("5", "\\boxed{5\\text{ cm}}", 1.0),
        ("25\\%", "\\boxed{0.25}", 1.0),
        ("\\sqrt{2}", "\\boxed{2^{1/2}}", 1.0),
        ("3", "\\boxed{4}", 0.0),
        ("3", "\\boxed{}", 0.0),
        ("3", "3", 0.0),  # no boxed / <answer>: not an answer
        ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ],
)
def test_math_verifier_accepts_equivalent_forms_and_rejects_wrong_ones(gold, response, accuracy):
    result = get_verifier("math")(response, _sample(gold))
    assert result.error is None
    assert result.components["accuracy"] == accuracy


def test_final_reward_mixes_accuracy_and_format_with_the_samples_ratios():
    verifier = get_verifier("math")
    sample = _sample("3", fmt_ratio=0.25)
    assert verifier("\\boxed{3}", sample).score == pytest.approx(1.25)
    assert verifier("\\boxed{4}", sample).score == pytest.approx(0.25)
    assert verifier("four", sample).score == 0.0


def test_in_process_timer_interrupts_slow_python_code():
    verifier = get_verifier("math")

    def slow_score(*args):
        time.sleep(10)

    original = type(verifier).score
    type(verifier).score = slow_score
    try:
        result = verifier("\\boxed{1}", _sample("1"), time_limit_s=0.3)
    finally:
        type(verifier).score = original
    # Without the interrupt the call would return None after 10 s, not a time-out result.
    assert result.score == 0.0 and result.error.startswith("timeout")


def test_a_kept_alarm_handler_still_interrupts_and_is_restored_after():
    """`keep_alarm_handler` (verifier workers) leaves the handler installed and the timer
    running between calls; the limit still holds for every call (the timer, armed by an
    earlier call, is re-armed for the running call's own deadline), the timer firing between
    calls interrupts nothing, and afterwards the timer is off and the previous handler back."""
    import signal

    from mmrl.verifiers.registry import keep_alarm_handler

    verifier = get_verifier("math")
    before = signal.getsignal(signal.SIGALRM)
    calls = []

    def slow_score(self, response, sample, context):
        calls.append(time.monotonic())
        time.sleep(float(response))
        return original(self, "\\boxed{1}", sample, context)

    original = type(verifier).score
    type(verifier).score = slow_score
    try:
        with keep_alarm_handler():
            assert verifier("0", _sample("1"), time_limit_s=0.3).score == 1.0
            time.sleep(0.4)  # the timer armed by that call fires here, between calls
            assert verifier("0.1", _sample("1"), time_limit_s=0.3).score == 1.0
            # The timer armed by the call before (0.3 s from its start) fires 0.2 s into this
            # one, which is within its own 0.3 s: the handler re-arms instead of timing out.
            assert verifier("0.25", _sample("1"), time_limit_s=0.3).score == 1.0
            results = [verifier("10", _sample("1"), time_limit_s=0.2) for _ in range(2)]
            elapsed = time.monotonic() - calls[-2]
    finally:
        type(verifier).score = original
    assert all(r.score == 0.0 and r.error.startswith("timeout") for r in results)
    assert elapsed < 5.0  # each 10 s call was cut off at its 0.2 s limit
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before


def test_a_kept_alarm_still_limits_the_outer_call_after_an_inner_call_timed_out():
    """Limited calls nest (a plugin verifier may call another verifier): the inner call keeps
    the outer limit, and once the inner one has timed out the outer one is still cut off."""
    from mmrl.verifiers.registry import VerifierTimeout, call_with_time_limit, keep_alarm_handler

    seen = []

    def outer():
        try:
            call_with_time_limit(lambda: time.sleep(5), 0.1)
        except VerifierTimeout:
            seen.append("inner timed out")
        time.sleep(5)

    start = time.monotonic()
    with keep_alarm_handler():
        with pytest.raises(VerifierTimeout):
            call_with_time_limit(outer, 0.4)
        # An inner limit longer than the outer one ends at the outer deadline.
        with pytest.raises(VerifierTimeout):
            call_with_time_limit(lambda: call_with_time_limit(lambda: time.sleep(5), 3.0), 0.2)
    assert seen == ["inner timed out"]
    assert time.monotonic() - start < 3.0  # each 5 s sleep was cut off at its limit


def test_a_kept_alarm_survives_a_library_using_the_same_timer_and_tiny_limits():
    """A library inside a limited call may use SIGALRM itself (math_verify's timeouts: its own
    handler and `signal.alarm`, cancelled when done); later calls must still be limited. And a
    limit so small that the timer goes off before the call starts leaves nothing behind."""
    import contextlib
    import signal

    from mmrl.verifiers.registry import VerifierTimeout, call_with_time_limit, keep_alarm_handler

    def library():
        previous = signal.signal(signal.SIGALRM, lambda *args: None)
        signal.alarm(3)
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        return "parsed"

    start = time.monotonic()
    with keep_alarm_handler():
        assert call_with_time_limit(library, 0.3) == "parsed"
        with pytest.raises(VerifierTimeout):
            call_with_time_limit(lambda: time.sleep(5), 0.3)
        for _ in range(200):
            with contextlib.suppress(VerifierTimeout):
                call_with_time_limit(lambda: None, 1e-7)
        assert call_with_time_limit(lambda: time.sleep(0.01) or "in time", 5.0) == "in time"
    assert time.monotonic() - start < 3.0


def test_router_kills_a_verifier_stuck_in_c_code_and_keeps_serving():
    """SymPy evaluating 9^(9^(9^9)) sits in C integer code where no signal handler runs:
    only killing the worker process bounds it."""
    samples = [_sample("3"), _sample("3"), _sample("3")]
    texts = ["\\boxed{3}", "\\boxed{9^{9^{9^{9}}}}", "\\boxed{4}"]
    with Router(num_workers=1, time_limit_s=1.0) as router:
        router.warm_up()
        batch = router.score(samples, texts, VerifyContext())
        # Returning at all is the point: unkilled, this call runs for hours.
        assert [r.components.get("accuracy") for r in batch.results] == [1.0, None, 0.0]
        assert batch.results[1].error.startswith("timeout")
        assert batch.errors == {"math/toy": 1} and batch.timeouts == {"math/toy": 1}
        assert batch.scores.tolist() == [1.0, 0.0, 0.0]
        # The pool replaced the killed worker: later batches are scored normally.
        again = router.score(samples[:1], ["\\boxed{3}"], VerifyContext())
        assert again.scores.tolist() == [1.0] and not again.errors


def test_a_hang_inside_a_chunk_costs_only_its_own_response():
    """Queued responses go to a worker in chunks; when a chunk's worker is killed (a response
    stuck in C code), the pool knows which response it was scoring: only that one gets the
    time-out, the chunk's others are sent again."""
    samples = [_sample("3") for _ in range(12)]
    texts = ["\\boxed{3}" if i % 2 else "\\boxed{4}" for i in range(12)]
    texts[9] = "\\boxed{9^{9^{9^{9}}}}"
    with Router(num_workers=1, time_limit_s=1.0) as router:
        router.warm_up()
        router.score(samples[:4], texts[:4], VerifyContext())  # measures the time per response
        sent = router.sent_chunks, router.sent_responses
        batch = router.score(samples, texts, VerifyContext())
        chunks, responses = router.sent_chunks - sent[0], router.sent_responses - sent[1]
    assert chunks < 12  # responses shared worker tasks...
    assert responses >= 12  # (more if the stuck one's worker was killed: the rest of its chunk went again)
    assert batch.results[9].error.startswith("timeout")
    assert batch.errors == {"math/toy": 1} and batch.timeouts == {"math/toy": 1}
    expected = [float(i % 2) for i in range(12)]
    expected[9] = 0.0
    assert batch.scores.tolist() == expected
    assert all(r.error is None for i, r in enumerate(batch.results) if i != 9)


def test_closing_the_router_gives_every_unscored_response_an_error_result():
    """Responses still queued or in a worker when the router closes get an error result, so a
    thread waiting for them is not left waiting forever."""
    samples = [_sample("3") for _ in range(12)]
    texts = ["\\boxed{9^{9^{9^{9}}}}"] + ["\\boxed{3}"] * 11  # the first keeps its worker busy
    router = Router(num_workers=1, time_limit_s=30.0)
    router.warm_up()
    router.score(samples[:4], texts[1:5], VerifyContext())  # measures the time per response
    pending = router.submit(samples, texts, VerifyContext())
    router.close()
    results = pending.wait(range(12), samples, texts)
    assert results[0].error.startswith("RouterClosed") and results[0].score == 0.0
    assert all(r.error.startswith("RouterClosed") if r.error else r.score == 1.0 for r in results)


def test_router_in_process_mode_gives_the_same_results_as_workers():
    samples = make_samples(["colour_code", "count"], 8, "train")
    texts = [f"\\boxed{{{s.reward_model.ground_truth if i % 2 else 0}}}" for i, s in enumerate(samples)]
    with Router(num_workers=0) as inproc, Router(num_workers=1) as pooled:
        a = inproc.score(samples, texts, VerifyContext())
        b = pooled.score(samples, texts, VerifyContext())
    assert a.scores.tolist() == b.scores.tolist() == [float(i % 2) for i in range(8)]


def test_responses_added_while_generating_are_scored_in_row_order(tiny_policy):
    """The engine reports each row the moment it finishes; the router scores it meanwhile, and
    the gathered rewards equal scoring the final texts after generation."""
    from mmrl.rollout.hf import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine.from_policy(tiny_policy)
    samples = make_samples(["colour_code", "count"], 4, "train")
    rows = [s for s in samples for _ in range(3)]
    with Router(num_workers=1) as router:
        pending = router.start(VerifyContext(), len(rows))
        finished_order = []

        def on_response(row, text):
            finished_order.append(row)
            pending.add(row, rows[row], text)

        batch = engine.generate(samples, SamplingParams(n=3, max_new_tokens=12), on_response=on_response)
        streamed = pending.result(batch.samples, batch.texts)
        after = router.score(batch.samples, batch.texts, VerifyContext())
    assert sorted(finished_order) == list(range(len(rows)))  # every row reported exactly once
    assert pending._texts == batch.texts  # the streamed texts are the final texts
    assert streamed.scores.tolist() == after.scores.tolist()


def test_a_row_added_with_a_stale_text_is_rescored_with_the_final_text():
    samples = [_sample("3"), _sample("3")]
    with Router(num_workers=0) as router:
        pending = router.start(VerifyContext(), 2)
        pending.add(0, samples[0], "\\boxed{4}")  # e.g. a partial text
        batch = pending.result(samples, ["\\boxed{3}", "\\boxed{3}"])
    assert batch.scores.tolist() == [1.0, 1.0]


def test_a_reward_batch_recounts_errors_per_source_after_select_and_concat():
    # Every router (local, remote, Ray) builds its batch with RewardBatch.gather, so DAPO's
    # select/concat can recount errors by each row's verifier/data_source.
    from mmrl.router import RewardBatch
    from mmrl.types import VerifierResult

    samples = make_samples(["colour_code", "count"], 4, "train")
    results = [
        VerifierResult(score=1.0),
        VerifierResult(score=0.0, error="timeout: killed after 6s"),
        VerifierResult(score=0.0, error="ValueError: bad"),
        VerifierResult(score=0.5),
    ]
    batch = RewardBatch.gather(samples, results)
    sources = [f"{s.reward_model.verifier}/{s.data_source}" for s in samples]
    assert sources[1] != sources[2]
    assert batch.errors == {sources[1]: 1, sources[2]: 1} and batch.timeouts == {sources[1]: 1}
    assert batch.scores.tolist() == [1.0, 0.0, 0.0, 0.5]
    picked = batch.select([3, 1])
    assert picked.scores.tolist() == [0.5, 0.0]
    assert picked.errors == {sources[1]: 1} and picked.timeouts == {sources[1]: 1}
    both = RewardBatch.concat([picked, batch.select([2])])
    assert both.errors == {sources[1]: 1, sources[2]: 1} and both.timeouts == {sources[1]: 1}
    assert both.select([2]).errors == {sources[2]: 1}  # keys travel through select and concat


def test_the_built_in_verifiers_are_found_from_the_registry_module_alone():
    # The registry imports no verifier (the verifiers import it); Python runs the package's
    # __init__, which imports the built-ins, before the registry module. A fresh process, where
    # nothing else has imported them, imports only the registry and finds them all.
    code = (
        "from mmrl.verifiers.registry import get_verifier, verifier_names\n"
        "print(get_verifier('math').name, *verifier_names())"
    )
    env = dict(os.environ, PYTHONSAFEPATH="1", HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    first, *names = done.stdout.split()
    assert first == "math"
    assert {"math", "detection", "number", "geneval"} <= set(names)  # one from each built-in module

"""The verifier pool (`mmrl.verifier_pool`), through the trainer's router: hangs, crashes, kills,
signals and time limits. Every response gets a result; a fault costs only the response at fault.

Each scoring call runs in a thread joined with a generous bound: a pool that hangs (what the
previous pool did when its one worker died) fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from mmrl.router import Router
from mmrl.types import RewardSpec, Sample, VerifyContext
from mmrl.verifiers.registry import VerifierTimeout, call_with_time_limit, get_verifier, keep_alarm_handler

PLUGINS = Path(__file__).parent / "plugins"
HANG_GUARD_S = 300  # a hang guard, not a performance check


@pytest.fixture(autouse=True)
def _plugins(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))  # workers inherit sys.path


def _sample(i: int = 0, verifier: str = "fault", gold: str = "1") -> Sample:
    return Sample(
        data_source="toy",
        prompt=[{"role": "user", "content": "?"}],
        images=[],
        ability="math",
        reward_model=RewardSpec(ground_truth=gold, verifier=verifier),
        extra_info={"id": f"s{i}"},
    )


def _guarded(fn):
    """`fn()` in a thread; fails the test if it has not returned after `HANG_GUARD_S`."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the verifier pool hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _wait_for_pid(path: Path) -> int:
    for _ in range(int(HANG_GUARD_S / 0.01)):
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.01)
    raise AssertionError(f"{path} never appeared")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_killed_with_sigkill_mid_batch_costs_only_its_response(workers, tmp_path):
    marker = tmp_path / "pid"
    texts = [f"pid:{marker}"] + ["fine"] * 7
    samples = [_sample(i) for i in range(8)]
    with Router(num_workers=workers, time_limit_s=60.0, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        pending = router.submit(samples, texts, VerifyContext())
        os.kill(_wait_for_pid(marker), signal.SIGKILL)  # the OOM killer, mid-batch
        batch = _guarded(lambda: pending.result(samples, texts))
        assert batch.results[0].error is not None and "died" in batch.results[0].error
        assert batch.scores.tolist() == [0.0] + [1.0] * 7
        assert batch.errors == {"fault/toy": 1} and not batch.timeouts
        assert all(r.error is None for r in batch.results[1:])
        assert router.pool.restarts == 1
        again = _guarded(lambda: router.score(samples[:3], ["fine"] * 3, VerifyContext()))
        assert again.scores.tolist() == [1.0] * 3 and not again.errors


def test_a_worker_that_dies_while_idle_is_not_logged_as_dying_mid_sample(caplog):
    """Issue 48, item 19: a worker killed between batches was logged as having "died while
    scoring this sample"; it was scoring none."""
    import logging

    samples = [_sample(i) for i in range(3)]
    with Router(num_workers=1, time_limit_s=60.0, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        assert (
            _guarded(lambda: router.score(samples, ["fine"] * 3, VerifyContext())).scores.tolist()
            == [1.0] * 3
        )
        (pid,) = router.pool.worker_pids()
        with caplog.at_level(logging.WARNING, logger="mmrl.verifier_pool"):
            os.kill(pid, signal.SIGKILL)
            for _ in range(int(HANG_GUARD_S / 0.01)):  # until the pool has seen it go
                if router.pool.restarts:
                    break
                time.sleep(0.01)
        assert router.pool.restarts == 1
        ended = [r.getMessage() for r in caplog.records if "ended" in r.getMessage()]
        assert len(ended) == 1 and f"(pid {pid}) ended" in ended[0]
        assert "died while idle (exit code -9); it was replaced" in ended[0]
        assert "while scoring" not in ended[0]
        again = _guarded(lambda: router.score(samples, ["fine"] * 3, VerifyContext()))
        assert again.scores.tolist() == [1.0] * 3 and not again.errors


def test_a_worker_loads_neither_torch_nor_transformers():
    """A verifier worker scores text and images with numpy, PIL and SymPy: importing torch
    there cost each worker (every start and every replacement) over a second of CPU and its
    memory, for nothing."""
    samples = [_sample(0)]
    with Router(num_workers=1, time_limit_s=60.0, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        batch = _guarded(lambda: router.score(samples, ["modules"], VerifyContext()))
    assert batch.results[0].error is None
    assert batch.results[0].components == {"torch": 0.0, "transformers": 0.0}


def test_a_worker_that_dies_by_itself_again_and_again_never_stops_the_router():
    samples = [_sample(i) for i in range(9)]
    texts = ["die" if i % 3 == 1 else "fine" for i in range(9)]
    with Router(num_workers=1, time_limit_s=60.0, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        batch = _guarded(lambda: router.score(samples, texts, VerifyContext()))
    assert batch.scores.tolist() == [0.0 if i % 3 == 1 else 1.0 for i in range(9)]
    assert batch.errors == {"fault/toy": 3}
    assert all(("died" in r.error) == (i % 3 == 1) for i, r in enumerate(batch.results) if r.error)


def test_workers_ignore_sigterm_so_the_parent_decides(tmp_path):
    """SIGTERM to the whole process group (Slurm, systemd) reaches the workers too: they go on,
    and the trainer, which got it as well, checkpoints and closes the pool itself."""
    marker = tmp_path / "pid"
    with Router(num_workers=1, time_limit_s=60.0, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        pending = router.submit([_sample()], [f"pid:{marker}"], VerifyContext())
        os.kill(_wait_for_pid(marker), signal.SIGTERM)
        Path(f"{marker}.go").write_text("")
        batch = _guarded(lambda: pending.result([_sample()], [f"pid:{marker}"]))
        assert batch.results[0].error is None and batch.scores.tolist() == [1.0]
        assert router.pool.restarts == 0


def test_a_verifier_hanging_in_c_code_is_killed_at_the_hard_limit_and_the_worker_replaced():
    samples = [_sample(i) for i in range(4)]
    texts = ["fine", "hang", "fine", "fine"]
    with Router(num_workers=1, time_limit_s=0.5, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        batch = _guarded(lambda: router.score(samples, texts, VerifyContext()))
        assert batch.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
        assert batch.results[1].error.startswith("timeout") and "killed" in batch.results[1].error
        assert batch.timeouts == {"fault/toy": 1} and batch.errors == {"fault/toy": 1}
        assert router.pool.restarts == 1


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("response", ["swallow", "swallow_all"])
def test_a_time_out_that_the_verifiers_library_catches_is_still_a_time_out(workers, response):
    """math-verify and SymPy catch `Exception` around their work: the time-out must get through
    (and even a bare `except:` cannot turn it into a normal answer)."""
    with Router(num_workers=workers, time_limit_s=0.3, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        if workers:
            batch = _guarded(lambda: router.score([_sample()], [response], VerifyContext()))
        else:  # in-process: the time limit is a timer signal, which only the main thread gets
            batch = router.score([_sample()], [response], VerifyContext())
    assert batch.results[0].error is not None and batch.results[0].error.startswith("timeout")
    assert batch.scores.tolist() == [0.0]
    assert batch.timeouts == {"fault/toy": 1}


def test_call_with_time_limit_reports_a_time_out_that_the_call_swallowed():
    def swallow_all():
        try:
            time.sleep(5)
        except:  # noqa: E722
            pass
        return "claims success"

    with pytest.raises(VerifierTimeout):
        call_with_time_limit(swallow_all, 0.1)
    with keep_alarm_handler(), pytest.raises(VerifierTimeout):
        call_with_time_limit(swallow_all, 0.1)
    assert not issubclass(VerifierTimeout, Exception)  # `except Exception` cannot catch it

    def inner_time_out_handled():  # a verifier's own shorter limit, caught by itself: no time-out
        try:
            call_with_time_limit(lambda: time.sleep(5), 0.05)
        except VerifierTimeout:
            return "fallback"

    assert call_with_time_limit(inner_time_out_handled, 5.0) == "fallback"


def test_a_math_time_out_inside_sympy_is_reported_as_a_time_out():
    """With gold 0 this difference of two towers scored 1.0 after the limit (SymPy caught the
    time-out); now it is a time-out."""
    verifier = get_verifier("math")
    sample = _sample(verifier="math", gold="0")
    # In the main thread: the time limit is a timer signal, which only the main thread gets.
    result = verifier(
        r"\boxed{10^{10^{10^{10}}}-10^{10^{10^{10}}}}", sample, VerifyContext(), time_limit_s=0.5
    )
    assert result.error is not None and result.error.startswith("timeout"), result
    assert result.score == 0.0


def test_workers_that_cannot_start_fail_the_warm_up_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("MMRL_TEST_FAIL_IN_WORKERS", "1")
    with Router(num_workers=1, time_limit_s=1.0, plugins=["fault_verifiers"]) as router:
        with pytest.raises(RuntimeError, match="WorkerStartFailed.*fault_verifiers"):
            _guarded(router.warm_up)
        with pytest.raises(RuntimeError, match="WorkerStartFailed"):
            _guarded(lambda: router.score([_sample()], ["fine"], VerifyContext()))


def test_closing_the_router_ends_stuck_workers_and_answers_every_response():
    samples = [_sample(i) for i in range(6)]
    texts = ["hang"] + ["fine"] * 5
    router = Router(num_workers=1, time_limit_s=600.0, plugins=["fault_verifiers"])
    router.warm_up()
    pending = router.submit(samples, texts, VerifyContext())
    pids = router.pool.worker_pids()
    _guarded(router.close)
    results = _guarded(lambda: pending.wait(range(6), samples, texts))
    assert results[0].error.startswith("RouterClosed")
    assert all(r.error is None or r.error.startswith("RouterClosed") for r in results)
    for pid in pids:  # the stuck worker ignored nothing it could not: it was killed
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_server_uses_the_same_pool_sigterm_is_ignored_and_swallowed_time_outs_are_time_outs(tmp_path):
    """`mmrl serve` runs the same pool: a worker SIGTERMed mid-request goes on, a SIGKILLed one
    costs only its sample, and a time-out a library swallowed is a counted time-out."""
    from mmrl.server.client import RewardClient
    from mmrl.server.config import ServeConfig
    from mmrl.server.process import start_server_process

    cfg = ServeConfig(port=0, workers=1, time_limit_s=0.3, kill_grace_s=0.5, plugins=["fault_verifiers"])
    record = {"data_source": "test", "reward_model": {"ground_truth": "1", "verifier": "fault"}}
    with (
        start_server_process(cfg, env={"PYTHONPATH": str(PLUGINS)}) as server,
        RewardClient(server.url, retries=0) as client,
    ):
        out: dict = {}
        for sig, marker in ((signal.SIGTERM, tmp_path / "term"), (signal.SIGKILL, tmp_path / "kill")):

            def score(m: Path = marker) -> None:
                out[m] = client.score_records([record, record], [f"pid:{m}", "fine"])

            pending = threading.Thread(target=score, daemon=True)
            pending.start()
            os.kill(_wait_for_pid(marker), sig)
            Path(f"{marker}.go").write_text("")
            pending.join(HANG_GUARD_S)
            assert not pending.is_alive(), "the server hung"
        term, kill = out[tmp_path / "term"], out[tmp_path / "kill"]
        assert [r["score"] for r in term] == [1.0, 1.0] and term[0]["error"] is None
        assert [r["score"] for r in kill] == [0.0, 1.0] and "died" in kill[0]["error"]
        swallowed = client.score_records([record, record], ["swallow", "swallow_all"])
        assert all(r["score"] == 0.0 and r["error"].startswith("timeout") for r in swallowed)
        metrics = httpx.get(server.url + "/metrics").text
    assert 'mmrl_verifier_errors_total{verifier="fault",kind="timeout"} 2' in metrics
    assert 'mmrl_verifier_errors_total{verifier="fault",kind="crash"} 1' in metrics


def _worker_children() -> list[int]:
    """This process's verifier worker processes (spawned children), found in /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if int(ppid) == os.getpid() and state != "Z" and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


def test_idle_workers_killed_with_sigkill_are_replaced_and_the_next_batch_is_scored():
    """Workers SIGKILLed between batches (the OOM killer picks an idle one as readily as a busy
    one): the previous pool broke ("Unexpected error within the Pool") when a worker died
    holding its task queue's lock; this one replaces them."""
    samples = [_sample(i) for i in range(6)]
    with Router(num_workers=2, time_limit_s=60.0, plugins=["fault_verifiers"]) as router:
        router.warm_up()
        _guarded(lambda: router.score(samples, ["fine"] * 6, VerifyContext()))
        workers = _worker_children()
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        batch = _guarded(lambda: router.score(samples, ["fine"] * 6, VerifyContext()))
        assert batch.scores.tolist() == [1.0] * 6 and not batch.errors

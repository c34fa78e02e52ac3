"""Load test of the reward server (bounded, loopback only): 64 concurrent clients send 10,000
requests; every request is answered exactly once, with exactly its own responses' results, each
equal to what the in-process verifier says."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter

import httpx
import pytest

from mmrl.datasets.procedural import make_samples
from mmrl.server.config import ServeConfig
from mmrl.server.process import start_server_process
from mmrl.server.protocol import sample_to_record
from mmrl.types import VerifyContext
from mmrl.verifiers import get_verifier

CLIENTS = 64
REQUESTS = 10_000
CONTEXT = VerifyContext(step=40, total_steps=100)


def work_pairs() -> list[tuple]:
    """(sample record, response, expected result) for math and detection: right, wrong, malformed."""
    pairs = []
    for sample in make_samples(["colour_code", "arithmetic", "count"], 60, "train"):
        gt = sample.reward_model.ground_truth
        for response in (
            f"\\boxed{{{gt}}}",
            f"<answer>{gt}</answer> or \\boxed{{{gt}+1}}",
            "\\boxed{}",
            "no idea",
        ):
            pairs.append((sample, response))
    for sample in make_samples(["detection", "grounding"], 20, "train"):
        gt = sample.reward_model.ground_truth
        moved = [{**b, "bbox_2d": [c + 3 for c in b["bbox_2d"]]} for b in gt]
        for response in (json.dumps(gt), f"<answer>{json.dumps(moved)}</answer>", '[{"bbox_2d": [1]}]'):
            pairs.append((sample, response))
    out = []
    for sample, response in pairs:
        want = get_verifier(sample.reward_model.verifier)(response, sample, CONTEXT)
        out.append(
            (sample_to_record(sample), response, (want.score, want.components, want.error, want.extracted))
        )
    return out


async def run_clients(url: str, pairs: list[tuple]) -> tuple[Counter, list[str], int]:
    answered: Counter = Counter()
    problems: list[str] = []
    sent = [0]
    next_request = iter(range(REQUESTS))
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:

        async def one_client() -> None:
            for request in next_request:
                picks = [(request * 7 + k * 13) % len(pairs) for k in range(1 + request % 2)]
                ids = [f"{request}/{k}" for k in range(len(picks))]
                samples = [{**pairs[p][0], "extra_info": {"id": i}} for p, i in zip(picks, ids)]
                body = {
                    "samples": samples,
                    "responses": [pairs[p][1] for p in picks],
                    "context": {"step": CONTEXT.step, "total_steps": CONTEXT.total_steps},
                }
                sent[0] += len(picks)
                answer = await http.post("/score", json=body)
                answered[request] += 1
                if answer.status_code != 200:
                    problems.append(f"request {request}: HTTP {answer.status_code} {answer.text[:200]}")
                    continue
                results = answer.json()["results"]
                if [r["id"] for r in results] != ids:
                    problems.append(f"request {request}: sent ids {ids}, got {[r['id'] for r in results]}")
                    continue
                for p, r in zip(picks, results):
                    got = (r["score"], r["components"], r["error"], r["extracted"])
                    if got != pairs[p][2]:
                        problems.append(f"request {request}: pair {p} gave {got}, in-process {pairs[p][2]}")

        await asyncio.gather(*[one_client() for _ in range(CLIENTS)])
    return answered, problems, sent[0]


def metric(text: str, pattern: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(pattern + r" ([0-9.e+]+)$", text, re.MULTILINE))


@pytest.mark.slow
def test_64_clients_10000_requests_nothing_lost_or_duplicated_and_all_equal_in_process():
    pairs = work_pairs()
    cfg = ServeConfig(port=0, workers=2, max_pending=8192, log_level="warning")
    with start_server_process(cfg) as server:
        answered, problems, n_responses = asyncio.run(run_clients(server.url, pairs))
        metrics = httpx.get(server.url + "/metrics").text
    assert problems == [], f"{len(problems)} problems, e.g. {problems[:3]}"
    assert len(answered) == REQUESTS and set(answered.values()) == {1}
    # The server saw each request once and scored each response once: nothing re-sent, nothing dropped.
    assert metric(metrics, r'mmrl_requests_total\{endpoint="/score",status="200"\}') == REQUESTS
    assert metric(metrics, r'mmrl_samples_total\{verifier="[a-z]+"\}') == n_responses
    assert metric(metrics, r"mmrl_worker_restarts_total") == 0

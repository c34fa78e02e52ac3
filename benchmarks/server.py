"""Reward-server throughput and latency against the in-process verifier rate, on this machine.

    python benchmarks/server.py [--seconds 3] [--batch 1 32] [--clients 1 8 64]

For the math and detection verifiers: first the in-process, single-core rate (responses/s
through `Verifier.__call__`, as `benchmarks/verifiers.py` measures it, best of three passes over
the same inputs, so caches are as warm as the server's); then `mmrl serve` is started with one
verifier worker per core and driven over loopback HTTP/1.1 keep-alive connections by 1, 8 and 64
concurrent clients, each sending its next request when the previous answer arrives (closed
loop), with `--batch` responses per `POST /score` request (a sample shared by several responses
of a request is sent once, as `RemoteRouter` sends a GRPO group). Every answer is checked
against the in-process results (parsed, or byte-identical to an answer to the same request
that was parsed and checked). The clients run in this process, on the same cores as the
server; a lean asyncio HTTP client (a bare protocol, pre-encoded requests) keeps their share
small. A row's
measurement starts once every client has had an answer (steady state) and counts the answers
completed in the next `--seconds`.

Per row: requests/s, responses/s, p50/p99 request latency,
`ratio = responses/s / (in-process single-core rate x cores)`, and where the CPU time went per
response (server process, verifier workers, clients; read from /proc) with
`cpu-eff = in-process CPU per response / all of that`: the ratio an otherwise idle machine
would reach with every core busy. On a machine shared with other work the wall-clock ratio
falls with the load average (printed); cpu-eff does not.

Goals (issue 4): ratio >= 0.8 at 64 clients and >= 0.6 at 8; at 1 client, latency within a few
ms of the verifier's own time for the request (`batch x` the in-process time per response).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import socket
import time

from mmrl.datasets.procedural import make_samples
from mmrl.server.config import ServeConfig
from mmrl.server.process import start_server_process
from mmrl.server.protocol import sample_to_record
from mmrl.types import VerifyContext
from mmrl.verifiers import get_verifier
from mmrl.verifiers.registry import warm_up_verifiers

KINDS = {"math": ["colour_code", "arithmetic"], "detection": ["detection", "grounding"]}
GOALS = {64: 0.8, 8: 0.6}
LATENCY_SLACK_MS = 3.0
"""'Within a few milliseconds' of the verifier's own time, for the 1-client check."""


def responses_for(sample) -> list[str]:
    """Right, wrong and malformed answers (as in benchmarks/verifiers.py)."""
    gt = sample.reward_model.ground_truth
    if sample.reward_model.verifier == "detection":
        right = json.dumps(gt)
        shifted = json.dumps([{**b, "bbox_2d": [c + 3 for c in b["bbox_2d"]]} for b in gt])
        return [right, shifted, '[{"bbox_2d": [1, 2], "label": "x"}]', "no boxes"]
    return [f"\\boxed{{{gt}}}", "\\boxed{7}", "\\boxed{}", "I cannot tell"]


def work_items(verifier: str, n: int) -> list[tuple]:
    samples = make_samples(KINDS[verifier], n, "train")
    return [(s, r) for s in samples for r in responses_for(s)][:n]


def in_process(items: list[tuple], repeats: int = 3) -> tuple[float, float, list[float]]:
    """(responses/s, CPU seconds per response) of one process scoring `items`, best of
    `repeats`, and the scores."""
    verifier = get_verifier(items[0][0].reward_model.verifier)
    best, cpu, scores = 0.0, float("inf"), []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        scores = [verifier(r, s, VerifyContext(0, 100)).score for s, r in items]
        best = max(best, len(items) / (time.perf_counter() - start))
        cpu = min(cpu, (time.process_time() - start_cpu) / len(items))
    return best, cpu, scores


def encode_requests(items: list[tuple], batch: int, count: int) -> list[tuple[bytes, list[int]]]:
    """`count` pre-encoded `POST /score` requests of `batch` responses each, cycling through items."""
    out = []
    for k in range(count):
        idx = [(k * batch + j) % len(items) for j in range(batch)]
        local: dict[int, int] = {}
        samples = []
        for i in idx:
            if id(items[i][0]) not in local:
                local[id(items[i][0])] = len(samples)
                samples.append(items[i][0])
        body = json.dumps(
            {
                "samples": [sample_to_record(s) for s in samples],
                "responses": [items[i][1] for i in idx],
                "sample_index": [local[id(items[i][0])] for i in idx],
                "context": {"step": 0, "total_steps": 100},
            }
        ).encode()
        head = (
            "POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        out.append((head + body, idx))
    return out


class Window:
    """The measured interval: it opens once every client has had an answer (the pipeline is in
    steady state) and closes `seconds` later; CPU use is read at both ends."""

    def __init__(self, clients: int, seconds: float, server_pid: int):
        self.waiting = clients
        self.seconds = seconds
        self.server_pid = server_pid
        self.start: float | None = None
        self.end = float("inf")
        self.opened = asyncio.Event()
        self.cpu: list[tuple[float, float, float]] = []
        self.latencies: list[float] = []
        self.completed = 0
        self.problems: list[str] = []

    def first_answer(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.start = time.perf_counter()
            self.end = self.start + self.seconds
            self.cpu.append(cpu_snapshot(self.server_pid))
            self.opened.set()

    async def close_on_time(self) -> None:
        await self.opened.wait()
        await asyncio.sleep(self.end - time.perf_counter())
        self.cpu.append(cpu_snapshot(self.server_pid))


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, read with a bare protocol (asyncio streams would
    cost the clients, which share the server's cores, about 20 us more a request)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.waiter: asyncio.Future | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 or self.waiter is None or self.waiter.done():
            return  # incomplete, or nothing asked (a stray byte would show up as a bad answer)
        head = bytes(self.buffer[:end])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if len(self.buffer) < end + 4 + length:
            return
        body = bytes(self.buffer[end + 4 : end + 4 + length])
        del self.buffer[: end + 4 + length]
        self.waiter.set_result((head, body))

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"the server closed the connection: {exc}"))

    async def request(self, raw: bytes) -> tuple[bytes, bytes]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return await self.waiter


async def client(port: int, requests, offset: int, window: Window, expected, verified: dict) -> None:
    """A closed-loop client. Every answer is checked: a body byte-identical to an answer to the
    same request that was already checked passes; any other is parsed and its scores compared
    with the in-process verifier's (and, if right, becomes the request's checked answer)."""
    _, conn = await asyncio.get_running_loop().create_connection(Connection, "127.0.0.1", port)
    k = offset
    answered = False
    try:
        while time.perf_counter() < window.end:
            key = k % len(requests)
            raw, idx = requests[key]
            k += 1
            sent = time.perf_counter()
            head, body = await conn.request(raw)
            done = time.perf_counter()
            if not head.startswith(b"HTTP/1.1 200"):
                window.problems.append(head.split(b"\r\n", 1)[0].decode() + " " + body[:200].decode())
            elif verified.get(key) != body:
                if [r["score"] for r in json.loads(body)["results"]] != [expected[i] for i in idx]:
                    window.problems.append(
                        f"scores differ from the in-process verifier for items {idx[:4]}..."
                    )
                else:
                    verified[key] = body
            if window.start is not None and window.start <= done <= window.end:
                window.completed += 1
                if sent >= window.start:
                    window.latencies.append(done - sent)
            if not answered:
                answered = True
                window.first_answer()
    finally:
        conn.transport.close()


async def drive(port: int, server_pid: int, requests, clients: int, seconds: float, expected) -> Window:
    """`clients` closed-loop clients; the window counts answers completed in it."""
    window = Window(clients, seconds, server_pid)
    closer = asyncio.create_task(window.close_on_time())
    verified: dict[int, bytes] = {}
    await asyncio.gather(*[client(port, requests, c * 7, window, expected, verified) for c in range(clients)])
    await closer
    return window


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    out = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(path) as f:
            out += [int(p) for p in f.read().split()]
    return out


def cpu_snapshot(server_pid: int) -> tuple[float, float, float]:
    """(server process, its verifier workers, this process) CPU seconds."""
    workers = sum(process_cpu(p) for p in child_pids(server_pid))
    return process_cpu(server_pid), workers, time.process_time()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def report(port: int, server_pid: int, name: str, items, baseline, cores: int, args) -> None:
    rate, cpu_per_item, expected = baseline
    limit = rate * cores
    per_item_ms = 1000 / rate
    print(
        f"\n{name}: in-process {rate:.0f} responses/s on one core ({per_item_ms:.3f} ms, "
        f"{1e6 * cpu_per_item:.0f} us CPU each); limit = x {cores} cores = {limit:.0f} responses/s"
    )
    print(
        f"  {'batch':>5} {'clients':>7} {'req/s':>7} {'resp/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'ratio':>5}"
        f"   CPU us/resp: server workers client  cpu-eff   goal"
    )
    for batch in args.batch:
        requests = encode_requests(items, batch, 64)
        for clients in args.clients:
            window = asyncio.run(drive(port, server_pid, requests, clients, args.seconds, expected))
            req_rate = window.completed / args.seconds
            responses = max(1, window.completed * batch)
            server, workers, mine = (1e6 * (a - b) / responses for a, b in zip(window.cpu[1], window.cpu[0]))
            efficiency = 1e6 * cpu_per_item / (server + workers + mine)
            p50, p99 = 1000 * percentile(window.latencies, 0.5), 1000 * percentile(window.latencies, 0.99)
            ratio = req_rate * batch / limit
            if clients in GOALS:
                verdict = f">= {GOALS[clients]}: {'met' if ratio >= GOALS[clients] else 'NOT met'}"
            elif clients == 1:
                over = p50 - batch * per_item_ms
                verdict = f"p50 - verifier's own = {over:+.2f} ms ({'met' if over <= LATENCY_SLACK_MS else 'NOT met'})"
            else:
                verdict = ""
            print(
                f"  {batch:>5} {clients:>7} {req_rate:>7.0f} {req_rate * batch:>7.0f} {p50:>7.2f} {p99:>7.2f} "
                f"{ratio:>5.2f}   {server:>18.0f} {workers:>7.0f} {mine:>6.0f}  {efficiency:>7.2f}   {verdict}"
            )
            if window.problems:
                print(f"    {len(window.problems)} bad answers, e.g. {window.problems[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per row")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="responses per request")
    parser.add_argument("--verifiers", nargs="+", default=["math", "detection"], choices=sorted(KINDS))
    parser.add_argument("--workers", type=int, default=0, help="verifier workers (default: one per core)")
    parser.add_argument("--n", type=int, default=400, help="distinct (sample, response) pairs per verifier")
    args = parser.parse_args()

    cores = len(os.sched_getaffinity(0))
    workers = args.workers or cores
    warm_up_verifiers()
    items = {name: work_items(name, args.n) for name in args.verifiers}
    baselines = {name: in_process(items[name]) for name in args.verifiers}
    cfg = ServeConfig(port=0, workers=workers, max_pending=65536, max_batch=4096, log_level="warning")
    with start_server_process(cfg) as server:
        port = int(server.url.rsplit(":", 1)[1])
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{cores} cores, load average {load}; server: 1 HTTP process + {workers} verifier workers")
        for name in args.verifiers:
            report(port, server.proc.pid, name, items[name], baselines[name], cores, args)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"\nload average at the end: {load}")


if __name__ == "__main__":
    main()

"""Talking to `mmrl serve`: `RewardClient` (HTTP with timeouts and bounded retries) and
`RemoteRouter` (the interface of `mmrl.router.Router`, scoring on a remote reward server).

Failures surface as exceptions, never as silent zeros:

- `RewardRequestError`: the server rejected the request (4xx other than 429: bad input, unknown
  verifier, missing token, oversize body); the message is the server's, naming the field.
  Not retried: the same request would fail the same way.
- `RewardServiceUnavailable`: the server could not be reached or stayed busy (connection errors,
  time-outs, 429, 502-504) through `retries` retries with exponential backoff (`backoff_s`,
  doubling, capped at `max_backoff_s`; a 429's `Retry-After` is honoured within that cap).

Scoring is a pure function of the request, so retrying a POST is safe.

A verifier's own failure (time-out, crash) is not an exception: it is that response's result,
with `score` 0 and `error` set, exactly as with the in-process `Router`.

Switching mmrl's trainer to a remote reward service:

    router = RemoteRouter("http://10.0.0.5:8000", token=os.environ["MMRL_REWARD_TOKEN"])
    pending = router.start(context, n_rows)      # same calls as Router
    pending.add(row, sample, text)
    batch = pending.result(samples, texts)       # a RewardBatch

Several servers (`RewardServerPool`, what `RemoteRouter` builds from a list of URLs): each
request goes to the answering server with the fewest requests in flight (ties: the one that has
scored the fewest responses); a server that fails a request (unreachable, timing out, busy) is
skipped for a back-off that doubles with each failure in a row (`backoff_s` .. `max_backoff_s`)
and then tried again, and the request goes to another server at once, so no reward is lost
while any server answers. Only when every server has failed `retries + 1` times for one request
does it raise `RewardServiceUnavailable`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from mmrl.server.protocol import result_from_json, sample_to_record
from mmrl.types import Sample, VerifierResult, VerifyContext

log = logging.getLogger(__name__)

URL_ENV = "MMRL_REWARD_URL"
"""Environment variable with the reward server's base URL (`http://host:port`)."""
TOKEN_ENV = "MMRL_REWARD_TOKEN"
"""Environment variable with the bearer token the server expects (if any)."""
RETRY_STATUSES = frozenset({429, 502, 503, 504})
"""HTTP statuses worth retrying: busy or temporarily unavailable."""
ENDPOINTS = ("/score", "/get_reward", "/judge", "/health", "/ready", "/metrics")


class RewardServiceError(RuntimeError):
    """Base class: the reward server did not give an answer."""


class RewardRequestError(RewardServiceError):
    """The server rejected the request (a 4xx other than 429); `detail` is its message."""

    def __init__(self, status: int, detail: str, message: str):
        super().__init__(message)
        self.status = status
        self.detail = detail


class RewardServiceUnavailable(RewardServiceError):
    """No answer after all retries (unreachable, timing out, or busy)."""


def base_url(url: str) -> str:
    """`http://host:port` from a base URL or an endpoint URL (`.../get_reward` is accepted); a
    URL that is not http(s) is a `ValueError` at once (it would only fail on every retry)."""
    from mmrl.config import HTTP_URL_NEEDED, is_http_url

    if not is_http_url(url):
        raise ValueError(f"reward server URL {url!r} {HTTP_URL_NEEDED}")
    url = url.strip().rstrip("/")
    for endpoint in ENDPOINTS:
        if url.endswith(endpoint):
            return url[: -len(endpoint)]
    return url


class RewardClient:
    """A synchronous client for one reward server (thread-safe; keeps connections alive).

    Args:
        url: `http://host:port` (default: $MMRL_REWARD_URL).
        token: bearer token (default: $MMRL_REWARD_TOKEN).
        timeout_s: read/write time-out per attempt; keep it above the server's
            `request_timeout_s` so the server's own time-out answers first.
        connect_timeout_s: time-out for opening a connection.
        retries: retries after the first attempt (0: none).
        backoff_s, max_backoff_s: the first retry waits `backoff_s` (jittered by up to +25%), each
            next one twice as long, never more than `max_backoff_s`.
        max_batch: most responses per request (larger batches are split; match the server's).
        transport: an `httpx` transport (tests); `sleep`: the function used to wait.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        max_batch: int = 1024,
        transport: Any = None,
        sleep: Callable[[float], None] = time.sleep,
    ):
        import httpx

        url = url or os.environ.get(URL_ENV)
        if not url:
            raise ValueError(f"no reward server URL: pass url= or set ${URL_ENV}=http://host:port")
        if retries < 0 or max_batch < 1:
            raise ValueError(f"retries must be >= 0 and max_batch >= 1, got {retries} and {max_batch}")
        self.url = base_url(url)
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_batch = max_batch
        self._sleep = sleep
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64),
        )

    # -- transport

    def request(self, method: str, path: str, payload: Any = None) -> Any:
        """One call with retries; the decoded JSON (or text for non-JSON answers)."""
        import httpx

        url = self.url + path
        content = None if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            retry_after = None
            try:
                response = self._http.request(method, url, content=content)
            except httpx.TimeoutException as exc:
                last = f"timed out ({type(exc).__name__})"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                status = response.status_code
                if status < 400:
                    if response.headers.get("content-type", "").startswith("application/json"):
                        return response.json()
                    return response.text
                detail = _detail(response)
                if status not in RETRY_STATUSES:
                    raise RewardRequestError(status, detail, f"{method} {url} -> HTTP {status}: {detail}")
                last = f"HTTP {status}: {detail}"
                retry_after = _seconds(response.headers.get("retry-after"))
            if attempt == self.retries:
                break
            delay = min(self.max_backoff_s, self.backoff_s * 2**attempt) * (1 + 0.25 * random.random())
            if retry_after is not None:
                delay = max(delay, min(retry_after, self.max_backoff_s))
            log.info("%s %s: %s; retry %d/%d in %.2fs", method, url, last, attempt + 1, self.retries, delay)
            self._sleep(delay)
        raise RewardServiceUnavailable(f"{method} {url} failed after {self.retries + 1} attempt(s): {last}")

    # -- endpoints

    def score(
        self, samples: Sequence[Sample], responses: Sequence[str], context: VerifyContext | None = None
    ) -> list[VerifierResult]:
        """Score `responses[i]` against `samples[i]` on the server (`POST /score`)."""
        if len(samples) != len(responses):
            raise ValueError(f"{len(samples)} samples but {len(responses)} responses")
        records: list[dict] = []
        index: list[int] = []
        seen: dict[int, int] = {}
        for sample in samples:
            j = seen.get(id(sample))
            if j is None:
                j = seen[id(sample)] = len(records)
                records.append(sample_to_record(sample))
            index.append(j)
        return [result_from_json(r) for r in self.score_records(records, responses, context, index)]

    def score_records(
        self,
        records: Sequence[dict],
        responses: Sequence[str],
        context: VerifyContext | None = None,
        sample_index: Sequence[int] | None = None,
    ) -> list[dict]:
        """Score responses against sample records (mmrl's JSON format); `sample_index[i]` says
        which record `responses[i]` answers (default: one to one). Batches larger than
        `max_batch` are split; results come back in response order."""
        if sample_index is None:
            if len(records) != len(responses):
                raise ValueError(f"{len(records)} records but {len(responses)} responses")
            sample_index = range(len(responses))
        ctx = None if context is None else {"step": context.step, "total_steps": context.total_steps}
        out: list[dict] = []
        for start in range(0, len(responses), self.max_batch):
            part = list(sample_index[start : start + self.max_batch])
            local: dict[int, int] = {}
            for j in part:
                local.setdefault(j, len(local))
            payload: dict[str, Any] = {
                "samples": [records[j] for j in local],
                "responses": list(responses[start : start + self.max_batch]),
                "sample_index": [local[j] for j in part],
            }
            if ctx is not None:
                payload["context"] = ctx
            answer = self.request("POST", "/score", payload)
            results = answer["results"]
            if len(results) != len(part):
                raise RewardServiceError(
                    f"the server returned {len(results)} results for {len(part)} responses"
                )
            out.extend(results)
        return out

    def get_reward(
        self,
        queries: Sequence[str],
        prompts: Sequence[str] | None = None,
        labels: Sequence[Any] | None = None,
    ) -> dict[str, Any]:
        """OpenRLHF's call: `{"rewards", "scores", "extra_logs"}`."""
        payload: dict[str, Any] = {"query": list(queries)}
        if prompts is not None:
            payload["prompts"] = list(prompts)
        if labels is not None:
            payload["labels"] = list(labels)
        return self.request("POST", "/get_reward", payload)

    def judge(self, payload: dict[str, Any]) -> dict[str, Any]:
        """V-Triune's call: `{"rewards": {"final_reward", ...}, "error"}`."""
        return self.request("POST", "/judge", payload)

    def health(self) -> dict[str, Any]:
        return self.request("GET", "/health")

    def ready(self) -> dict[str, Any]:
        """The server's readiness (raises `RewardServiceUnavailable` while it is not ready)."""
        return self.request("GET", "/ready")

    def metrics(self) -> str:
        return self.request("GET", "/metrics")

    def probe_ready(self) -> dict[str, Any] | None:
        """One `GET /ready` without retries: the readiness answer, or None if the server is not
        ready or does not answer."""
        import httpx

        try:
            response = self._http.get(self.url + "/ready")
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> dict[str, Any]:
        """Poll `/ready` until a verifier worker is warm; `RewardServiceUnavailable` after `timeout_s`."""
        import httpx

        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while True:
            try:
                response = self._http.get(self.url + "/ready")
                if response.status_code == 200:
                    return response.json()
                last = f"HTTP {response.status_code}: {_detail(response)}"
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise RewardServiceUnavailable(f"{self.url} not ready after {timeout_s:g}s: {last}")
            time.sleep(poll_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _detail(response: Any) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return json.dumps(body)[:500]


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------------
# Several servers


@dataclass
class ServerState:
    """One server of a `RewardServerPool`: its client, load and health."""

    client: RewardClient
    in_flight: int = 0
    """Requests sent to it and not answered yet."""
    requests: int = 0
    """Requests it answered."""
    responses: int = 0
    """Responses it scored (in the requests it answered)."""
    failures: int = 0
    """Requests it failed in a row (0: healthy)."""
    failed_total: int = 0
    """Requests it failed in all (each was sent to another server)."""
    skip_until: float = 0.0
    """Not sent requests before this time (`clock()`), after a failure."""

    @property
    def url(self) -> str:
        return self.client.url


class RewardServerPool:
    """Several `mmrl serve` servers behind `RewardClient`'s calls (`score`, `score_records`,
    `wait_ready`), as `RemoteRouter` uses them (module docs: how requests are spread and
    failures skipped).

    Args:
        urls: the servers (two or more, distinct). token: their bearer token ($MMRL_REWARD_TOKEN).
        retries: failed attempts per server a request may use before it gives up (each server
            is tried `retries + 1` times in all); the servers' own clients do not retry.
        backoff_s, max_backoff_s: a server that fails is skipped for `backoff_s`, doubled with
            each failure in a row, at most `max_backoff_s`.
        clock, sleep: time and waiting (tests); **client_options: passed to each `RewardClient`.
    """

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None = None,
        *,
        retries: int = 3,
        backoff_s: float = 0.25,
        max_backoff_s: float = 8.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        **client_options: Any,
    ):
        urls = [base_url(u) for u in urls]
        if len(urls) < 2:
            raise ValueError(f"a pool needs two or more reward servers, got {urls}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"reward server listed twice: {urls}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.servers = [ServerState(RewardClient(u, token, retries=0, **client_options)) for u in urls]
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The servers' URLs (for messages)."""
        return ", ".join(s.url for s in self.servers)

    # -- choosing a server

    def _acquire(self) -> ServerState | float:
        """The server to send the next request to (its `in_flight` counted), or, while every
        server is being skipped, the seconds until the first may be tried again."""
        with self._lock:
            now = self._clock()
            up = [s for s in self.servers if s.skip_until <= now]
            if not up:
                return min(s.skip_until for s in self.servers) - now
            server = min(up, key=lambda s: (s.in_flight, s.responses))
            server.in_flight += 1
            return server

    def _answered(self, server: ServerState, responses: int) -> None:
        with self._lock:
            server.in_flight -= 1
            server.requests += 1
            server.responses += responses
            if server.failures:
                log.info("reward server %s answers again", server.url)
            server.failures = 0
            server.skip_until = 0.0

    def _failed(self, server: ServerState, error: Exception) -> None:
        with self._lock:
            server.in_flight -= 1
            server.failures += 1
            server.failed_total += 1
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (server.failures - 1))
            server.skip_until = self._clock() + delay
        log.warning(
            "reward server %s did not answer (%s): its requests go to the others; tried again in %.2fs "
            "(failure %d in a row)",
            server.url, error, delay, server.failures,
        )  # fmt: skip

    def _call(self, fn: Callable[[RewardClient], Any], responses: int) -> Any:
        """`fn(client)` on one server after another until one answers (see the class docs)."""
        attempts, limit = 0, (self.retries + 1) * len(self.servers)
        errors: list[str] = []
        while True:
            server = self._acquire()
            if not isinstance(server, ServerState):
                self._sleep(max(0.0, server))  # every server is being skipped: wait for the first
                continue
            try:
                answer = fn(server.client)
            except RewardServiceUnavailable as exc:
                self._failed(server, exc)
                attempts += 1
                errors.append(f"{server.url}: {exc}")
                if attempts >= limit:
                    raise RewardServiceUnavailable(
                        f"no reward server answered after {attempts} attempts over {len(self.servers)} "
                        f"servers; last errors: {'; '.join(errors[-len(self.servers) :])}"
                    ) from exc
                continue
            except BaseException:
                with self._lock:
                    server.in_flight -= 1
                raise
            self._answered(server, responses)
            return answer

    # -- RewardClient's calls

    def score(
        self, samples: Sequence[Sample], responses: Sequence[str], context: VerifyContext | None = None
    ) -> list[VerifierResult]:
        """`RewardClient.score` on the least loaded answering server."""
        return self._call(lambda c: c.score(samples, responses, context), len(responses))

    def score_records(
        self,
        records: Sequence[dict],
        responses: Sequence[str],
        context: VerifyContext | None = None,
        sample_index: Sequence[int] | None = None,
    ) -> list[dict]:
        """`RewardClient.score_records` on the least loaded answering server."""
        return self._call(
            lambda c: c.score_records(records, responses, context, sample_index), len(responses)
        )

    def wait_ready(self, timeout_s: float = 120.0, poll_s: float = 0.2) -> dict[str, Any]:
        """Wait until a server is ready; the servers not ready then are skipped (and tried again
        later, as after a failure). Returns `verifiers`: those every ready server has, and
        `servers_ready`. `RewardServiceUnavailable` if none is ready after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            answers = [(s, s.client.probe_ready()) for s in self.servers]
            ready = [(s, a) for s, a in answers if a is not None]
            if ready:
                break
            if time.monotonic() >= deadline:
                raise RewardServiceUnavailable(f"no reward server of {self.url} ready after {timeout_s:g}s")
            time.sleep(poll_s)
        for server, answer in answers:
            if answer is None:
                self._failed(server, RewardServiceUnavailable("not ready at start"))
        verifiers = set.intersection(*(set(a.get("verifiers", [])) for _, a in ready))
        return {"verifiers": sorted(verifiers), "servers_ready": len(ready)}

    def stats(self) -> list[dict[str, Any]]:
        """Per server: url, requests and responses answered, failures (in a row, in all), whether
        it is being skipped now."""
        with self._lock:
            now = self._clock()
            return [
                {"url": s.url, "requests": s.requests, "responses": s.responses, "in_flight": s.in_flight,
                 "failures": s.failures, "failed_total": s.failed_total, "skipped": s.skip_until > now}
                for s in self.servers
            ]  # fmt: skip

    def close(self) -> None:
        for s in self.servers:
            s.client.close()


# ---------------------------------------------------------------------------------------------
# RemoteRouter


class RemotePendingRewards:
    """Like `mmrl.router.PendingRewards`: rows are buffered as they are added and sent in
    batches of `batch_size` on background threads; `result()` gathers them in row order."""

    def __init__(self, router: RemoteRouter, context: VerifyContext, n_rows: int):
        self.router = router
        self.context = context
        self._texts: list[str | None] = [None] * n_rows
        self._futures: list[tuple[Future, int] | None] = [None] * n_rows
        self._buffer: list[tuple[int, Sample, str]] = []
        self._lock = threading.Lock()

    def add(self, row: int, sample: Sample, text: str) -> None:
        """Queue `text` as the response of row `row` (sent once `batch_size` rows are waiting)."""
        with self._lock:
            self._texts[row] = text
            self._buffer.append((row, sample, text))
            if len(self._buffer) >= self.router.batch_size:
                self._flush()

    def _flush(self) -> None:
        rows, self._buffer = self._buffer, []
        if not rows:
            return
        future = self.router._executor.submit(
            self.router.client.score, [s for _, s, _ in rows], [t for _, _, t in rows], self.context
        )
        for k, (row, _, _) in enumerate(rows):
            self._futures[row] = (future, k)

    def result(self, samples: list[Sample], texts: list[str]):
        """Every row's `VerifierResult` as a `mmrl.router.RewardBatch`. Rows never added, or
        added with another text, are scored now. Raises `RewardServiceError` if the server
        gives no answer."""
        from mmrl.router import RewardBatch

        if len(samples) != len(texts) or len(texts) != len(self._texts):
            raise ValueError(f"{len(samples)} samples, {len(texts)} responses, {len(self._texts)} rows")
        return RewardBatch.gather(samples, self.wait(range(len(texts)), samples, texts))

    def wait(self, rows: Iterable[int], samples: list[Sample], texts: list[str]) -> list[VerifierResult]:
        """The results of `rows` alone (`samples` and `texts` are the whole batch's): rows still
        buffered are sent now, stale or missing rows scored now; errors are logged and counted
        by `result`, not here."""
        rows = list(rows)
        with self._lock:
            for row in rows:
                if self._texts[row] != texts[row]:
                    self._texts[row] = texts[row]
                    self._buffer.append((row, samples[row], texts[row]))
            buffered = {row for row, _, _ in self._buffer}
            if any(row in buffered for row in rows):
                self._flush()
        return [self._futures[row][0].result()[self._futures[row][1]] for row in rows]


class RemoteRouter:
    """`mmrl.router.Router`'s interface (`start`, `submit`, `score`, `warm_up`, `close`) on
    remote `mmrl serve` servers: the trainer switches by constructing this instead of a `Router`.

    Args:
        url: the server (default: $MMRL_REWARD_URL), or a list of servers (a `RewardServerPool`);
            token: their bearer token ($MMRL_REWARD_TOKEN).
        time_limit_s: accepted for symmetry with `Router`; the server enforces its own limit.
        plugins: accepted for symmetry; the server must have been started with them.
        batch_size: rows per request while responses stream in (`result()` sends the rest).
        max_in_flight: concurrent requests (default: 4 per server).
        client: a ready `RewardClient` or `RewardServerPool` (then url/token/timeouts are ignored).
        **client_options: passed to `RewardClient` / `RewardServerPool` (timeout_s, retries,
            backoff_s, ...).
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        token: str | None = None,
        time_limit_s: float = 5.0,
        plugins: list[str] | tuple[str, ...] = (),
        *,
        batch_size: int = 64,
        max_in_flight: int | None = None,
        client: RewardClient | RewardServerPool | None = None,
        **client_options: Any,
    ):
        if client is None:
            urls = [url] if url is None or isinstance(url, str) else list(url)
            if len(urls) > 1:
                client = RewardServerPool(urls, token, **client_options)
            else:
                client = RewardClient(urls[0] if urls else None, token, **client_options)
        self.client = client
        self.time_limit_s = time_limit_s
        self.plugins = tuple(plugins)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        n_servers = len(client.servers) if isinstance(client, RewardServerPool) else 1
        self._executor = ThreadPoolExecutor(
            max_workers=max_in_flight or 4 * n_servers, thread_name_prefix="mmrl-remote-reward"
        )

    def start(self, context: VerifyContext, n_rows: int) -> RemotePendingRewards:
        """An empty pending batch; add responses with `.add(row, sample, text)` as they finish."""
        return RemotePendingRewards(self, context, n_rows)

    def submit(self, samples: list[Sample], texts: list[str], context: VerifyContext) -> RemotePendingRewards:
        if len(samples) != len(texts):
            raise ValueError(f"{len(samples)} samples but {len(texts)} responses")
        pending = self.start(context, len(samples))
        for row, (sample, text) in enumerate(zip(samples, texts)):
            pending.add(row, sample, text)
        return pending

    def score(self, samples: list[Sample], texts: list[str], context: VerifyContext):
        return self.submit(samples, texts, context).result(samples, texts)

    def warm_up(self, timeout_s: float = 120.0) -> float:
        """Wait until the server has a warm verifier worker; returns seconds. Raises
        `RewardServiceUnavailable` if it never becomes ready, or `ValueError` if it lacks a
        verifier that `plugins` would register here."""
        start = time.monotonic()
        info = self.client.wait_ready(timeout_s)
        if self.plugins:
            from mmrl.router import import_plugins
            from mmrl.verifiers.registry import verifier_names

            import_plugins(self.plugins)
            missing = sorted(set(verifier_names()) - set(info.get("verifiers", [])))
            if missing:
                raise ValueError(
                    f"the reward server at {self.client.url} lacks verifier(s) {missing}; start it with "
                    f"plugins {list(self.plugins)}"
                )
        return time.monotonic() - start

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self.client.close()

    def __enter__(self) -> RemoteRouter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

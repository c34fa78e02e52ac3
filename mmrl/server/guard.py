"""The reward server's guards at the connection and request level: connection caps, the
request-head time limit, who may send work (token or client network), and a redacted access log.

**Connections.** uvicorn alone keeps a connection that never sends a byte open forever (its
keep-alive timer starts only after a first response), and counts it towards
`limit_concurrency`, so a few thousand idle sockets make every other client get 503 for as
long as they are held. `ConnectionGuard` instead

- counts open connections per client address and in all; a connection beyond
  `max_connections_per_client` or `max_connections` is not admitted (and not counted): its
  request gets 503 with `Retry-After` and `Connection: close`;
- gives every connection `head_timeout_s` to deliver a request's head (request line and headers):
  from when it opens, and after each response from its first byte of the next request (the
  idle time in between is uvicorn's keep-alive limit). A connection past it is closed, admitted
  or not, so idle and trickling connections (slowloris) free their place.

Once the head is in, the body has `body_timeout_s` in all (`RewardEndpoints._read_body_in_time`
in `app.py`): past it, 408 and the connection is closed.

The guard sits in the HTTP protocol object uvicorn creates per connection (`guarded_protocol`):
it reads the protocol's `cycle` (the request being served; uvicorn's httptools and h11
protocols both keep one) to tell "waiting for a head" from "serving a request".

**Authentication.** `Authenticator`: a bearer token in the `Authorization` header, or (with
`query_token`) as the URL's `token` parameter, for clients that cannot send headers; requests
from `allow_networks` (CIDR) need no token. The access log prints a `token` parameter as
`token=***` (`redact_access_log`).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import re
import urllib.parse
from collections import Counter
from collections.abc import Callable
from typing import Any

from mmrl.server.protocol import RequestError

log = logging.getLogger("mmrl.server")

TOKEN_PARAM = "token"
"""The URL query parameter that may carry the token."""


class ConnectionGuard:
    """Open-connection counts (per client address and in all) and the head time limit's
    settings; one per server, shared by all its connections."""

    def __init__(
        self,
        max_connections: int,
        max_per_client: int,
        head_timeout_s: float,
        retry_after_s: int,
    ):
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.head_timeout_s = head_timeout_s
        self.retry_after_s = retry_after_s
        self.open = 0
        """Admitted connections now open."""
        self.per_client: Counter = Counter()
        self.refused = 0
        """Connections not admitted (over a cap), in all."""
        self.head_timeouts = 0
        """Connections closed for not sending a request head in time, in all."""

    def admit(self, client: str) -> str | None:
        """Count a new connection from `client`; None if admitted, else why not (it is not
        counted then: `release` only for admitted ones)."""
        if self.per_client[client] >= self.max_per_client:
            reason = (
                f"too many open connections from {client} (limit {self.max_per_client} per client address)"
            )
        elif self.open >= self.max_connections:
            reason = f"too many open connections (limit {self.max_connections})"
        else:
            self.per_client[client] += 1
            self.open += 1
            return None
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th...: seen, never a flood
            log.warning("refusing a connection: %s (%d refused so far)", reason, self.refused)
        return reason

    def release(self, client: str) -> None:
        """An admitted connection from `client` closed."""
        self.open -= 1
        left = self.per_client[client] - 1
        if left > 0:
            self.per_client[client] = left
        else:
            del self.per_client[client]

    def refusal_app(self, reason: str) -> Callable:
        """An ASGI app answering every request with 503, `Retry-After` and `Connection: close`."""
        retry = self.retry_after_s
        body = json.dumps({"detail": f"server busy: {reason}; retry after {retry}s"}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(retry).encode()),
            (b"connection", b"close"),
        ]

        async def refuse(scope: dict, receive: Callable, send: Callable) -> None:
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return refuse

    def render(self) -> str:
        """Prometheus text lines of the guard's counters."""
        return "\n".join(
            [
                "# HELP mmrl_connections_open Admitted HTTP connections now open.",
                "# TYPE mmrl_connections_open gauge",
                f"mmrl_connections_open {self.open}",
                "# HELP mmrl_connections_refused_total Connections over a connection cap (answered 503).",
                "# TYPE mmrl_connections_refused_total counter",
                f"mmrl_connections_refused_total {self.refused}",
                "# HELP mmrl_head_timeouts_total Connections closed for not sending a request head in time.",
                "# TYPE mmrl_head_timeouts_total counter",
                f"mmrl_head_timeouts_total {self.head_timeouts}",
            ]
        )


def guarded_protocol(base: type, guard: ConnectionGuard) -> type:
    """uvicorn's HTTP protocol class `base` with `guard`'s caps and head time limit."""

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _guard_client: str | None = None
        _guard_admitted = False
        _head_timer: asyncio.TimerHandle | None = None
        _head_cycle: Any = None

        def connection_made(self, transport) -> None:
            peer = transport.get_extra_info("peername")
            client = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            self._guard_client = client
            refusal = guard.admit(client)
            self._guard_admitted = refusal is None
            super().connection_made(transport)
            if refusal is not None:
                self.app = guard.refusal_app(refusal)  # the protocol calls `self.app` per request
            self._arm_head_timer(None)

        def data_received(self, data: bytes) -> None:
            before = getattr(self, "cycle", None)
            super().data_received(data)
            cycle = getattr(self, "cycle", None)
            if self._head_timer is not None:
                if cycle is not self._head_cycle:  # a head arrived: a request is being served
                    self._cancel_head_timer()
            elif cycle is before and (before is None or before.response_complete):
                # The first bytes of the next request, and its head is not complete yet.
                self._arm_head_timer(before)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            if self._guard_admitted:
                self._guard_admitted = False
                guard.release(self._guard_client or "")
            super().connection_lost(exc)

        def _arm_head_timer(self, cycle: Any) -> None:
            self._cancel_head_timer()
            self._head_cycle = cycle
            self._head_timer = asyncio.get_running_loop().call_later(guard.head_timeout_s, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            cycle = getattr(self, "cycle", None)
            if cycle is not self._head_cycle or self.transport is None or self.transport.is_closing():
                return
            guard.head_timeouts += 1
            if guard.head_timeouts & (guard.head_timeouts - 1) == 0:
                log.warning(
                    "closed a connection from %s that sent no complete request head within %gs (%d so far)",
                    self._guard_client,
                    guard.head_timeout_s,
                    guard.head_timeouts,
                )
            self.transport.close()

    return GuardedHTTPProtocol


# ---------------------------------------------------------------------------------------------
# Who may send work


class Authenticator:
    """Checks a request's credentials: the bearer token (header, or the URL's `token`
    parameter with `query_token`), or a client address inside `allow_networks`."""

    def __init__(self, token: str | None, query_token: bool, allow_networks: list[str]):
        self.token = token.encode() if token else None
        self.query_token = query_token
        self.networks = [ipaddress.ip_network(str(n), strict=False) for n in allow_networks]

    @property
    def open(self) -> bool:
        """True when every request is accepted (no token, no network list)."""
        return self.token is None and not self.networks

    def check(self, scope: dict, authorization: bytes | None) -> None:
        """Raise `RequestError` 401 (no or a wrong token) or 403 (an address outside
        `allow_networks` and no token configured)."""
        if self.open:
            return
        if self.networks and self._allowed(scope.get("client")):
            return
        if self.token is None:
            client = scope.get("client")
            address = client[0] if client else "an unknown address"
            raise RequestError(403, f"requests from {address} are not accepted (allow_networks)")
        if authorization:
            scheme, _, value = authorization.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), self.token):
                raise RequestError(401, "invalid bearer token")
            return
        given = self._query_token(scope.get("query_string", b"")) if self.query_token else None
        if given is None:
            where = " or the URL parameter '?token=<token>'" if self.query_token else ""
            raise RequestError(
                401, f"missing bearer token: send the header 'Authorization: Bearer <token>'{where}"
            )
        if not hmac.compare_digest(given, self.token):
            raise RequestError(401, "invalid token (the URL's token parameter)")

    def _allowed(self, client: Any) -> bool:
        if not client:
            return False
        try:
            address = ipaddress.ip_address(str(client[0]).split("%")[0])
        except ValueError:
            return False
        mapped = getattr(address, "ipv4_mapped", None)  # "::ffff:10.0.0.5" on a dual-stack socket
        return any(address in n or (mapped is not None and mapped in n) for n in self.networks)

    @staticmethod
    def _query_token(query: bytes) -> bytes | None:
        if not query or TOKEN_PARAM.encode() not in query:
            return None
        values = urllib.parse.parse_qs(query.decode("latin-1"), keep_blank_values=True).get(TOKEN_PARAM)
        return values[-1].encode("latin-1") if values else None


_TOKEN_IN_QUERY = re.compile(r"([?&]" + TOKEN_PARAM + r"=)[^&#\s]*", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with the value of every `token` URL parameter replaced by `***`."""
    return _TOKEN_IN_QUERY.sub(r"\1***", text)


class _RedactTokens(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def redact_access_log(logger_name: str = "uvicorn.access") -> None:
    """Make the access log print `token=***` instead of a token given in the URL (uvicorn logs
    the path with its query string)."""
    logger = logging.getLogger(logger_name)
    if not any(isinstance(f, _RedactTokens) for f in logger.filters):
        logger.addFilter(_RedactTokens())

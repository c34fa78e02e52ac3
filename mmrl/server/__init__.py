"""Reward-server mode: mmrl's verifiers as an HTTP service for other trainers (and mmrl's own).

    mmrl serve [--host 127.0.0.1] [--port 8000] [--workers N] [--config serve.yaml]

Endpoints (formats in `mmrl.server.protocol`, settings in `mmrl.server.config.ServeConfig`):

| endpoint | for |
|---|---|
| `POST /score` | native: mmrl sample records + responses -> score, components, error per response |
| `POST /get_reward` | OpenRLHF's remote reward model (`--remote_rm_url http://host:port/get_reward`) |
| `POST /judge` | V-Triune's reward client, unchanged (`GET /` answers their server check) |
| `GET /health`, `GET /ready` | liveness; readiness (200 once a verifier worker is warm, else 503) |
| `GET /metrics` | Prometheus text: requests, latency histogram, samples and errors per verifier |

Client side: `mmrl.server.client.RewardClient` (timeouts, bounded retries with backoff) and
`RemoteRouter` (the interface of `mmrl.router.Router`, for mmrl's trainer); `mmrl.integrations`
holds the veRL `compute_score` and a TRL reward-function factory.

Safety: binds loopback by default and refuses any other address without a token (header, or
the URL's `?token=`) or an `allow_networks` list; body size, batch size and pending-sample
limits (429 + Retry-After rather than an unbounded queue); connection caps per client address
and in all (503 + Retry-After) and a time limit for a request's head (`mmrl.server.guard`);
per-sample hard time limits and a per-request limit; hostile numbers and JSON get a 4xx naming
the field. Response text is never evaluated as code.

This package's `__init__` imports neither FastAPI nor uvicorn: a client needs only httpx.
"""

from __future__ import annotations

import argparse

from mmrl.server.config import ServeConfig, load_serve_config

__all__ = ["ServeConfig", "add_serve_arguments", "load_serve_config", "main", "run_serve_command"]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `mmrl serve`'s options to `parser` (see `mmrl.server.app.add_serve_arguments`)."""
    from mmrl.server.app import add_serve_arguments as add

    add(parser)


def run_serve_command(args: argparse.Namespace) -> int:
    """Run `mmrl serve` with parsed arguments; returns the exit status (2: bad settings)."""
    from mmrl.server.app import run_serve_command as run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """`mmrl serve` as a function, for `python -c "from mmrl.server import main; main()"`."""
    parser = argparse.ArgumentParser(prog="mmrl serve", description="Serve mmrl's verifiers over HTTP.")
    add_serve_arguments(parser)
    return run_serve_command(parser.parse_args(argv))

"""`ServeConfig`: every setting of the reward server, with its default and a one-line doc.

Loading order: these defaults, then a YAML file (`mmrl serve --config F`), then the command-line
flags (`--host`, `--port`, `--workers`). The bearer token may also come from the environment
(`MMRL_SERVE_TOKEN`), which keeps it out of `ps` listings and shell history.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmrl.types import AnswerLimits

TOKEN_ENV = "MMRL_SERVE_TOKEN"
"""Environment variable holding the bearer token when the config does not set one."""

LABEL_MODES = ("auto", "ground_truth", "reward_model")


@dataclass
class ServeConfig:
    """Settings of `mmrl serve` (see `mmrl.server` for the endpoints)."""

    host: str = "127.0.0.1"
    """Address to bind; anything but a loopback address requires `token`."""
    port: int = 8000
    """TCP port to listen on (0 picks a free one, logged at start)."""
    workers: int = 0
    """Verifier worker processes (0: one per CPU core this process may use). HTTP is served by one
    event loop that batches the samples of all open requests onto these workers."""
    token: str | None = None
    """Bearer token every request except `/health`, `/ready` and `/` must carry
    (`Authorization: Bearer <token>`, or `?token=<token>` in the URL with `query_token`); also
    read from $MMRL_SERVE_TOKEN."""
    query_token: bool = True
    """Also accept the token as the URL's query parameter `token` (`.../get_reward?token=T`),
    for clients that cannot send a header (OpenRLHF's `--remote_rm_url`). URLs get logged by
    clients and proxies; mmrl's own access log prints the parameter as `token=***`."""
    allow_networks: list[str] = field(default_factory=list)
    """Client networks (CIDR, e.g. `10.0.0.0/8`, `192.168.1.7/32`) whose requests are accepted
    without a token; with no `token` set, requests from anywhere else get 403. For clients that
    can carry no token at all (V-Triune's reward client builds its URL itself)."""
    time_limit_s: float = 5.0
    """Per-sample verifier time limit; a timer stops slow Python code, and past
    `time_limit_s + kill_grace_s` the worker process is killed and the sample gets an error."""
    kill_grace_s: float = 1.0
    """Extra time past `time_limit_s` before a stuck worker is killed and replaced."""
    request_timeout_s: float = 60.0
    """Per-request limit: samples not scored by then get an error result and are dropped from
    the queue (the response still comes back, with status 200)."""
    max_body_bytes: int = 64 * 1024 * 1024
    """Largest request body accepted; larger ones get 413 before they are read."""
    max_batch: int = 4096
    """Most responses one request may carry (413 beyond)."""
    max_pending: int = 16384
    """Most samples queued or being scored at once; a request that would exceed it gets 429 with
    `Retry-After` (back-pressure instead of an unbounded queue)."""
    retry_after_s: int = 1
    """Seconds sent in `Retry-After` with a 429 or 503."""
    max_chunk: int = 256
    """Most samples sent to a worker in one message (samples of all requests are batched). An
    idle pool gets each request's samples at once, split between the workers; under load the
    queue is split into messages of up to this many, so the per-message cost (pickling, pipe,
    waking the worker) is spread thin."""
    max_connections: int = 2048
    """Open connections at most (those refused by `max_connections_per_client` not counted);
    a request on a connection beyond it gets 503 with `Retry-After`, and the connection is closed."""
    max_connections_per_client: int = 512
    """Open connections at most from one client address; beyond, as `max_connections`. Every
    process on the server's own machine shares the address 127.0.0.1."""
    head_timeout_s: float = 10.0
    """A connection must deliver a request's head (request line and headers) within this many
    seconds of opening, or of its first byte after a response; else it is closed. Idle
    connections that never send a byte are closed after it too."""
    body_timeout_s: float = 30.0
    """A request's whole body must arrive within this many seconds of its head (a body that
    trickles in gets no more); else the request gets 408 and the connection is closed, so
    connections that send headers and then nothing free their place. Raise it for large bodies
    over slow links (`max_body_bytes` at 10 Mbit/s takes about a minute)."""
    keep_alive_s: float = 30.0
    """Idle keep-alive connections are closed after this many seconds."""
    default_verifier: str = "math"
    """Verifier for `/get_reward` (OpenRLHF) labels that are a plain ground truth."""
    label_mode: str = "auto"
    """How `/get_reward` reads a label: `ground_truth` (the label is the ground truth for
    `default_verifier`), `reward_model` (a JSON object with the sample's `reward_model` fields:
    `ground_truth`, `verifier`, `verifier_params`, ratios; optionally `data_source`, `id`), or
    `auto` (a JSON object with a `verifier` key is a reward_model, anything else a ground truth)."""
    judge_format_ratio: float = 0.1
    """`format_ratio` for `/judge` (V-Triune) payloads that omit it (their server's default)."""
    judge_math: str = "vtriune"
    """How `/judge` scores V-Triune's `mathverify`: `vtriune` (their math-verify settings,
    for a drop-in replacement: `\\boxed{\\sqrt{18}}` for gold `3\\sqrt{2}`, `2^{10}` for 1024,
    `\\frac12` and `[0,1)` score 0 there as in V-Triune) or `mmrl` (mmrl's math verifier, which
    credits those; each sample is then also scored V-Triune's way, and how often the two disagree
    is counted in /metrics and logged)."""
    judge_iou_threshold: str = "average"
    """IoU threshold mode of `/judge` detection: "average", "dynamic" or a number in [0, 1] (V-Triune
    reads $DET_IOU_THRESHOLD; its launch script never exports it, so it runs "average")."""
    answer_limits: AnswerLimits = field(default_factory=AnswerLimits)
    """Caps on a response's final answer (characters, bracket nesting, tokens) checked before a
    verifier parses it; past one the response scores 0 with an error of its own kind
    (`answer_too_long`, ...), counted in `mmrl_verifier_errors_total{kind=...}`."""
    check_images: bool = False
    """Decode the images of `/score` samples and reject unreadable ones, and ones over
    `mmrl.types.MAX_IMAGE_PIXELS` (64 megapixels, data loading's limit), with 422 (rule-based
    verifiers never look at pixels, so by default images are only type-checked, never opened)."""
    max_request_pixels: int = 256_000_000
    """With `check_images`: the most pixels the images of one `/score` request may hold in all
    (each counted from its header, before it is decoded); beyond, 413. Bounds the decoding time
    and memory one request can cost (one image may hold up to 64 megapixels)."""
    image_decode_threads: int = 2
    """With `check_images`: threads that decode requests' images, off the event loop (which
    keeps serving other requests, `/health` included, meanwhile); requests past it wait."""
    image_root: str | None = None
    """With `check_images`: the folder image paths are read from, relative to it. A path that is
    absolute, holds `..` or leads out of it through a link is refused with one message, the same
    whether or not a file is there; None: no path is read (base64 images only)."""
    plugins: list[str] = field(default_factory=list)
    """Python modules to import (in the server and every worker) that register extra verifiers."""
    check_cache_size: int = 4096
    """Each worker remembers this many ground truths that passed the verifier's `check_sample`."""
    access_log: bool = False
    """Log one line per request (costs throughput)."""
    log_level: str = "info"
    """Log level of the server (debug, info, warning, error)."""

    def resolved_workers(self) -> int:
        """`workers`, with 0 meaning the number of CPU cores this process may run on."""
        if self.workers > 0:
            return self.workers
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)

    def validate(self) -> None:
        """Raise `ValueError` naming the setting that is unusable."""
        from mmrl.config import number_checks

        for ok, message in number_checks(self):
            if not ok:
                raise ValueError(message)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0: one per core), got {self.workers}")
        if self.label_mode not in LABEL_MODES:
            raise ValueError(f"label_mode must be one of {list(LABEL_MODES)}, got {self.label_mode!r}")
        for name in ("time_limit_s", "request_timeout_s", "head_timeout_s", "body_timeout_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.kill_grace_s < 0:
            raise ValueError(f"kill_grace_s must be >= 0, got {self.kill_grace_s}")
        for name in (
            "max_body_bytes",
            "max_batch",
            "max_pending",
            "max_chunk",
            "max_connections",
            "max_connections_per_client",
            "max_request_pixels",
            "image_decode_threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch > self.max_pending:
            raise ValueError(
                f"max_batch ({self.max_batch}) must not exceed max_pending ({self.max_pending}): "
                "a full batch could never be accepted"
            )
        from mmrl.config import answer_limit_checks

        for ok, message in answer_limit_checks(self.answer_limits, "answer_limits"):
            if not ok:
                raise ValueError(message)
        if self.image_root is not None and not Path(self.image_root).is_dir():
            raise ValueError(f"image_root {self.image_root!r} is not a folder")
        if self.judge_math not in ("vtriune", "mmrl"):
            raise ValueError(f"judge_math must be vtriune or mmrl, got {self.judge_math!r}")
        if self.judge_format_ratio < 0:
            raise ValueError(f"judge_format_ratio must be >= 0, got {self.judge_format_ratio}")
        threshold = str(self.judge_iou_threshold)
        if threshold not in ("average", "dynamic"):
            try:
                number = float(threshold)
            except ValueError:
                number = -1.0
            if not 0 <= number <= 1:
                raise ValueError(
                    f'judge_iou_threshold must be "average", "dynamic" or a number in [0, 1], got {threshold!r}'
                )
        if self.token is not None and not self.token.strip():
            raise ValueError("token is empty; unset it or give a non-empty token")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        host = bind_host(self.host)
        if not host:
            raise ValueError("host is empty; give an address to bind, such as 127.0.0.1")
        for i, network in enumerate(self.allow_networks):
            try:
                ipaddress.ip_network(str(network), strict=False)
            except ValueError as exc:
                raise ValueError(f"allow_networks[{i}]: {exc} (expected CIDR such as 10.0.0.0/8)") from None
        if not is_loopback(host) and not self.token and not self.allow_networks:
            raise ValueError(
                f"refusing to bind {self.host!r} without a token: the reward server accepts work from "
                f"anyone who can reach it. Set a bearer token (${TOKEN_ENV} or `token:` in the config "
                "file) or `allow_networks`, or bind a loopback address such as 127.0.0.1"
            )

    def bind_address(self) -> str:
        """`host` as a socket binds it (`[::1]` -> `::1`)."""
        return bind_host(self.host)


def bind_host(host: str) -> str:
    """An address as sockets take it: surrounding whitespace and the brackets of a URL's IPv6
    literal (`[::1]`) removed."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    host = bind_host(host)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_serve_config(
    config_file: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> ServeConfig:
    """Defaults <- YAML file <- `overrides` (fields set to None are skipped) <- $MMRL_SERVE_TOKEN
    (only when no token is configured); validated."""
    from omegaconf import OmegaConf

    from mmrl.config import config_object, merge_config_file, merge_config_values

    merged = OmegaConf.structured(ServeConfig)
    if config_file is not None:
        # The training config's reader: a folder, non-UTF-8 text, bad YAML (file:line:column) and
        # unknown keys (with the closest known one) are one-line errors naming the file.
        merged = merge_config_file(merged, config_file)
    if overrides:
        merged = merge_config_values(merged, {k: v for k, v in overrides.items() if v is not None}, "options")
    cfg: ServeConfig = config_object(merged)
    cfg.host = bind_host(cfg.host)
    if cfg.token is None and os.environ.get(TOKEN_ENV):
        cfg.token = os.environ[TOKEN_ENV]
    cfg.validate()
    return cfg

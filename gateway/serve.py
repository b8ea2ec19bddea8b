"""Run the gateway under uvicorn, refusing to expose an unauthenticated gateway."""

from __future__ import annotations

import errno
import gc
import logging
import socket

import uvicorn

from claw_pipelines.contracts.access import is_loopback
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.object_store import verify_lake_store
from claw_pipelines.lake.tokenizers import save_tokenizer
from claw_pipelines.settings import ClawSettings
from gateway.auth import KeyRing
from gateway.proxy.capture_mode import CaptureMode, probe_upstream
from gateway.proxy.replicas import upstream_urls


class GatewayRefused(Exception):
    """The gateway will not start; the message says why in one line."""


class InsecureBind(GatewayRefused):
    """A non-loopback bind was asked for with no API keys configured."""


class UnusableTokenizer(GatewayRefused):
    """`CLAW_TOKENIZER` names no loadable tokenizer and chat template."""


class NoTokenSource(GatewayRefused):
    """The upstream returns no token ids and no tokenizer is configured to compute them."""


class PortUnavailable(GatewayRefused):
    """The address and port cannot be listened on (taken, or not this host's)."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` (as uvicorn binds one), before anything starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "is in use" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        raise PortUnavailable(
            f"port {port} on {host} {why}: choose another with --port, or stop what listens there"
        ) from None
    sock.set_inheritable(True)
    return sock


def capture_mode(settings: ClawSettings) -> CaptureMode:
    """How this gateway will capture token ids: the upstream asked once, the tokenizer
    loaded (refused at start, in one line, rather than on the first call)."""
    probe = None
    for url in upstream_urls(settings.upstream_url or ""):  # the first replica that answers
        probe = probe_upstream(url)
        if probe.token_ids is not None:
            break
    capture = CaptureMode(settings.tokenizer, probe)
    if (why := capture.refusal()) is not None:
        raise NoTokenSource(f"CLAW_TOKENIZER: {why}")
    if settings.tokenizer is not None:
        try:
            capture.tokenizer  # noqa: B018 (loads it)
        except Exception as exc:
            raise UnusableTokenizer(f"CLAW_TOKENIZER: {exc}") from None
    return capture


def serve_gateway(settings: ClawSettings, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve the gateway until SIGINT/SIGTERM, then flush everything to bronze."""
    if not KeyRing.from_settings(settings).enabled and not is_loopback(host):
        raise InsecureBind(
            f"refusing to bind {host}: no API keys configured (set CLAW_API_KEYS or "
            "CLAW_API_KEYS_FILE, or bind 127.0.0.1)"
        )
    capture = capture_mode(settings)
    # a store that would lose concurrent commits is refused here, in one line, before "ready"
    verify_lake_store(settings.lake_uri, settings.storage_options)
    if capture.tokenizer is not None:  # readers of its steps decode them with it, anywhere
        save_tokenizer(Lake.from_settings(settings), capture.tokenizer)
    listener = bind_listener(host, port)  # a taken port is refused before the WAL opens
    from gateway.main import create_app

    # A server's heap is mostly long-lived (modules, schemas): move it out of the collector's
    # way, and collect young objects less often (each request allocates thousands of ints).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    config = uvicorn.Config(
        create_app(settings, capture=capture),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,  # /metrics counts requests; a log line per call costs on the hot path
        proxy_headers=False,  # nothing reads the client address: no X-Forwarded-* pass per call
        timeout_graceful_shutdown=30,
        limit_concurrency=4096,
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # the server has stopped and flushed by then
        pass
    finally:
        listener.close()
    if not server.started:  # as uvicorn.run: a failed start is a failed exit
        raise SystemExit(3)

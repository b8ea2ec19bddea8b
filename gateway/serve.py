"""Run the gateway under uvicorn, refusing to expose an unauthenticated gateway."""

from __future__ import annotations

import gc
import ipaddress
import logging

import uvicorn

from claw_pipelines.object_store import verify_lake_store
from claw_pipelines.settings import ClawSettings
from claw_pipelines.tokenization import load_chat_tokenizer
from gateway.auth import KeyRing


def is_loopback(host: str) -> bool:
    """Whether `host` binds only the loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class InsecureBind(Exception):
    """A non-loopback bind was asked for with no API keys configured."""


class UnusableTokenizer(Exception):
    """`CLAW_TOKENIZER` names no loadable tokenizer and chat template."""


def serve_gateway(settings: ClawSettings, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve the gateway until SIGINT/SIGTERM, then flush everything to bronze."""
    if not KeyRing.from_settings(settings).enabled and not is_loopback(host):
        raise InsecureBind(
            f"refusing to bind {host}: no API keys configured (set CLAW_API_KEYS or "
            "CLAW_API_KEYS_FILE, or bind 127.0.0.1)"
        )
    if settings.tokenizer is not None:  # refused at start, not on the first local tokenization
        try:
            load_chat_tokenizer(settings.tokenizer)
        except Exception as exc:
            raise UnusableTokenizer(f"CLAW_TOKENIZER: {exc}") from None
    # a store that would lose concurrent commits is refused here, in one line, before "ready"
    verify_lake_store(settings.lake_uri, settings.storage_options)
    from gateway.main import create_app

    # A server's heap is mostly long-lived (modules, schemas): move it out of the collector's
    # way, and collect young objects less often (each request allocates thousands of ints).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level="warning",
        access_log=False,  # /metrics counts requests; a log line per call costs on the hot path
        proxy_headers=False,  # nothing reads the client address: no X-Forwarded-* pass per call
        timeout_graceful_shutdown=30,
        limit_concurrency=4096,
        timeout_keep_alive=30,
    )

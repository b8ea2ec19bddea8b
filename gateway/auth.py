"""API keys at the gateway: the key a request presents (the key ring is shared with every read
path: `claw_pipelines.contracts.access`)."""

from __future__ import annotations

from claw_pipelines.contracts.access import DEFAULT_TENANT, KeyRing, create_key, hash_key

__all__ = ["DEFAULT_TENANT", "KeyRing", "create_key", "hash_key", "presented_key"]


def presented_key(authorization: str | None, api_key_header: str | None) -> str | None:
    """The key a request presents: `Authorization: Bearer <key>` or `X-API-Key`."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return api_key_header or None

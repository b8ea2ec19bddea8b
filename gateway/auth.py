"""API keys: each maps to a tenant; only SHA-256 hashes are kept, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from claw_pipelines.settings import ClawSettings

DEFAULT_TENANT = "default"
KEY_PREFIX = "claw-"
HASH_PREFIX = "sha256:"


def hash_key(key: str) -> str:
    """The stored form of a key."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def create_key(tenant: str) -> tuple[str, str]:
    """Mint a key for `tenant`: returns (the key, shown once; the keys-file line)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    return key, f"{hash_key(key)} {tenant}"


@dataclass
class KeyRing:
    """Hashed keys and their tenants; empty means auth is off (loopback only)."""

    entries: list[tuple[bytes, str]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured."""
        return bool(self.entries)

    def add(self, key_or_hash: str, tenant: str) -> None:
        """Add a key (plain text is hashed at once) for a tenant."""
        stored = key_or_hash if key_or_hash.startswith(HASH_PREFIX) else hash_key(key_or_hash)
        self.entries.append((stored.encode(), tenant))

    def tenant_for(self, key: str) -> str | None:
        """The tenant of a presented key, or None; every entry is compared (constant time)."""
        digest = hash_key(key).encode()
        found = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    @classmethod
    def from_settings(cls, settings: ClawSettings) -> KeyRing:
        """Keys from `CLAW_API_KEYS` ('key=tenant,...') and `CLAW_API_KEYS_FILE`."""
        ring = cls()
        for item in (settings.api_keys or "").split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, tenant = item.rpartition("=")
            if not sep or not key or not tenant:
                raise ValueError("CLAW_API_KEYS entries look like 'key=tenant'")
            ring.add(key, tenant)
        if settings.api_keys_file:
            for number, line in enumerate(Path(settings.api_keys_file).read_text().splitlines()):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                parts = line.split()
                if len(parts) != 2 or not parts[0].startswith(HASH_PREFIX):
                    raise ValueError(
                        f"{settings.api_keys_file}:{number + 1}: expected 'sha256:<hex> tenant'"
                    )
                ring.add(parts[0], parts[1])
        return ring


def presented_key(authorization: str | None, api_key_header: str | None) -> str | None:
    """The key a request presents: `Authorization: Bearer <key>` or `X-API-Key`."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return api_key_header or None

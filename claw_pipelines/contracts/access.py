"""Who may read what: API keys, the tenants they belong to, and the caller a read path serves.

One keys file serves every door (the gateway, the dashboard's key login, trainers, exports and
the CLI): `CLAW_API_KEYS_FILE` holds one `sha256:<hex> tenant [admin]` line per key, and
`CLAW_API_KEYS` gives `key=tenant` pairs inline. Only SHA-256 hashes are kept and presented keys
are compared in constant time. With no key configured at all a process is in local mode: it
serves loopback only and its callers see every tenant (the embedded default).

A `Caller` is what a read path checks: a tenant (sees that tenant's rows), or an admin (sees
every tenant, or one tenant when it names it: the explicit admin scope).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from claw_pipelines.contracts.errors import Forbidden

DEFAULT_TENANT = "default"
KEY_PREFIX = "claw-"
HASH_PREFIX = "sha256:"
ADMIN_ROLE = "admin"


def hash_key(key: str) -> str:
    """The stored form of a key."""
    return HASH_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def create_key(tenant: str, admin: bool = False) -> tuple[str, str]:
    """Mint a key for `tenant`: returns (the key, shown once; the keys-file line)."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    line = f"{hash_key(key)} {tenant}" + (f" {ADMIN_ROLE}" if admin else "")
    return key, line


def is_loopback(host: str) -> bool:
    """Whether `host` binds only the loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Caller:
    """Whose data a read serves: one tenant's, or every tenant's (an admin, or local mode)."""

    tenant: str | None  # None: every tenant
    admin: bool = False
    how: str = "key"  # how it was identified: key, identity, local

    @classmethod
    def local(cls) -> Caller:
        """Local mode (no keys configured): every tenant, as the embedded default always did."""
        return cls(None, admin=True, how="local")

    @property
    def sees_every_tenant(self) -> bool:
        """True when no tenant filter applies."""
        return self.tenant is None

    def scoped(self, tenant: str | None) -> Caller:
        """The caller narrowed to `tenant` (an admin's explicit scope; a tenant may only name
        itself)."""
        if tenant is None or tenant == self.tenant:
            return self
        if not self.admin:
            raise Forbidden(
                f"tenant {tenant!r} refused: this key belongs to tenant {self.tenant!r} "
                "(only an admin key may name another tenant)"
            )
        return Caller(tenant, admin=True, how=self.how)

    def may_read(self, tenant: str | None) -> bool:
        """Whether rows of `tenant` (None: rows of several tenants) are this caller's."""
        return self.tenant is None or (tenant is not None and tenant == self.tenant)

    def require_every_tenant(self, what: str) -> None:
        """Refuse unless this caller reads every tenant's data (an admin key, local mode)."""
        if not self.sees_every_tenant:
            raise Forbidden(
                f"{what} reads every tenant's data: it needs an admin key, and this key is "
                f"tenant {self.tenant!r}'s"
            )

    def require(self, tenant: str | None, what: str) -> None:
        """Refuse, naming the tenant, unless `what` (owned by `tenant`; None: shared by every
        tenant) is this caller's to read."""
        if self.may_read(tenant):
            return
        if tenant is None:
            raise Forbidden(
                f"{what} mixes every tenant's data (it names no tenant): only an admin key "
                f"reads it, and this key is tenant {self.tenant!r}'s"
            )
        raise Forbidden(
            f"{what} belongs to tenant {tenant!r}: this key is tenant {self.tenant!r}'s"
        )


@dataclass
class KeyRing:
    """Hashed keys, their tenants and roles; empty means auth is off (loopback only)."""

    entries: list[tuple[bytes, str, bool]] = field(default_factory=list)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured."""
        return bool(self.entries)

    def add(self, key_or_hash: str, tenant: str, admin: bool = False) -> None:
        """Add a key (plain text is hashed at once) for a tenant."""
        stored = key_or_hash if key_or_hash.startswith(HASH_PREFIX) else hash_key(key_or_hash)
        self.entries.append((stored.encode(), tenant, admin))

    def _entry(self, key: str) -> tuple[str, bool] | None:
        digest = hash_key(key).encode()
        found = None
        for stored, tenant, admin in self.entries:  # every entry compared: constant time
            if hmac.compare_digest(stored, digest):
                found = (tenant, admin)
        return found

    def tenant_for(self, key: str) -> str | None:
        """The tenant of a presented key, or None."""
        entry = self._entry(key)
        return None if entry is None else entry[0]

    def caller_for(self, key: str | None, tenant: str | None = None) -> Caller:
        """The caller a presented key makes (narrowed to `tenant` when given): local mode
        when no key is configured; `Forbidden` for a missing or unknown key."""
        if not self.enabled:
            return Caller.local().scoped(tenant)
        if not key:
            raise Forbidden(
                "this lake's reads need an API key: set CLAW_API_KEY (one of the keys "
                "file's, `claw keys create`)"
            )
        entry = self._entry(key)
        if entry is None:
            raise Forbidden("invalid API key: it is not in CLAW_API_KEYS / CLAW_API_KEYS_FILE")
        owner, admin = entry
        return Caller(None if admin else owner, admin=admin).scoped(tenant)

    @classmethod
    def from_settings(cls, settings: Any) -> KeyRing:
        """Keys from `CLAW_API_KEYS` ('key=tenant,...') and `CLAW_API_KEYS_FILE` (`settings`:
        a `ClawSettings`, which sits beside this layer)."""
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
            ring.extend_from_file(Path(settings.api_keys_file))
        return ring

    def extend_from_file(self, path: Path) -> None:
        """Add the keys of a keys file (`sha256:<hex> tenant [admin]` lines, # comments)."""
        for number, line in enumerate(path.read_text().splitlines()):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            role_ok = len(parts) == 2 or (len(parts) == 3 and parts[2] == ADMIN_ROLE)
            if not role_ok or not parts[0].startswith(HASH_PREFIX):
                raise ValueError(f"{path}:{number + 1}: expected 'sha256:<hex> tenant [admin]'")
            self.add(parts[0], parts[1], admin=len(parts) == 3)


def caller_from_settings(settings: Any, tenant: str | None = None) -> Caller:
    """The caller this process is: its `CLAW_API_KEY` against the configured keys (local mode
    when none is configured), narrowed to `tenant` when given."""
    return KeyRing.from_settings(settings).caller_for(settings.api_key, tenant)

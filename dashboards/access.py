"""Who may open the dashboard, and as which caller (docs/DESIGN.md §3): no Streamlit here, so
`claw dashboard` checks its bind with the same rules before it starts Streamlit.

Two doors, either or both:
- API keys: the gateway's keys (`CLAW_API_KEYS_FILE`, `CLAW_API_KEYS`), typed into the login
  page; a key is its tenant's (an admin key reads every tenant).
- OpenID Connect: Streamlit's own login (`st.login`), configured by the `[auth]` section of
  the dashboard's `secrets.toml`; the identity's `email` claim is mapped to a tenant by
  `CLAW_DASHBOARD_USERS_FILE` (`email tenant [admin]` lines). An identity with no line, or
  whose provider says its email is not verified, sees nothing.
With neither, the dashboard is in local mode (every tenant) and serves loopback only.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from claw_pipelines.contracts.access import ADMIN_ROLE, Caller, KeyRing, is_loopback

# what an [auth] section (and a named provider's section under it) must hold for st.login
SHARED_AUTH_FIELDS = ("redirect_uri", "cookie_secret")
PROVIDER_FIELDS = ("client_id", "client_secret", "server_metadata_url")
DEFAULT_PROVIDER = "default"  # st.login()'s name for the provider set in [auth] itself


class LoginConfigError(ValueError):
    """The login configuration cannot work (the message names the file and the field)."""


def secrets_files(explicit: str | Path | None = None) -> list[Path]:
    """The secrets.toml files the dashboard reads, as Streamlit looks for them: the one given
    (`claw dashboard --secrets`), else `~/.streamlit/secrets.toml` then
    `./.streamlit/secrets.toml` (later ones win)."""
    if explicit is not None:
        return [Path(explicit)]
    return [Path.home() / ".streamlit" / "secrets.toml", Path.cwd() / ".streamlit" / "secrets.toml"]


def auth_section(files: list[Path]) -> dict[str, Any]:
    """The `[auth]` section of those files merged (later files win), {} when none has one."""
    merged: dict[str, Any] = {}
    for path in files:
        if not path.is_file():
            continue
        try:
            found = tomllib.loads(path.read_text()).get("auth") or {}
        except tomllib.TOMLDecodeError as exc:
            raise LoginConfigError(f"{path}: not valid TOML ({exc})") from None
        merged.update(found)
    return merged


def oidc_providers(auth: Mapping[str, Any], where: str = "[auth]") -> tuple[str, ...]:
    """The OpenID Connect providers an `[auth]` section configures (`default` when the
    section holds a provider's fields itself, then each `[auth.<name>]`); () when it is
    empty. `LoginConfigError` names a missing field."""
    if not auth:
        return ()
    missing = [f for f in SHARED_AUTH_FIELDS if not auth.get(f)]
    if missing:
        raise LoginConfigError(f"{where}: {missing[0]} is missing (st.login needs it)")
    providers = []
    if any(auth.get(f) for f in PROVIDER_FIELDS):
        providers.append(DEFAULT_PROVIDER)
        _require_provider(auth, where)
    for name, section in auth.items():
        if isinstance(section, Mapping):
            _require_provider(section, f"{where[:-1]}.{name}]")
            providers.append(name)
    if not providers:
        raise LoginConfigError(
            f"{where}: no provider (client_id, client_secret, server_metadata_url)"
        )
    return tuple(providers)


def _require_provider(section: Mapping[str, Any], where: str) -> None:
    missing = [f for f in PROVIDER_FIELDS if not section.get(f)]
    if missing:
        raise LoginConfigError(f"{where}: {missing[0]} is missing (st.login needs it)")


@dataclass(frozen=True)
class UserMap:
    """Identities (their `email` claim, compared case-insensitively) and their tenants."""

    users: Mapping[str, tuple[str, bool]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path | None) -> UserMap:
        """A users file of `email tenant [admin]` lines (# comments); empty without one."""
        if path is None:
            return cls()
        users = {}
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise LoginConfigError(f"CLAW_DASHBOARD_USERS_FILE: {exc}") from None
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            role_ok = len(parts) == 2 or (len(parts) == 3 and parts[2] == ADMIN_ROLE)
            if not role_ok or "@" not in parts[0]:
                raise LoginConfigError(f"{path}:{number}: expected 'email tenant [admin]'")
            users[parts[0].lower()] = (parts[1], len(parts) == 3)
        return cls(users)

    def caller_for(self, identity: Mapping[str, Any]) -> Caller | None:
        """The caller an OpenID Connect identity (its claims) is, or None: no email, an email
        its provider says is not verified, or no line for it."""
        email = identity.get("email")
        if not isinstance(email, str) or identity.get("email_verified") is False:
            return None
        found = self.users.get(email.lower())
        if found is None:
            return None
        tenant, admin = found
        return Caller(None if admin else tenant, admin=admin, how="identity")


@dataclass(frozen=True)
class Doors:
    """The logins a dashboard offers: keys, OpenID Connect providers, or neither (local)."""

    keys: bool
    providers: tuple[str, ...] = ()

    @property
    def local(self) -> bool:
        """No login configured: every tenant, on loopback only."""
        return not self.keys and not self.providers


def doors(settings: Any, auth: Mapping[str, Any]) -> Doors:
    """The logins configured by `settings` (a `ClawSettings`: its keys) and an `[auth]`
    section."""
    return Doors(KeyRing.from_settings(settings).enabled, oidc_providers(auth))


def bind_refusal(host: str, found: Doors) -> str | None:
    """Why the dashboard must not bind `host` (None: it may): a non-loopback address with no
    login configured would show every tenant's data to anyone who reaches it."""
    if found.local and not is_loopback(host):
        return (
            f"refusing to bind {host}: no login configured (set CLAW_API_KEYS_FILE or "
            "CLAW_API_KEYS for key logins, or an [auth] section in the dashboard's "
            "secrets.toml for OpenID Connect; or bind 127.0.0.1)"
        )
    return None

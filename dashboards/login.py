"""The gate every run passes before a page reads anything: who this session is (a tenant's
key, an OpenID Connect identity mapped to a tenant, or local mode), the login page when nobody
is signed in yet, and the logout (the rules are in `dashboards.access`)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

import streamlit as st

from claw_pipelines.contracts.access import Caller, KeyRing, hash_key, is_loopback
from claw_pipelines.contracts.errors import Forbidden
from claw_pipelines.settings import ClawSettings
from dashboards.access import DEFAULT_PROVIDER, Doors, LoginConfigError, UserMap, oidc_providers

CALLER = "claw_caller"  # session state: the caller this session's reads are scoped to
KEY_HASH = "claw_key_hash"  # session state: the hash of the key it logged in with (not the key)
RELOAD_S = 5  # a keys or users file edited (a key revoked, a role changed) counts this soon


@st.cache_resource(ttl=RELOAD_S, show_spinner=False)
def _key_ring(api_keys: str | None, api_keys_file: str | None) -> KeyRing:
    return KeyRing.from_settings(ClawSettings(api_keys=api_keys, api_keys_file=api_keys_file))


@st.cache_resource(ttl=RELOAD_S, show_spinner=False)
def _users(path: str | None) -> UserMap:
    return UserMap.load(None if path is None else path)


def _auth_secrets() -> dict[str, Any]:
    """The `[auth]` section of the dashboard's secrets ({} without one)."""
    try:
        if not st.secrets.load_if_toml_exists():
            return {}
        section = st.secrets.get("auth")
    except Exception:  # no secrets file at all, or one Streamlit cannot parse: no [auth]
        return {}
    return _plain(section) if isinstance(section, Mapping) else {}


def _plain(section: Mapping) -> dict[str, Any]:
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in section.items()}


def _served_on_loopback() -> bool:
    """Whether this Streamlit server listens on loopback only (unset: every interface)."""
    address = st.get_option("server.address")
    return bool(address) and is_loopback(str(address))


def _key_caller(ring: KeyRing, stored: str) -> Caller | None:
    """The caller of the key whose hash this session keeps (None once it is revoked)."""
    found = None
    for digest, tenant, admin in ring.entries:  # every entry compared: constant time
        if hmac.compare_digest(digest, stored.encode()):
            found = Caller(None if admin else tenant, admin=admin, how="key")
    return found


def gate(pages: list) -> Caller:
    """This session's caller; or the login page (or why nobody may look), then stop. `pages`:
    the app's pages, registered but hidden and not run while nobody is signed in (so the page
    a link named opens after the login, and no link shows before)."""
    settings = ClawSettings()
    try:  # a file edited since `claw dashboard` checked it: said, and nothing shown
        ring = _key_ring(settings.api_keys, _text(settings.api_keys_file))
        providers = oidc_providers(_auth_secrets(), "[auth] in the dashboard's secrets.toml")
        users = _users(_text(settings.dashboard_users_file))
    except (LoginConfigError, ValueError, OSError) as exc:
        _stop_with(f"The login is misconfigured: {exc}", pages)
    doors = Doors(ring.enabled, providers)
    if doors.local:
        if not _served_on_loopback():
            _stop_with(
                "No login is configured, and this server listens beyond loopback: set "
                "CLAW_API_KEYS_FILE (key logins) or an [auth] section in secrets.toml "
                "(OpenID Connect), or run `claw dashboard` on 127.0.0.1.",
                pages,
            )
        caller = Caller.local()
    else:
        caller = _signed_in(doors, ring, users, pages)
    if caller is None:
        _login_page(doors, ring, pages)
        st.stop()
    st.session_state[CALLER] = caller
    return caller


def _text(path: Any) -> str | None:
    return None if path is None else str(path)


def _title(pages: list) -> None:
    """The login page's title; the pages stay registered, hidden, and are not run."""
    st.navigation(pages, position="hidden")
    st.title("Log in")


def _stop_with(message: str, pages: list) -> None:
    _title(pages)
    st.error(message)
    st.stop()


def _signed_in(doors: Doors, ring: KeyRing, users: UserMap, pages: list) -> Caller | None:
    """The caller this session signed in as (None: nobody yet); an identity with no tenant
    is told so, and the run stops."""
    if doors.keys and KEY_HASH in st.session_state:
        caller = _key_caller(ring, st.session_state[KEY_HASH])
        if caller is not None:
            return caller
        _forget()  # revoked since: log in again
        st.session_state["claw_login_error"] = "your key is no longer valid: log in again"
    if doors.providers and st.user.get("is_logged_in"):
        identity = st.user.to_dict()
        caller = users.caller_for(identity)
        if caller is None:
            _no_tenant(identity, pages)
        return caller
    return None


def _no_tenant(identity: Mapping[str, Any], pages: list) -> None:
    """An identity the users file does not map: it sees nothing, and is told why."""
    email = identity.get("email") or identity.get("sub") or "this identity"
    _title(pages)
    if identity.get("email_verified") is False:
        st.error(
            f"You are signed in as {email}, but your provider says that email is not verified."
        )
    else:
        st.error(
            f"You are signed in as {email}, but that identity has no tenant here: an admin "
            f"adds a line `{email} <tenant>` to CLAW_DASHBOARD_USERS_FILE."
        )
    if st.button("Log out"):
        _forget()
        st.logout()
    st.stop()


def _login_page(doors: Doors, ring: KeyRing, pages: list) -> None:
    """The login page: a key form and/or a button per identity provider; nothing of the lake."""
    _title(pages)
    st.caption("Claw lakehouse dashboard: log in to see your tenant's data.")
    if (why := st.session_state.pop("claw_login_error", None)) is not None:
        st.error(why)
    if doors.keys:
        with st.form("key-login", clear_on_submit=True):
            key = st.text_input(
                "API key",
                type="password",
                help="one of the gateway's keys (`claw keys create`): you see its tenant's "
                "data, or every tenant's with an admin key",
            )
            submitted = st.form_submit_button("Log in with key", type="primary")
        if submitted:
            _key_login(ring, key.strip())
    for provider in doors.providers:
        default = provider == DEFAULT_PROVIDER
        label = "Log in with your identity provider" if default else f"Log in with {provider}"
        if st.button(label, key=f"login-{provider}"):
            st.login(None if default else provider)


def _key_login(ring: KeyRing, key: str) -> None:
    if not key:
        st.error("enter your API key")
        return
    try:
        ring.caller_for(key)
    except Forbidden:
        st.error(
            "invalid API key: it is not one of this dashboard's keys "
            "(CLAW_API_KEYS_FILE / CLAW_API_KEYS)"
        )
        return
    _forget()
    st.session_state[KEY_HASH] = hash_key(key)
    st.rerun()


def _forget() -> None:
    """Drop everything this session kept (its caller, its key's hash, widget choices)."""
    for name in list(st.session_state):
        del st.session_state[name]


def current_caller() -> Caller:
    """The caller `gate()` let through in this session (`Forbidden` before it ran)."""
    caller = st.session_state.get(CALLER)
    if not isinstance(caller, Caller):
        raise Forbidden("not signed in: the dashboard's gate has not run in this session")
    return caller


def who(caller: Caller) -> str:
    """The caller in a few words, for the sidebar."""
    if caller.how == "local":
        return "local mode: every tenant (no login configured; loopback only)"
    how = "API key" if caller.how == "key" else "identity"
    if caller.tenant is None:
        return f"admin: every tenant ({how})"
    return f"tenant `{caller.tenant}` ({how})"


def sidebar(caller: Caller) -> None:
    """Who is signed in, and the logout."""
    st.sidebar.caption(f"signed in: {who(caller)}" if caller.how != "local" else who(caller))
    if caller.how == "local":
        return
    if caller.how == "identity" and st.user.get("email"):
        st.sidebar.caption(str(st.user.get("email")))
    if st.sidebar.button("Log out", key="logout"):
        _forget()
        if caller.how == "identity":
            st.logout()  # the browser is sent to Streamlit's logout, which drops the cookie
            st.stop()
        st.rerun()

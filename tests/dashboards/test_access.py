"""Who may open the dashboard (dashboards.access): identities mapped to tenants, the [auth]
section read as st.login reads it, and `claw dashboard` refusing a bind beyond loopback with
no login configured, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from claw_pipelines.contracts.access import Caller
from dashboards.access import (
    Doors,
    LoginConfigError,
    UserMap,
    auth_section,
    bind_refusal,
    oidc_providers,
)

SHARED = {"redirect_uri": "http://127.0.0.1:8501/oauth2callback", "cookie_secret": "s" * 32}
PROVIDER = {
    "client_id": "claw",
    "client_secret": "secret",
    "server_metadata_url": "http://127.0.0.1:9/.well-known/openid-configuration",
}


def test_an_identity_is_its_tenants_by_its_verified_email(tmp_path):
    users = tmp_path / "users"
    users.write_text("# who reads what\nAnn@Example.test acme\nops@example.test ops admin\n\n")
    found = UserMap.load(users)
    assert found.caller_for({"email": "ann@example.TEST", "email_verified": True}) == Caller(
        "acme", admin=False, how="identity"
    )
    assert found.caller_for({"email": "ops@example.test"}) == Caller(None, True, "identity")
    assert found.caller_for({"email": "ann@example.test", "email_verified": False}) is None
    assert found.caller_for({"email": "eve@example.test"}) is None
    assert found.caller_for({"sub": "1234"}) is None  # no email claim: no mapping
    assert UserMap.load(None).caller_for({"email": "ann@example.test"}) is None


@pytest.mark.parametrize("line", ["ann@example.test", "ann acme", "a@b.c acme root", "a@b.c x y z"])
def test_a_bad_users_line_is_named_by_file_and_line(tmp_path, line):
    users = tmp_path / "users"
    users.write_text(f"ok@example.test acme\n{line}\n")
    with pytest.raises(LoginConfigError, match=r"users:2: expected 'email tenant \[admin\]'"):
        UserMap.load(users)


def test_the_auth_section_names_its_providers_or_the_field_missing(tmp_path):
    assert oidc_providers({}) == ()
    assert oidc_providers(SHARED | PROVIDER) == ("default",)
    named = SHARED | {"okta": PROVIDER, "entra": PROVIDER}
    assert oidc_providers(named) == ("okta", "entra")
    with pytest.raises(LoginConfigError, match=r"\[auth\]: cookie_secret is missing"):
        oidc_providers({"redirect_uri": "x"} | PROVIDER)
    with pytest.raises(LoginConfigError, match=r"\[auth.okta\]: client_secret is missing"):
        oidc_providers(SHARED | {"okta": {"client_id": "x", "server_metadata_url": "y"}})
    with pytest.raises(LoginConfigError, match=r"\[auth\]: no provider"):
        oidc_providers(SHARED)
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text('[auth]\nredirect_uri = "first"\ncookie_secret = "c"\n')
    second.write_text('[auth]\nredirect_uri = "second"\n')
    assert auth_section([first, second, tmp_path / "missing.toml"]) == {
        "redirect_uri": "second",
        "cookie_secret": "c",
    }
    bad = tmp_path / "bad.toml"
    bad.write_text("[auth\n")
    with pytest.raises(LoginConfigError, match=r"bad\.toml: not valid TOML"):
        auth_section([bad])


def test_only_loopback_may_be_bound_without_a_login():
    assert bind_refusal("127.0.0.1", Doors(keys=False)) is None
    assert bind_refusal("localhost", Doors(keys=False)) is None
    assert bind_refusal("0.0.0.0", Doors(keys=True)) is None
    assert bind_refusal("0.0.0.0", Doors(keys=False, providers=("default",))) is None
    why = bind_refusal("0.0.0.0", Doors(keys=False))
    assert why is not None and why.startswith("refusing to bind 0.0.0.0: no login configured")


def claw_dashboard(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`claw dashboard ARGS` in an empty directory, with no secrets.toml anywhere (HOME too)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CLAW_")}
    clean |= {"HOME": str(tmp_path), **env}
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "dashboard", *args]
    command += ["--lake", str(tmp_path / "lake")]
    return subprocess.run(
        command, cwd=tmp_path, env=clean, capture_output=True, text=True, timeout=60
    )


def test_claw_dashboard_refuses_a_public_bind_without_a_login_in_one_line(tmp_path):
    done = claw_dashboard(tmp_path, "--host", "0.0.0.0")
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(
        "claw: error: refusing to bind 0.0.0.0: no login configured (set CLAW_API_KEYS_FILE"
    )


def test_claw_dashboard_refuses_a_login_that_cannot_work_in_one_line(tmp_path):
    secrets = tmp_path / "secrets.toml"
    secrets.write_text('[auth]\nredirect_uri = "http://127.0.0.1:8501/oauth2callback"\n')
    done = claw_dashboard(tmp_path, "--host", "0.0.0.0", "--secrets", str(secrets))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "claw: error: [auth]: cookie_secret is missing (st.login needs it)"
    ]
    users = tmp_path / "users"
    users.write_text("not-an-email acme\n")
    done = claw_dashboard(tmp_path, CLAW_DASHBOARD_USERS_FILE=str(users))
    assert done.returncode != 0 and "users:1: expected 'email tenant [admin]'" in done.stderr

"""The dashboard's login and tenancy with AppTest on a two-tenant lake (docs/DESIGN.md §3):
nothing of the lake before login, a wrong key refused, a tenant's key or mapped identity sees
only its tenant on every page, an admin every tenant, the logout; local mode as before, on
loopback only."""

from __future__ import annotations

import pytest
from streamlit import config
from streamlit.testing.v1 import AppTest

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.contracts.access import Caller
from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import ShardPlan
from claw_pipelines.lake.specs import load_specs
from claw_pipelines.materialize.live import LiveMaterializer
from tests.support.lakes import (
    ACME_KEY,
    ACME_LINE,
    ADMIN_KEY,
    ADMIN_LINE,
    GLOBEX_KEY,
    TENANTS_KEYS_FILE,
    feedback,
    land,
    tenants_lake,
)
from tests.support.servers import DASHBOARD_APP as APP

PAGES = ["overview", "collection", "representation", "curation", "optimization", "consumption"]
DATASETS = {"acme": "acme-train", "globex": "globex-train"}
SHARED = "everyone"
AUTH = {  # an [auth] section as st.login reads it (no provider is asked in these tests)
    "redirect_uri": "http://127.0.0.1:8501/oauth2callback",
    "cookie_secret": "a-test-cookie-secret-of-some-length",
    "client_id": "claw-dashboard",
    "client_secret": "client-secret",
    "server_metadata_url": "http://127.0.0.1:9/.well-known/openid-configuration",
}


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> Lake:
    """`tenants_lake` (acme and globex, their datasets and a shared one), a label on one step
    of each tenant, and a trainer of each tenant's dataset and of the shared one."""
    lake = tenants_lake(tmp_path_factory.mktemp("dash-tenants"))
    land(
        lake,
        [
            feedback({"step_key": "acme-g0-r0:0"}, "label", "acme-label", tenant="acme"),
            feedback({"step_key": "globex-g0-r0:0"}, "label", "globex-label", tenant="globex"),
        ],
    )
    for name in (*DATASETS.values(), SHARED):
        dataset = Dataset(lake, name, caller=Caller.local())
        next(dataset.batches(1, 4, consumer=f"{name}-trainer"))
    return lake


@pytest.fixture
def keyed(tmp_path, monkeypatch, lake):
    """The dashboard's environment with a keys file (hashes only)."""
    keys = tmp_path / "api-keys"
    keys.write_text(TENANTS_KEYS_FILE)
    monkeypatch.setenv("CLAW_API_KEYS_FILE", str(keys))
    monkeypatch.setenv("CLAW_LAKE_URI", lake.uri)
    monkeypatch.setenv("CLAW_GATEWAY_URL", "http://127.0.0.1:9")  # nothing listens there
    for name in ("CLAW_API_KEY", "CLAW_API_KEYS", "CLAW_DASHBOARD_USERS_FILE"):
        monkeypatch.delenv(name, raising=False)
    return keys


def shown(app: AppTest) -> str:
    """Every text the page shows: titles, text, metrics, options, tables (whole)."""
    parts = []
    for kind in ("title", "subheader", "markdown", "caption", "info", "warning", "error"):
        parts += [str(e.value) for e in getattr(app, kind)]
    parts += [str(e.value) for e in app.success] + [str(e.value) for e in app.code]
    parts += [f"{m.label} {m.value}" for m in app.metric]
    for box in [*app.selectbox, *app.multiselect]:
        parts += [box.label, *map(str, box.options)]
    parts += [frame.value.to_csv() for frame in app.dataframe]
    return "\n".join(parts)


def open_app() -> AppTest:
    app = AppTest.from_file(APP, default_timeout=60)
    app.run()
    return app


def go(app: AppTest, name: str) -> AppTest:
    app.switch_page(f"app_pages/{name}.py")
    app.run()
    assert not app.exception, app.exception
    return app


def log_in_with_key(app: AppTest, key: str) -> AppTest:
    next(t for t in app.text_input if t.label == "API key").set_value(key)
    next(b for b in app.button if b.label == "Log in with key").click()
    app.run()
    return app


def nothing_of_the_lake(app: AppTest, lake: Lake) -> None:
    """The login page: no table, metric or chart, no id, dataset, label or the lake's path."""
    text = shown(app)
    assert [t.value for t in app.title] == ["Log in"]
    assert not app.dataframe and not app.metric and not app.selectbox
    for secret in ("acme", "globex", SHARED, "0.25", "0.75", lake.uri):
        assert secret not in text, secret


@pytest.mark.parametrize("name", PAGES)
def test_before_login_no_page_shows_anything_of_the_lake(name, keyed, lake):
    app = go(open_app(), name)
    nothing_of_the_lake(app, lake)
    assert any(t.label == "API key" for t in app.text_input)
    assert not app.sidebar.button  # no logout: nobody signed in


def test_a_wrong_key_is_refused_with_a_clear_message(keyed, lake):
    app = log_in_with_key(open_app(), "claw-not-a-key")
    assert [e.value for e in app.error] == [
        "invalid API key: it is not one of this dashboard's keys "
        "(CLAW_API_KEYS_FILE / CLAW_API_KEYS)"
    ]
    nothing_of_the_lake(app, lake)
    app = log_in_with_key(open_app(), "  ")
    assert [e.value for e in app.error] == ["enter your API key"]


@pytest.mark.parametrize("tenant", ["acme", "globex"])
def test_a_tenant_key_sees_only_its_tenant_on_every_page(tenant, keyed, lake):
    other = "globex" if tenant == "acme" else "acme"
    app = log_in_with_key(open_app(), ACME_KEY if tenant == "acme" else GLOBEX_KEY)
    assert not app.error
    assert f"tenant `{tenant}` (API key)" in " ".join(c.value for c in app.sidebar.caption)
    for name in PAGES:
        text = shown(go(app, name))
        assert other not in text, (name, text)
        assert SHARED not in text, name  # a shared dataset is an admin's
        assert not app.error, name
    # what it does see is its own: the step browser lists its 8 steps, its dataset is there
    go(app, "representation")
    steps = next(d.value for d in app.dataframe if "trajectory_uid" in d.value.columns)
    assert len(steps) == 8 and set(steps["tenant"]) == {tenant}
    go(app, "consumption")
    assert next(s for s in app.selectbox if s.label == "dataset").options == [DATASETS[tenant]]
    go(app, "overview")
    assert {m.label: m.value for m in app.metric}["silver steps"] == "8"
    assert "Table versions" not in [s.value for s in app.subheader]  # every tenant moves them


def test_two_tenants_sessions_in_one_process_never_share_a_cached_frame(keyed, lake):
    """The caches are the process's: each is keyed by the caller, so globex's session after
    acme's (same page, same table versions) reads its own rows."""
    seen = {}
    for tenant, key in (("acme", ACME_KEY), ("globex", GLOBEX_KEY), ("acme", ACME_KEY)):
        app = go(log_in_with_key(open_app(), key), "representation")
        steps = next(d.value for d in app.dataframe if "trajectory_uid" in d.value.columns)
        seen.setdefault(tenant, []).append(set(steps["tenant"]))
    assert seen == {"acme": [{"acme"}, {"acme"}], "globex": [{"globex"}]}


def test_an_admin_key_sees_every_tenant_and_the_shared_dataset(keyed, lake):
    app = log_in_with_key(open_app(), ADMIN_KEY)
    assert "admin: every tenant (API key)" in " ".join(c.value for c in app.sidebar.caption)
    go(app, "representation")
    steps = next(d.value for d in app.dataframe if "trajectory_uid" in d.value.columns)
    assert set(steps["tenant"]) == {"acme", "globex"}
    go(app, "consumption")
    names = next(s for s in app.selectbox if s.label == "dataset").options
    assert sorted(names) == sorted([*DATASETS.values(), SHARED])
    go(app, "overview")
    silver = lake.read(SILVER_STEPS, columns=["step_key"]).height
    assert {m.label: m.value for m in app.metric}["silver steps"] == str(silver)
    assert "Table versions" in [s.value for s in app.subheader]
    go(app, "collection")
    assert any(t.label.startswith("gateway URLs") for t in app.text_input)


def test_logout_forgets_the_session_and_shows_the_login_again(keyed, lake):
    app = go(log_in_with_key(open_app(), ACME_KEY), "representation")
    assert app.dataframe
    app.sidebar.button(key="logout").click()
    app.run()
    nothing_of_the_lake(app, lake)
    go(app, "consumption")  # another page: still the login
    nothing_of_the_lake(app, lake)


def test_a_revoked_key_signs_its_session_out(keyed, lake):
    app = go(log_in_with_key(open_app(), GLOBEX_KEY), "overview")
    assert app.metric
    keyed.write_text("\n".join([ACME_LINE, ADMIN_LINE]) + "\n")
    from dashboards.login import _key_ring

    _key_ring.clear()  # as 5 s later (the key ring is kept that long)
    app.run()
    nothing_of_the_lake(app, lake)
    assert [e.value for e in app.error] == ["your key is no longer valid: log in again"]


def test_the_curation_preview_and_a_saved_spec_are_the_tenants_own(keyed, lake):
    app = go(log_in_with_key(open_app(), ACME_KEY), "curation")
    assert not app.error
    assert not [s for s in app.selectbox if s.label == "belongs to tenant"]  # no choice
    kept = next(m for m in app.metric if m.label == "steps kept")
    assert kept.value.endswith("/ 8")  # its steps only, not the lake's 16
    starts = next(s for s in app.selectbox if s.label == "start from").options
    assert not {"globex-train", SHARED} & set(starts)
    next(t for t in app.text_input if t.label == "name").set_value("acme-made")
    next(b for b in app.button if b.label == "save spec").click()
    app.run()
    assert any("saved specs/acme-made.yaml" in s.value for s in app.success)
    assert load_specs(lake)["acme-made"].tenant == "acme"
    for taken in ("globex-train", SHARED, "default"):  # another's, or every tenant's
        next(t for t in app.text_input if t.label == "name").set_value(taken)
        next(b for b in app.button if b.label == "save spec").click()
        app.run()
        assert [e.value for e in app.error] == [f"the name {taken!r} is taken: choose another"]
    specs = load_specs(lake)
    assert specs["acme-made"].tenant == "acme"
    assert "globex-train" not in specs and specs["default"].tenant is None  # as they were


def test_the_materializer_shards_are_an_admins_to_see(tmp_path, monkeypatch):
    """A lake split two ways, one shard held: the Collection page shows the shards' table
    (owners, tokens, lag, problems) to an admin; a tenant's key sees neither it nor its
    warnings (a shard spans every tenant's groups)."""
    lake = tenants_lake(tmp_path / "sharded")
    ShardPlan.set(lake, 2)
    follower = LiveMaterializer(lake, slot=Slot(0, 2))
    follower.step()
    keys = tmp_path / "api-keys"
    keys.write_text(TENANTS_KEYS_FILE)
    monkeypatch.setenv("CLAW_API_KEYS_FILE", str(keys))
    monkeypatch.setenv("CLAW_LAKE_URI", lake.uri)
    monkeypatch.setenv("CLAW_GATEWAY_URL", "http://127.0.0.1:9")
    for name in ("CLAW_API_KEY", "CLAW_API_KEYS", "CLAW_DASHBOARD_USERS_FILE"):
        monkeypatch.delenv(name, raising=False)
    try:
        admin = go(log_in_with_key(open_app(), ADMIN_KEY), "collection")
        assert "Materializer shards" in [s.value for s in admin.subheader]
        shards = next(d.value for d in admin.dataframe if "shard" in d.value.columns)
        assert shards["shard"].to_list() == ["0/2", "1/2"]
        assert any("shard 1/2: no follower holds it" in w.value for w in admin.warning)
        for key in (ACME_KEY, GLOBEX_KEY):
            tenant = go(log_in_with_key(open_app(), key), "collection")
            assert "Materializer shards" not in [s.value for s in tenant.subheader]
            assert not any("shard" in d.value.columns for d in tenant.dataframe)
            text = shown(tenant)
            assert "0/2" not in text and "no follower holds it" not in text
    finally:
        follower.close()


def test_local_mode_is_every_tenant_on_loopback_and_nothing_beyond(tmp_path, monkeypatch, lake):
    monkeypatch.setenv("CLAW_LAKE_URI", lake.uri)
    for name in ("CLAW_API_KEYS_FILE", "CLAW_API_KEYS", "CLAW_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    app = go(open_app(), "representation")
    steps = next(d.value for d in app.dataframe if "trajectory_uid" in d.value.columns)
    assert set(steps["tenant"]) == {"acme", "globex"}
    assert "local mode: every tenant" in " ".join(c.value for c in app.sidebar.caption)
    assert not app.sidebar.button  # nothing to log out of

    config.set_option("server.address", "0.0.0.0")  # every interface, with no login
    app = go(open_app(), "representation")
    assert app.error[0].value.startswith("No login is configured, and this server listens")
    assert not app.dataframe and "acme" not in shown(app)


def oidc_app(monkeypatch, tmp_path, lake, user: dict) -> AppTest:
    """The dashboard with an [auth] section, a users file, and `user` as st.user."""
    users = tmp_path / "users"
    users.write_text("ann@example.test acme\nboss@example.test ops admin\n")
    monkeypatch.setenv("CLAW_DASHBOARD_USERS_FILE", str(users))
    monkeypatch.setenv("CLAW_LAKE_URI", lake.uri)
    for name in ("CLAW_API_KEYS_FILE", "CLAW_API_KEYS", "CLAW_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    app = AppTest.from_file(APP, default_timeout=60)
    app.secrets["auth"] = AUTH
    app.user = user
    app.run()
    return app


def test_oidc_before_login_offers_the_provider_and_shows_nothing(tmp_path, monkeypatch, lake):
    app = oidc_app(monkeypatch, tmp_path, lake, {"is_logged_in": False})
    nothing_of_the_lake(app, lake)
    assert [b.label for b in app.button] == ["Log in with your identity provider"]
    assert not app.text_input  # no keys configured: no key form


def test_an_identity_mapped_to_a_tenant_sees_only_that_tenant(tmp_path, monkeypatch, lake):
    user = {"is_logged_in": True, "email": "Ann@Example.test", "email_verified": True}
    app = oidc_app(monkeypatch, tmp_path, lake, user)
    assert "tenant `acme` (identity)" in " ".join(c.value for c in app.sidebar.caption)
    for name in PAGES:
        text = shown(go(app, name))
        assert "globex" not in text and SHARED not in text, name
    tables = [d.value for d in go(app, "representation").dataframe]
    steps = next(t for t in tables if "tenant" in t.columns)
    assert set(steps["tenant"]) == {"acme"}


def test_an_admin_identity_sees_every_tenant(tmp_path, monkeypatch, lake):
    user = {"is_logged_in": True, "email": "boss@example.test"}
    app = go(oidc_app(monkeypatch, tmp_path, lake, user), "consumption")
    names = next(s for s in app.selectbox if s.label == "dataset").options
    assert sorted(names) == sorted([*DATASETS.values(), SHARED])


@pytest.mark.parametrize(
    "user, why",
    [
        ({"is_logged_in": True, "email": "eve@elsewhere.test"}, "has no tenant here"),
        (
            {"is_logged_in": True, "email": "ann@example.test", "email_verified": False},
            "not verified",
        ),
        ({"is_logged_in": True, "sub": "no-email"}, "has no tenant here"),
    ],
)
def test_an_identity_with_no_tenant_sees_nothing_and_is_told(
    user, why, tmp_path, monkeypatch, lake
):
    app = oidc_app(monkeypatch, tmp_path, lake, user)
    nothing_of_the_lake(app, lake)
    (error,) = [e.value for e in app.error]
    assert why in error
    assert [b.label for b in app.button] == ["Log out"]
    for name in PAGES[1:]:
        nothing_of_the_lake(go(app, name), lake)


def test_a_keys_file_broken_since_the_start_shows_why_and_nothing_else(keyed, lake):
    keyed.write_text(ACME_LINE + "\nnot-a-hash acme\n")
    app = go(open_app(), "overview")
    (error,) = [e.value for e in app.error]
    assert error.startswith("The login is misconfigured: ") and "api-keys:2" in error
    nothing_of_the_lake(app, lake)

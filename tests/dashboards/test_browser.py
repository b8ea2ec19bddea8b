"""The dashboard in headless Chromium (Playwright, Debian's `chromium`): every page on an empty
and a filled lake without an exception, a screenshot of each, and the key interactions; the
login (a tenant's key, an admin's, a wrong one; OpenID Connect through a provider on loopback)
on a two-tenant lake, judged by what the page shows and by every message the server sent."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from playwright.sync_api import expect

from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import DEFAULT_SPEC
from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import load_specs
from claw_pipelines.materialize.gold import build_partition, policy_versions
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.simulation.bulk import BulkShape, write_bulk_bronze
from tests.support.browser import PAGES, DashboardProcess, chromium, chromium_path
from tests.support.lakes import ACME_KEY, ADMIN_KEY, TENANTS_KEYS_FILE, feedback, land, tenants_lake
from tests.support.oidc import oidc_provider
from tests.support.servers import REPO

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(chromium_path() is None, reason="needs the chromium binary"),
]
SCREENSHOTS = Path(os.environ.get("CLAW_SCREENSHOTS", REPO / ".ci" / "screenshots"))


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Lake:
    """Simulated GRPO traffic over two policy versions, silver, gold and a consumer."""
    lake = Lake(str(tmp_path_factory.mktemp("browser") / "lake"))
    write_bulk_bronze(lake, 960, BulkShape(groups_per_policy_version=20))
    build_silver(lake)
    for version in policy_versions(lake):
        build_partition(lake, DEFAULT_SPEC, version)
    next(open_dataset("default", lake.uri).batches(0, 8, consumer="trainer-1"))
    return lake


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module (Playwright's sync API runs one at a time)."""
    with chromium() as launched:
        yield launched


@pytest.fixture(scope="module")
def dashboard(browser, filled, tmp_path_factory):
    """`claw dashboard` on the filled lake, and a browser tab on it."""
    process = DashboardProcess(Path(filled.uri), tmp_path_factory.mktemp("logs") / "dash.log")
    process.start()
    try:
        with browser.tab(process.url) as tab:
            yield tab
    finally:
        process.stop()


def test_every_page_explains_an_empty_lake(browser, tmp_path):
    process = DashboardProcess(tmp_path / "empty", tmp_path / "dash.log").start()
    try:
        with browser.tab(process.url) as tab:
            for name in PAGES:
                visit = tab.visit(name)
                tab.screenshot(SCREENSHOTS / f"empty-{name.lower()}.png")
                assert visit.exceptions == 0, name
                help_shown = tab.page.get_by_text("The lake is empty").count()
                assert help_shown or tab.page.get_by_text("not answering").count(), name
    finally:
        process.stop()
    assert not (tmp_path / "empty" / "bronze").exists()  # looking creates nothing


@pytest.mark.parametrize("name", list(PAGES))
def test_every_page_renders_a_filled_lake(dashboard, name):
    visit = dashboard.visit(name)
    dashboard.screenshot(SCREENSHOTS / f"filled-{name.lower()}.png")
    assert visit.exceptions == 0
    assert dashboard.page.locator('[data-testid="stAlertContentError"]').count() == 0


def metric(tab, label: str) -> str:
    """The value shown by the metric called `label`."""
    box = tab.page.locator('[data-testid="stMetric"]', has_text=label).first
    return box.locator('[data-testid="stMetricValue"]').inner_text()


def test_curation_preview_updates_its_counts_and_saves_a_spec(dashboard, filled):
    dashboard.visit("Curation")
    before = metric(dashboard, "steps kept")
    dashboard.page.get_by_label("reward min").fill("0.5")
    dashboard.page.get_by_role("button", name="preview").click()
    dashboard.settle()
    after = metric(dashboard, "steps kept")
    assert after != before
    kept, total = (int(x.replace(",", "")) for x in after.split(" / "))
    assert 0 < kept < total

    dashboard.page.get_by_label("name").fill("browser-made")
    dashboard.page.get_by_role("button", name="save spec").click()
    dashboard.settle()
    assert dashboard.page.get_by_text("saved specs/browser-made.yaml").count() == 1
    assert load_specs(filled)["browser-made"].reward_min == 0.5


def test_representation_opens_the_step_a_filter_finds(dashboard, filled):
    key = filled.read(SILVER_STEPS, columns=["step_key"]).sort("step_key")["step_key"][-1]
    dashboard.visit("Representation")
    dashboard.page.get_by_label("id contains (step, trajectory or group)").fill(key)
    dashboard.page.keyboard.press("Enter")
    dashboard.settle()
    # under load the rerun the Enter starts may begin after settle() looked: wait for it
    expect(dashboard.page.get_by_text("1 of").first).to_be_visible(timeout=60_000)
    dashboard.settle()
    header = dashboard.page.locator('[data-testid="stMarkdownContainer"]', has_text=key)
    assert header.count() >= 1
    assert dashboard.page.get_by_text("Trajectory timeline").count() == 1


def test_consumption_shows_the_policy_version_picked(dashboard, filled):
    versions = open_dataset("default", filled.uri).policy_versions()
    assert len(versions) >= 2
    dashboard.visit("Consumption")
    first = metric(dashboard, "tokens")
    box = dashboard.page.locator('[data-testid="stSelectbox"]', has_text="policy version")
    box.click()
    dashboard.page.get_by_role("option", name=str(versions[-1]), exact=True).click()
    dashboard.settle()
    batch = next(open_dataset("default", filled.uri).batches(versions[-1], 32))
    assert metric(dashboard, "tokens") == f"{batch.num_tokens:,}"
    first_batch = next(open_dataset("default", filled.uri).batches(versions[0], 32))
    assert first == f"{first_batch.num_tokens:,}"


# -- the login, on a two-tenant lake ------------------------------------------------------

# what each tenant's data looks like on the wire: its trajectory ids and its dataset's name
# (every other name of its data starts with the tenant's), and the shared dataset
ACME, GLOBEX, SHARED = ("acme-g0-r0", "acme-train"), ("globex-g0-r0", "globex-train"), "everyone"
# a reward of each tenant no figure of the other could equal by chance, as a float64 is held
# in a table's or a chart's data
ACME_REWARD, GLOBEX_REWARD = 0.613_579_246_8, 0.864_213_579_1
ACME_REWARDS, GLOBEX_REWARDS = (
    (struct.pack("<d", ACME_REWARD),),
    (struct.pack("<d", GLOBEX_REWARD),),
)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> Lake:
    """`tenants_lake` (acme's and globex's steps, rewards and datasets, and a shared one), and
    a reward of each tenant's from its feedback service on the last turn of one trajectory."""
    lake = tenants_lake(tmp_path_factory.mktemp("browser-tenants") / "lake")
    land(
        lake,
        [
            feedback({"step_key": "acme-g0-r0:1"}, "reward", ACME_REWARD, tenant="acme"),
            feedback({"step_key": "globex-g0-r0:1"}, "reward", GLOBEX_REWARD, tenant="globex"),
        ],
    )
    build_silver(lake)
    return lake


@pytest.fixture(scope="module")
def keyed(tenants, tmp_path_factory):
    """`claw dashboard` on the two-tenant lake, with a keys file (acme, globex, an admin)."""
    base = tmp_path_factory.mktemp("keyed")
    keys = base / "api-keys"
    keys.write_text(TENANTS_KEYS_FILE)
    process = DashboardProcess(Path(tenants.uri), base / "dash.log", CLAW_API_KEYS_FILE=str(keys))
    process.start()
    try:
        yield process
    finally:
        process.stop()


def login_page(tab, name: str) -> None:
    """Load page `name` fresh (a new session) and wait for the login page it shows instead."""
    tab.page.goto(f"{tab.base_url}/{PAGES[name]}")
    tab.wait("Log in")


def shows_nothing_of(tab, *marks: str | bytes) -> None:
    """Neither the page nor any message the server sent holds one of `marks`."""
    text = tab.text()
    for mark in marks:
        assert isinstance(mark, bytes) or mark not in text, mark
        assert not tab.was_sent(mark), mark


def test_with_keys_no_page_shows_anything_before_login(browser, keyed, tenants):
    with browser.tab(keyed.url) as tab:
        for name in PAGES:
            login_page(tab, name)
            expect(tab.page.get_by_label("API key", exact=True)).to_have_count(1)
            assert tab.page.locator('[data-testid="stSidebarNav"]').count() == 0
            assert tab.page.locator('[data-testid="stMetric"]').count() == 0
        tab.screenshot(SCREENSHOTS / "login.png")
        everything = ("acme", "globex", SHARED, tenants.uri, *ACME_REWARDS, *GLOBEX_REWARDS)
        shows_nothing_of(tab, *everything)


def test_a_wrong_key_is_refused_with_a_clear_message(browser, keyed, tenants):
    with browser.tab(keyed.url) as tab:
        login_page(tab, "Overview")
        tab.log_in_with_key("claw-" + "x" * 43)
        refused = tab.page.get_by_text("invalid API key: it is not one of this dashboard's keys")
        expect(refused).to_be_visible()
        tab.screenshot(SCREENSHOTS / "login-refused.png")
        assert tab.page.locator("h1").all_inner_texts() == ["Log in"]
        shows_nothing_of(tab, "acme", "globex", SHARED, tenants.uri)


def test_a_tenant_key_shows_its_tenant_and_never_the_others_on_any_page(browser, keyed, tenants):
    with browser.tab(keyed.url) as tab:
        login_page(tab, "Overview")
        tab.log_in_with_key(ACME_KEY)
        tab.wait("Overview")
        expect(tab.page.get_by_text("signed in: tenant")).to_contain_text("acme")
        for name in PAGES:
            visit = tab.open(name)
            assert visit.exceptions == 0, name
            assert tab.page.locator('[data-testid="stAlertContentError"]').count() == 0, name
            if name in ("Representation", "Optimization"):
                tab.page.wait_for_timeout(1500)  # let the tables and charts draw
                tab.screenshot(SCREENSHOTS / f"acme-{name.lower()}.png")
            shows_nothing_of(tab, *GLOBEX, SHARED, *GLOBEX_REWARDS)
        # its own: a step of its trajectories opens, its dataset is the one offered
        tab.open("Representation")
        header = tab.page.locator('[data-testid="stMarkdownContainer"]', has_text="acme-g")
        assert header.count() >= 1
        tab.open("Consumption")
        box = tab.page.locator('[data-testid="stSelectbox"]', has_text="dataset").first
        box.click()
        offered = tab.page.get_by_role("option").all_inner_texts()
        assert offered == ["acme-train"]
        tab.page.keyboard.press("Escape")
        assert all(tab.was_sent(mark) for mark in (*ACME, *ACME_REWARDS))  # its rows did
        assert not tab.was_sent("globex")  # not a byte of the other tenant's, on any page

        tab.page.locator('[data-testid="stSidebar"]').get_by_role("button", name="Log out").click()
        tab.wait("Log in")
        assert tab.page.locator('[data-testid="stSidebarNav"]').count() == 0


def test_an_admin_key_sees_both_tenants_and_the_shared_dataset(browser, keyed, tenants):
    with browser.tab(keyed.url) as tab:
        login_page(tab, "Overview")
        tab.log_in_with_key(ADMIN_KEY)
        tab.wait("Overview")
        for name in ("Representation", "Consumption"):
            tab.open(name)
        box = tab.page.locator('[data-testid="stSelectbox"]', has_text="dataset").first
        box.click()
        offered = tab.page.get_by_role("option").all_inner_texts()
        assert sorted(offered) == ["acme-train", "everyone", "globex-train"]
        tab.page.keyboard.press("Escape")
        assert all(tab.was_sent(mark) for mark in (*ACME, *GLOBEX, *ACME_REWARDS, *GLOBEX_REWARDS))


def test_an_openid_connect_login_through_a_provider_shows_the_identitys_tenant(
    browser, tenants, tmp_path
):
    """st.login against a provider of our own on loopback: discovery, the provider's sign-in
    form, the code exchanged for an RS256 id_token checked against its JWKS, the identity's
    email mapped to its tenant by CLAW_DASHBOARD_USERS_FILE; then the logout."""
    users = tmp_path / "users"
    users.write_text("ann@example.test acme\n")
    secrets = tmp_path / "secrets.toml"
    with oidc_provider() as provider:
        process = DashboardProcess(
            Path(tenants.uri), tmp_path / "dash.log", secrets, CLAW_DASHBOARD_USERS_FILE=str(users)
        )
        secrets.write_text(provider.secrets_toml(f"{process.url}/oauth2callback"))
        process.start()
        try:
            with browser.tab(process.url) as tab:
                for name in PAGES:
                    login_page(tab, name)
                    shows_nothing_of(tab, "acme", "globex", SHARED, tenants.uri)
                tab.screenshot(SCREENSHOTS / "login-oidc.png")

                sign_in(tab, "ann@example.test")
                tab.wait("Overview")
                sidebar = tab.page.locator('[data-testid="stSidebar"]')
                expect(sidebar.get_by_text("signed in: tenant")).to_contain_text("acme")
                assert provider.issued[-1]["email"] == "ann@example.test"
                for name in PAGES:
                    assert tab.open(name).exceptions == 0, name
                    shows_nothing_of(tab, *GLOBEX, SHARED, *GLOBEX_REWARDS)
                tab.page.wait_for_timeout(1500)
                tab.screenshot(SCREENSHOTS / "oidc-consumption.png")
                assert all(tab.was_sent(mark) for mark in ACME)
                assert not tab.was_sent("globex")
                sidebar.get_by_role("button", name="Log out").click()
                tab.wait("Log in")
                assert tab.page.locator('[data-testid="stSidebarNav"]').count() == 0

                tab.received.clear()  # what eve's session is sent, from here on
                sign_in(tab, "eve@example.test")  # signed in, but mapped to no tenant
                tab.wait("Log in")
                expect(tab.page.get_by_text("that identity has no tenant here")).to_be_visible()
                tab.screenshot(SCREENSHOTS / "oidc-no-tenant.png")
                shows_nothing_of(tab, "acme", "globex", SHARED, tenants.uri, *ACME_REWARDS)
        finally:
            process.stop()


def sign_in(tab, email: str) -> None:
    """The login button, then the provider's sign-in form, as `email`."""
    tab.page.get_by_role("button", name="Log in with your identity provider").click()
    tab.page.get_by_label("Email").fill(email)
    tab.page.get_by_role("button", name="Sign in").click()

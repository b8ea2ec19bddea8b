"""The dashboard in headless Chromium (Playwright, Debian's `chromium`): every page on an empty
and a filled lake without an exception, a screenshot of each, and the key interactions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from playwright.sync_api import expect

from claw_pipelines.build.gold import build_partition, policy_versions
from claw_pipelines.build.silver import build_silver
from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import DEFAULT_SPEC
from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import load_specs
from claw_pipelines.simulation.bulk import BulkShape, write_bulk_bronze
from tests.support.browser import PAGES, DashboardProcess, browser, chromium_path
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
def dashboard(filled, tmp_path_factory):
    """`claw dashboard` on the filled lake, and a browser tab on it."""
    process = DashboardProcess(Path(filled.uri), tmp_path_factory.mktemp("logs") / "dash.log")
    process.start()
    try:
        with browser(process.url) as tab:
            yield tab
    finally:
        process.stop()


def test_every_page_explains_an_empty_lake(tmp_path):
    process = DashboardProcess(tmp_path / "empty", tmp_path / "dash.log").start()
    try:
        with browser(process.url) as tab:
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

"""Collection against real gateways: the figures of a keyed gateway writing this lake, read
with the dashboard's key, by name; a gateway of another lake is named and not shown."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from claw_pipelines.contracts.shards import Slot
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import ShardPlan
from claw_pipelines.materialize.live import LiveMaterializer
from tests.support.ingest import post, step
from tests.support.lakes import group_of, land
from tests.support.servers import DASHBOARD_APP as APP
from tests.support.servers import TEST_KEY, GatewayProcess

AUTH = {"Authorization": f"Bearer {TEST_KEY}"}


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """A keyed gateway on lake `ours` (2 steps acknowledged, 1 refused) and one on `theirs`."""
    base = tmp_path_factory.mktemp("collection-live")
    keys = f"{TEST_KEY}=tenant-a"
    with (
        GatewayProcess(base / "ours", CLAW_API_KEYS=keys, CLAW_GATEWAY_ID="gw-ours") as ours,
        GatewayProcess(base / "theirs", CLAW_GATEWAY_ID="gw-theirs") as theirs,
    ):
        steps = {"steps": [step(step_index=0), step(step_index=1)]}
        assert post(ours, "/v1/steps", steps, **AUTH).status_code == 200
        bad = post(ours, "/v1/steps", {"steps": [step(prompt_ids=[])]}, **AUTH)
        assert bad.status_code == 422
        yield ours, theirs


def collection(monkeypatch, lake, urls: str, key: str | None) -> AppTest:
    """The Collection page for `lake`, scraping `urls`."""
    monkeypatch.setenv("CLAW_LAKE_URI", str(lake))
    monkeypatch.setenv("CLAW_GATEWAY_URL", urls)
    if key:
        monkeypatch.setenv("CLAW_GATEWAY_KEY", key)
    app = AppTest.from_file(APP, default_timeout=60)
    app.run()
    app.switch_page("app_pages/collection.py")
    app.run()
    assert not app.exception
    return app


def test_a_keyed_gateway_of_this_lake_shows_its_figures_by_name(gateways, monkeypatch):
    ours, theirs = gateways
    app = collection(monkeypatch, ours.lake, f"{ours.url},{theirs.url}", TEST_KEY)
    shown = {m.label: m.value for m in app.metric}
    assert shown["acknowledged records"] == "2"
    assert shown["rejected requests"] == "1"
    assert shown["flusher"] == "up"
    assert "WAL backlog" in shown
    assert any("gw-ours" in m.value for m in app.markdown)
    reasons = next(d.value for d in app.dataframe if "rejected because" in d.value.columns)
    assert reasons["requests"].sum() == 1
    assert any(theirs.url in c.value and "not this lake" in c.value for c in app.caption)
    assert not any("gw-theirs" in m.value for m in app.markdown)


def test_without_the_key_a_keyed_gateway_is_named_as_not_answering(gateways, monkeypatch):
    ours, _ = gateways
    app = collection(monkeypatch, ours.lake, ours.url, None)
    assert not any(m.label == "acknowledged records" for m in app.metric)
    assert any("not answering" in c.value and "CLAW_GATEWAY_KEY" in c.value for c in app.caption)


def test_a_lake_whose_gateway_has_landed_nothing_yet_renders(gateways, monkeypatch):
    _, theirs = gateways  # its gateway created bronze; no record in it
    app = collection(monkeypatch, theirs.lake, theirs.url, None)
    assert {m.label: m.value for m in app.metric}["acknowledged records"] == "0"
    app.switch_page("app_pages/overview.py")
    assert not app.run().exception


def test_the_materializer_shards_show_with_their_problems(tmp_path, monkeypatch):
    """A lake split two ways: the Collection page lists each shard (owner, token, lag) and
    warns of the one nobody holds."""
    lake = Lake(str(tmp_path / "lake"))
    land(lake, group_of("g", [1, 2], [1.0, 0.0]))
    ShardPlan.set(lake, 2)
    follower = LiveMaterializer(lake, slot=Slot(0, 2))
    follower.step()  # shard 1/2: never followed
    app = collection(monkeypatch, lake.uri, "http://127.0.0.1:9", None)
    shards = next(d.value for d in app.dataframe if "shard" in d.value.columns)
    assert shards["shard"].to_list() == ["0/2", "1/2"]
    assert shards["state"].to_list() == ["held", "free"]
    assert shards["token"].to_list()[0] == 1
    assert any("shard 1/2: no follower holds it" in w.value for w in app.warning)
    follower.close()

"""The Streamlit dashboard with AppTest: every page renders on an empty lake and on a filled
one; the curation page saves a valid spec and refuses an invalid one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
from streamlit.testing.v1 import AppTest

from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import DEFAULT_SPEC, CurationSpec, Readmission
from claw_pipelines.contracts.tables import SILVER_STEP_REWARDS, SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import load_specs, save_spec
from claw_pipelines.materialize.failing import FailingBuild, report_sensor_failures
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.live import LiveMaterializer
from claw_pipelines.materialize.rescore import load_judge, rescore
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import arithmetic_steps, feedback, group_of, land, step
from tests.support.servers import DASHBOARD_APP as APP

PAGES = ["overview", "collection", "representation", "curation", "optimization", "consumption"]


@pytest.fixture(scope="module")
def filled(tmp_path_factory) -> Lake:
    """Bronze, silver, a gold dataset over two policy versions and a consumption record (a
    consumer of `batches`, a live one, and a live one that reused every group once)."""
    lake = Lake(str(tmp_path_factory.mktemp("dash") / "lake"))
    rows = []
    for g in range(4):
        rows += group_of(f"g{g}", [5, g, 6], [1.0, 0.0, 0.5], version=1 + g % 2, turns=2)
    rows.append(feedback({"step_key": "g0-r0:0"}, "label", "helpful"))
    land(lake, rows)
    build_silver(lake)
    for version in (1, 2):
        build_partition(lake, DEFAULT_SPEC, version)
    next(open_dataset("default", lake.uri).batches(1, 8, consumer="trainer-1"))
    live = open_dataset("default", lake.uri)
    batch = live.next_batch(2, consumer="live-trainer", timeout=0)
    assert batch is not None  # the trainer is 0.1 less sure of each token than the behaviour
    trainer = np.where(batch.has_behaviour_log_probs, batch.behaviour_log_probs - 0.1, 0.0)
    live.record_feedback(batch, trainer, loss=0.5, step=1)
    reusing = open_dataset("default", lake.uri)
    for _ in range(2):  # every group, then every group again
        reusing.next_batch(4, consumer="reusing-trainer", max_uses=2, timeout=0)
    return lake


def page(name: str, lake_uri: str, monkeypatch) -> AppTest:
    monkeypatch.setenv("CLAW_LAKE_URI", lake_uri)
    monkeypatch.setenv("CLAW_GATEWAY_URL", "http://127.0.0.1:9")  # nothing listens there
    app = AppTest.from_file(APP, default_timeout=60)
    app.run()
    if name != "overview":
        app.switch_page(f"app_pages/{name}.py")
        app.run()
    return app


@pytest.mark.parametrize("name", PAGES)
def test_every_page_explains_an_empty_lake(name, tmp_path, monkeypatch):
    app = page(name, str(tmp_path / "empty"), monkeypatch)
    assert not app.exception, app.exception
    shown = " ".join(x.value for x in [*app.info, *app.caption, *app.markdown])
    assert "make demo" in shown or "lake is empty" in shown or "not answering" in shown


@pytest.mark.parametrize("name", PAGES)
def test_every_page_renders_a_filled_lake(name, filled, monkeypatch):
    app = page(name, filled.uri, monkeypatch)
    assert not app.exception, app.exception
    assert app.title[0].value == name.capitalize()
    assert not app.error


def test_curation_saves_a_valid_spec_and_refuses_an_invalid_one(filled, monkeypatch):
    app = page("curation", filled.uri, monkeypatch)
    name_box = next(t for t in app.text_input if t.label == "name")
    name_box.set_value("hand-made")
    next(n for n in app.number_input if n.label == "reward min").set_value(0.25)
    next(b for b in app.button if b.label == "save spec").click()
    app.run()
    assert not app.exception and not app.error
    assert any("saved specs/hand-made.yaml" in s.value for s in app.success)
    assert load_specs(filled)["hand-made"].reward_min == 0.25

    next(t for t in app.text_input if t.label == "name").set_value("Bad Name!")
    next(b for b in app.button if b.label == "save spec").click()
    app.run()
    assert any(e.value.startswith("invalid spec: name:") for e in app.error)
    assert "Bad Name!" not in load_specs(filled)


def test_curation_names_a_bad_spec_file_in_one_line_and_keeps_the_others(filled, monkeypatch):
    filled.write_text("specs/broken.yaml", "name: broken\nmax_policy_staleness: two\n")
    try:
        app = page("curation", filled.uri, monkeypatch)
    finally:
        (Path(filled.uri) / "specs" / "broken.yaml").unlink()
    assert not app.exception and not app.error
    (warning,) = [w.value for w in app.warning if "broken" in w.value]
    assert warning.startswith(
        "not built until fixed: specs/broken.yaml: max_policy_staleness: Input should be"
    )
    assert "\n" not in warning
    assert "default" in next(s for s in app.selectbox if s.label == "start from").options


def test_curation_lists_failing_builds_one_line_each_naming_the_spec(tmp_path, monkeypatch):
    """What the live materializer and the Dagster sensors report failing is on the page."""
    lake = Lake(str(tmp_path / "lake"))
    land(lake, group_of("g0", [5, 1, 6], [1.0, 0.0], turns=2))
    save_spec(lake, CurationSpec(name="orphan", readmit=Readmission(dataset="nowhere")))
    live = LiveMaterializer(lake)
    assert "orphan" in live.step().failed
    given_up = FailingBuild(
        "other|3",
        "specs/other.yaml: readmit: a -> b -> a is a cycle",
        5,
        "2026-12-05T10:00:00",
        "gold_partitions_sensor",
        retrying=False,
    )
    report_sensor_failures(lake, "gold_partitions_sensor", [given_up])
    app = page("curation", lake.uri, monkeypatch)
    assert not app.exception, app.exception
    shown = [e.value for e in app.error]
    assert len(shown) == 2 and all("\n" not in line for line in shown)
    (orphan,) = [line for line in shown if line.startswith("failing: orphan: ")]
    assert "specs/orphan.yaml: SpecError: readmit:" in orphan and "live materializer" in orphan
    assert "next try" in orphan
    (other,) = [line for line in shown if line.startswith("failing: other|3: ")]
    assert "given up until its inputs change" in other


def test_collection_shows_the_live_lag_and_consumption_the_consumers(filled, monkeypatch):
    collection = page("collection", filled.uri, monkeypatch)
    assert not collection.exception
    assert any("no live materializer is running" in c.value for c in collection.caption)
    lag = collection.dataframe[-1].value
    assert list(lag["dataset"]) == ["default"] and lag["lag p50 (s)"][0] >= 0
    consumption = page("consumption", filled.uri, monkeypatch)
    assert not consumption.exception
    positions = next(d.value for d in consumption.dataframe if "not_yet_given" in d.value.columns)
    live = positions[positions["consumer"] == "live-trainer"].iloc[0]
    assert live["groups"] == 2 and live["not_yet_given"] == 2  # of four groups
    assert live["deliveries"] == 2
    reusing = positions[positions["consumer"] == "reusing-trainer"].iloc[0]
    assert (reusing["groups"], reusing["deliveries"], reusing["not_yet_given"]) == (4, 8, 0)


def test_consumption_shows_what_trainers_fed_back(filled, monkeypatch):
    app = page("consumption", filled.uri, monkeypatch)
    assert not app.exception, app.exception
    assert "Trainer feedback: behaviour vs trainer log-probs" in [s.value for s in app.subheader]
    tables = [d.value for d in app.dataframe]
    per_version = next(t for t in tables if "batches" in t.columns and "k3" in t.columns)
    assert len(per_version) and set(per_version["policy_version"]) <= {1, 2}
    assert per_version["k1"].tolist() == pytest.approx([0.1] * len(per_version), rel=1e-5)
    assert set(per_version["outside_band"]) == {0.0}  # every ratio exp(-0.1) = 0.905
    worst = next(t for t in tables if "step_key" in t.columns and "k1" in t.columns)
    assert len(worst) == 5 and worst["mean_abs_diff"].tolist() == pytest.approx([0.1] * 5)
    shown = {m.label: m.value for m in app.metric}
    assert shown["ratios outside [0.8, 1.2]"] == "0.0%"


def test_overview_shows_reward_by_policy_version(filled, monkeypatch):
    app = page("overview", filled.uri, monkeypatch)
    assert not app.exception
    assert "Reward by policy version" in [h.value for h in app.subheader]
    shown = next(d.value for d in app.dataframe if "mean_reward" in d.value.columns)
    steps = filled.read(SILVER_STEPS, columns=["step_key", "policy_version"])
    rewards = filled.read(SILVER_STEP_REWARDS, columns=["step_key", "reward", "reward_status"])
    final = steps.join(rewards.filter(pl.col("reward_status") == "final"), on="step_key")
    expected = final.group_by("policy_version").agg(pl.col("reward").mean()).sort("policy_version")
    assert list(shown["policy_version"]) == expected["policy_version"].to_list() == [1, 2]
    assert list(shown["mean_reward"]) == pytest.approx(expected["reward"].to_list())
    assert (
        list(shown["steps"])
        == steps.group_by("policy_version").len().sort("policy_version")["len"].to_list()
    )


def test_representation_shows_judges_side_by_side(tmp_path, monkeypatch):
    lake = Lake(str(tmp_path / "lake"))
    land(lake, arithmetic_steps())
    build_silver(lake)
    for version in ("1", "2"):
        rescore(lake, load_judge("exact-match", version))
    build_silver(lake)
    app = page("representation", lake.uri, monkeypatch)
    app.text_input[0].set_value("math-0:1").run()
    assert not app.exception, app.exception
    assert "Rewards by judge (`claw rescore`)" in [s.value for s in app.subheader]
    tables = [d.value for d in app.dataframe]
    side = next(t for t in tables if "exact-match v1" in t.columns)
    assert list(side.iloc[0]) == [1.0, 1.0]
    agreement = next(t for t in tables if "agreement" in t.columns)
    assert agreement.iloc[0]["agreement"] == 1.0 and agreement.iloc[0]["common_steps"] == 6


def test_representation_shows_a_trajectorys_fragments_and_why_they_started(tmp_path, monkeypatch):
    lake = Lake(str(tmp_path / "lake"))
    head, rows, history = [5, 6], [], [5, 6]
    for turn in range(4):  # the history summarized before turn 2
        history = [*head, 90] if turn == 2 else history
        rows.append(step("cmp", turn, history, [100 + turn]))
        history = [*history, 100 + turn, 200 + turn]
    land(lake, [*rows, *group_of("g", [5, 6], [1.0, 0.0])])
    build_silver(lake)
    app = page("representation", lake.uri, monkeypatch)
    app.text_input[0].set_value("cmp:3").run()
    assert not app.exception, app.exception
    assert "Fragments of this trajectory" in [s.value for s in app.subheader]
    tables = [d.value for d in app.dataframe]
    fragments = next(t for t in tables if "first_step" in t.columns)
    assert fragments["fragment"].tolist() == [0, 1]
    assert fragments["first_step"].tolist() == [0, 2]
    assert fragments["reason"].tolist()[1] == "history_rewritten"
    per = next(t for t in tables if "trajectories" in t.columns)
    assert dict(zip(per["fragments"], per["trajectories"], strict=True)) == {1: 2, 2: 1}


def test_curation_and_optimization_show_what_was_left_out_and_why(filled, monkeypatch):
    optimization = page("optimization", filled.uri, monkeypatch)
    assert not optimization.exception and not optimization.error
    ledger = next(d.value for d in optimization.dataframe if "readmitted_by" in d.value.columns)
    silver_steps = filled.read("silver/steps", columns=["step_key"]).height
    assert ledger["steps"].sum() == silver_steps  # admitted + left out = every step
    assert set(ledger["outcome"]) == {"admitted"}  # the default keeps every complete step

    curation = page("curation", filled.uri, monkeypatch)
    next(c for c in curation.checkbox if c.label == "drop zero-variance groups").check()
    next(n for n in curation.number_input if n.label == "min trajectory return").set_value(0.75)
    next(b for b in curation.button if b.label == "preview").click()
    curation.run()
    assert not curation.exception and not curation.error
    kept = next(m for m in curation.metric if m.label == "steps kept")
    assert kept.value == f"8 / {silver_steps}"  # the return-1.0 trajectories, 2 steps each
    assert any(c.value.startswith("Left out, by the first rule") for c in curation.caption)
    assert "Waste ledger" in [s.value for s in curation.subheader]


def test_collection_shows_each_gateways_token_sources_and_exact_share(tmp_path, monkeypatch):
    lake = Lake(str(tmp_path / "lake"))
    rows = group_of("g", [5, 6], [1.0, 0.0, 1.0])  # white-box steps: the client's ids
    steps = [row for row in rows if row["kind"] == "step"]
    for row, source in zip(steps, ("upstream", "local_unverified"), strict=False):
        row |= {"token_source": source, "gateway_id": "gw-proxy"}  # as a proxy lands them
    land(lake, rows)
    collection = page("collection", lake.uri, monkeypatch)
    assert not collection.exception
    table = next(d.value for d in collection.dataframe if "exact_share" in d.value.columns)
    shares = dict(zip(table["gateway"], table["exact_share"], strict=True))
    assert shares == {"gw-proxy": 0.5, "gw-test": 1.0}
    by_source = table.set_index("gateway").loc["gw-proxy"]
    assert (by_source["upstream"], by_source["local_unverified"]) == (1, 1)


def test_a_diff_between_dataset_versions_reads_the_change_feed_and_equals_a_full_comparison(
    tmp_path,
):
    from claw_pipelines.contracts.tables import gold_dataset_table
    from dashboards import data

    lake = Lake(str(tmp_path / "lake"))
    land(lake, group_of("g0", [5, 6], [1.0, 0.0], version=1, turns=2))
    build_silver(lake)
    build_partition(lake, DEFAULT_SPEC, 1)
    land(
        lake,
        [
            *group_of("g1", [7, 8], [0.5, 1.0], version=1),
            feedback({"step_key": "g0-r0:0"}, "reward", 0.25),
        ],
    )
    build_silver(lake)
    build_partition(lake, DEFAULT_SPEC, 1)  # adds g1, re-scores g0
    table = gold_dataset_table("default")
    at = data.Where(lake.uri, "{}", None, None)
    columns = list(data.DIFF_COLUMNS)
    newest = lake.version(table)
    for old in range(newest):
        before = lake.read(table, old, columns=columns)
        after = lake.read(table, newest, columns=columns)
        both = after.join(before, on="step_key", how="full", coalesce=True, suffix="_before")
        expected = both.filter(
            ~(
                pl.col("policy_version").eq_missing(pl.col("policy_version_before"))
                & pl.col("reward").eq_missing(pl.col("reward_before"))
                & pl.col("advantage").eq_missing(pl.col("advantage_before"))
            )
        )
        diff = data.version_diff(at, "default", old, newest)
        assert diff.sort("step_key").equals(expected.sort("step_key").select(diff.columns)), old
    changed = data.version_diff(at, "default", newest - 1, newest)
    assert set(changed["step_key"]) >= {"g1-r0:0", "g0-r0:0"}  # added; re-scored

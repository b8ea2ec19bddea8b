"""Increments that touch only what changed equal full rebuilds: silver's derived tables and
every dataset's gold rows, trees and rejections, after each round of a scripted run (groups
landing across rounds, late rewards and feedback, idle trajectories expiring, unscoped calls
stitched across increments, an agent compacting its context across increments, policy bumps
past a staleness bound, deadlines, a spec change and a restart of the follower), at two lake
sizes."""

from __future__ import annotations

import shutil
import time

import polars as pl
import pytest

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.consume.delivery import LiveRows
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_LINEAGE,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.definitions import defs
from claw_pipelines.defs.maintenance import maintained_tables
from claw_pipelines.lake import delta as lake_module
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize import live
from claw_pipelines.materialize.gold import build_partition, policy_versions
from claw_pipelines.materialize.live import LiveMaterializer
from claw_pipelines.materialize.silver import build_silver, silver_state
from claw_pipelines.simulation.bulk import BulkShape, write_bulk_bronze
from tests.support.lakes import (
    LIVE,
    feedback,
    group_of,
    land,
)
from tests.support.rounds import COMPACTS_AT, OPTIONS, SPECS, latest_totals, same, script


def landed_rounds(
    lake: Lake,
    rounds: int,
    *,
    bulk: int = 0,
    whole: bool = False,
    pulled: bool = False,
    history=None,
    lose_history: bool = False,
) -> None:
    """Run the script through a follower, restarting it and changing a spec midway; each
    round curates only the groups it touched (a changed spec: all). `pulled`: a trainer
    pulls `live` from the first round on, so every other dataset is brought up beside the
    rounds, by the follower's worker, from its snapshot of the view. `history`: a bounded
    follower's folder (a window of HOT_STEPS: most trajectories leave memory every round
    and are read back from there); `lose_history`: the restart finds it gone (rebuilt)."""
    if bulk:
        write_bulk_bronze(lake, bulk, BulkShape(groups_per_policy_version=200), batch=2_000)
    for spec in SPECS:
        save_spec(lake, spec)
    bounded = {} if history is None else {"history": history, "hot_steps": HOT_STEPS}
    follower = LiveMaterializer(lake, OPTIONS, **bounded)
    follower.step()
    landed = []
    for round_ in range(rounds):
        landed.append(script(round_))
        land(lake, landed[-1])
        if round_ == rounds - 1 and history is not None:  # the first round's records again
            land(lake, landed[0])  # (a replay: dropped by event id, read back from history)
        if round_ == rounds - 1:  # late facts for trajectories of the first round
            land(lake, [feedback({"trajectory_uid": "g0-r2"}, "reward", 0.25)])
            land(lake, [feedback({"step_key": "g0-r0:0"}, "label", "late")])
        if history is not None and round_ == rounds - 2:  # another writer takes it in
            build_silver(lake, OPTIONS)  # (the follower's history catches up from the feed)
        if round_ == rounds // 2:
            follower.close()
            if lose_history:
                shutil.rmtree(history)
            follower = LiveMaterializer(lake, OPTIONS, **bounded)  # a restart: nothing kept
            save_spec(lake, LIVE.model_copy(update={"name": "all", "min_group_size": 2}))
        done = follower.step()
        taken_in_by_another = history is not None and round_ == rounds - 2
        assert (done.silver is not None or taken_in_by_another) and not done.spec_errors
        assert not follower.failing, follower.failing
        if history is not None:  # the window stays bounded; what left it is read back
            view = follower.at_hand.silver
            assert view is not None and view.history is not None
            opened = view.trajectories.frame.filter(pl.col("status") == "open")["trajectory_uid"]
            closed = view.steps.frame.filter(~pl.col("trajectory_uid").is_in(opened.implode()))
            assert closed.height <= HOT_STEPS, closed.height
            assert view.steps_total > view.steps.frame.height or round_ < 2
            assert view.read_back > 0 or whole or round_ < 2 or round_ == rounds // 2
        if pulled and round_ == 0:  # a trainer pulls: the other datasets go aside
            assert Dataset(lake, "live").next_batch(1, consumer="t", timeout=0) is not None
        elif pulled:
            assert [g.dataset for g in done.gold if g.dataset not in done.beside] == ["live"]
            assert done.aside or done.beside  # the others, beside the rounds
        curated = {g.dataset: g.groups_curated for g in done.gold if g.dataset not in done.beside}
        if whole and round_ > 0:  # too many touched to list: all of silver
            assert all(n is None for n in curated.values()), str(curated)
        elif round_ == rounds // 2:  # restarted: the changed spec is rebuilt, the rest resume
            assert curated.get("all", None if pulled else 0) is None
            assert curated["live"] is not None
        elif round_ > 0:  # the groups the round touched, not all of silver
            assert all(n is not None and n <= 12 for n in curated.values()), str(curated)
    while pulled and (done := follower.step()).aside:  # the worker catches up
        time.sleep(0.05)
    if history is not None:  # caught up from the change feed, never rebuilt (a lost one: built)
        view = follower.at_hand.silver
        assert view is not None and view.history is not None
        assert view.history.meta.get("rebuilds", 0) == 0
        assert view.history.meta.get("caught_up", 0) >= 1
    follower.close()


def full_rebuild(lake: Lake, path) -> Lake:
    """A lake with the same bronze, silver and specs rebuilt from nothing."""
    shutil.copytree(f"{lake.uri}/bronze", path / "bronze")
    shutil.copytree(f"{lake.uri}/specs", path / "specs")
    full = Lake(str(path))
    build_silver(full, OPTIONS)
    return full


HOT_STEPS = 8  # a bounded follower's window in the tests: a round lands ~20 steps


@pytest.mark.parametrize(
    ("bulk", "listed", "pulled", "bounded"),
    [
        (0, None, False, None),
        (0, 3, False, None),
        (0, None, True, None),
        (0, None, False, "kept"),
        (0, 3, False, "kept"),  # silver derived whole from the lake, gold curated whole
        (0, None, True, "lost"),
        pytest.param(6_000, None, False, None, marks=pytest.mark.slow),
        pytest.param(6_000, None, False, "kept", marks=pytest.mark.slow),
    ],
)
def test_increments_equal_full_rebuilds_through_late_facts_stitching_specs_and_restarts(
    tmp_path, monkeypatch, bulk, listed, pulled, bounded
):
    if pulled:  # the datasets no trainer pulls from follow every round, beside it
        monkeypatch.setattr(live, "SPECS_EVERY_S", 0.0)
        monkeypatch.setattr(live, "PULLS_EVERY_S", 0.0)
        monkeypatch.setattr(live, "BACKGROUND_S", 0.0)
    if listed is not None:  # more keys than a predicate lists: silver rewritten whole, gold
        # curated whole and its partitions replaced whole
        monkeypatch.setattr(lake_module, "MAX_PREDICATE_KEYS", listed)
    else:  # the follower compacts what it appends to after every round: nothing changes
        monkeypatch.setattr(live, "COMPACT_EVERY_S", 0.0)
    lake = Lake(str(tmp_path / "lake"))
    rounds = 6
    history = None if bounded is None else tmp_path / "follower"
    landed_rounds(
        lake,
        rounds,
        bulk=bulk,
        whole=listed is not None,
        pulled=pulled,
        history=history,
        lose_history=bounded == "lost",
    )
    full = full_rebuild(lake, tmp_path / "full")

    # silver: derived rows recomputed for touched trajectories only equal a whole rebuild
    same(lake.read(SILVER_TRAJECTORIES), full.read(SILVER_TRAJECTORIES), ["trajectory_uid"])
    same(lake.read(SILVER_STEP_REWARDS), full.read(SILVER_STEP_REWARDS), ["step_key"])
    statuses = lake.read(SILVER_TRAJECTORIES, columns=["trajectory_uid", "status"])
    expired = statuses.filter(pl.col("trajectory_uid").str.starts_with("idle-"))
    assert "abandoned" in set(expired["status"])  # the clock ended the old ones
    assert bulk or "open" in set(expired["status"])  # and not the newest
    stitched = lake.read("silver/steps").filter(pl.col("origin_step_key").is_not_null())
    assert stitched["trajectory_uid"].n_unique() == 1 and stitched.height == rounds
    # fragments judged round by round against the view equal those of one run over all
    fragments = ["step_key", "fragment", "fragment_reason"]
    same(
        lake.read(SILVER_STEPS, columns=fragments),
        full.read(SILVER_STEPS, columns=fragments),
        ["step_key"],
    )
    compacting = (
        lake.read(SILVER_STEPS).filter(pl.col("trajectory_uid") == "cmp").sort("step_index")
    )
    assert compacting["fragment"].to_list() == [int(r >= COMPACTS_AT) for r in range(rounds)]
    assert compacting["fragment_reason"].to_list() == [
        "history_rewritten" if r == COMPACTS_AT else None for r in range(rounds)
    ]
    # steps too, the partial joined across two increments included
    same(lake.read(SILVER_STEPS), full.read(SILVER_STEPS), ["step_key"])
    # prompts stored relative to earlier steps (stored ones as increments saw them) read back
    # as one run over everything stores them, and whole (§18)
    assert lake.read(SILVER_STEPS)["prefix_step_key"].drop_nulls().len() > 0
    same(read_steps(lake, SILVER_STEPS), read_steps(full, SILVER_STEPS), ["step_key"])
    joined = lake.read(SILVER_STEPS).filter(pl.col("trajectory_uid") == "p").to_dicts()
    assert [(r["step_key"], r["policy_version_runs"]) for r in joined] == [("p:1", [1, 2])]

    # gold: every dataset equals one built from nothing, partition by partition
    for spec in SPECS:
        for version in policy_versions(full):
            build_partition(full, spec if spec.name != "all" else _changed_all(), version)
    for name in [s.name for s in SPECS]:
        drop = ["landed_at"]
        same(
            lake.read(gold_dataset_table(name)).drop(drop),
            full.read(gold_dataset_table(name)).drop(drop),
            ["step_key"],
        )
        same(
            read_steps(lake, gold_dataset_table(name)).drop(drop),
            read_steps(full, gold_dataset_table(name)).drop(drop),
            ["step_key"],
        )
        same(
            lake.read(gold_tree_table(name)),
            full.read(gold_tree_table(name)),
            ["policy_version", "tree_id", "segment"],
        )
        same(
            lake.read(gold_rejection_table(name)).drop(drop),
            full.read(gold_rejection_table(name)).drop(drop),
            ["step_key"],
        )
        # the newest lineage of each partition counts what a build from nothing counts
        # (the increments keep their stored trees' sizes between rounds: StoredTrees)
        same(latest_totals(lake, name), latest_totals(full, name), ["policy_version"])
    kept = lake.read(gold_dataset_table("fresh"))["policy_version"].unique().to_list()
    assert sorted(kept) == [1, 2] if bulk == 0 else max(kept) - min(kept) <= 1


def _changed_all() -> CurationSpec:
    return LIVE.model_copy(update={"name": "all", "min_group_size": 2})


def test_a_follower_curates_only_the_groups_that_changed(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    write_bulk_bronze(lake, 4_800, BulkShape(groups_per_policy_version=50), batch=1_000)
    save_spec(lake, LIVE)
    follower = LiveMaterializer(lake, OPTIONS)
    follower.step()  # the first round curates everything
    land(lake, group_of("late-group", [1, 2], [1.0, 0.0], version=3))
    done = follower.step()
    (increment,) = [g for g in done.gold if g.dataset == "live"]
    assert increment.added == ["3:late-group"] and not increment.rewritten
    view = follower.at_hand.silver
    assert view is not None and view.touched_since(view.log[-2][0]).len() == 2
    # the round's silver run wrote the derived rows of its two trajectories only
    marker = lake.commit_metadata(SILVER_TRAJECTORIES)
    assert marker["read_mode"] == "changes"
    (last,) = lake.open(SILVER_TRAJECTORIES).history(limit=1)
    assert last["operationMetrics"]["num_added_rows"] == 2


@pytest.mark.parametrize("bound", ["versions", "records"])
def test_a_backlog_is_taken_in_bounded_rounds_that_end_where_one_run_would(
    tmp_path, monkeypatch, bound
):
    """A round takes at most CATCH_UP_VERSIONS bronze versions, and (beyond the first) at
    most CATCH_UP_RECORDS records: large commits (a bulk import) make smaller rounds."""
    if bound == "versions":
        monkeypatch.setattr(live, "CATCH_UP_VERSIONS", 2)
    else:
        monkeypatch.setattr(live, "CATCH_UP_RECORDS", 700)
    lake = Lake(str(tmp_path / "lake"))
    write_bulk_bronze(lake, 2_400, BulkShape(groups_per_policy_version=40), batch=500)
    save_spec(lake, LIVE)
    follower, rounds = LiveMaterializer(lake, OPTIONS), []
    while (done := follower.step()).silver is not None:
        rounds.append(done.silver.bronze_rows)
    assert len(rounds) >= 3 and max(rounds) <= 2 * 520  # two micro-batches a round
    if bound == "records":  # micro-batches of 512 records: one a round (the last two: 640)
        assert max(rounds) <= 700 and len(rounds) >= 6
    assert silver_state(lake).bronze_version == lake.version(BRONZE_EVENTS)
    full = full_rebuild(lake, tmp_path / "full")
    for version in policy_versions(full):
        build_partition(full, LIVE, version)
    same(lake.read(SILVER_TRAJECTORIES), full.read(SILVER_TRAJECTORIES), ["trajectory_uid"])
    same(
        lake.read(gold_dataset_table("live")).drop("landed_at"),
        full.read(gold_dataset_table("live")).drop("landed_at"),
        ["step_key"],
    )


def test_maintenance_compacts_what_increments_append_in_every_layer(tmp_path, monkeypatch):
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    follower = LiveMaterializer(lake, OPTIONS)
    for round_ in range(6):  # a small file per round and table
        land(lake, group_of(f"g{round_}", [round_, 5], [1.0, 0.0], version=1))
        follower.step()
    tables = maintained_tables(lake)
    assert {gold_dataset_table("live"), gold_tree_table("live"), SILVER_STEP_REWARDS} <= set(tables)
    files = {t: len(lake.open(t).file_uris()) for t in tables}
    rows = {t: lake.read(t).height for t in tables}
    monkeypatch.setenv("CLAW_LAKE_URI", lake.uri)
    assert defs.resolve_job_def("maintenance_job").execute_in_process().success
    after = {t: len(lake.open(t).file_uris()) for t in tables}
    assert after[gold_dataset_table("live")] < files[gold_dataset_table("live")]
    assert after[SILVER_STEP_REWARDS] < files[SILVER_STEP_REWARDS]
    assert all(after[t] <= files[t] for t in tables)
    assert {t: lake.read(t).height for t in tables} == rows  # the same rows
    view = follower.at_hand.silver
    land(lake, group_of("after", [9, 9], [1.0, 0.0], version=1))  # increments go on
    done = follower.step()
    assert [g.added for g in done.gold if g.dataset == "live"] == [["1:after"]]
    assert follower.at_hand.silver is view  # compaction moved no data: the view stays
    assert all(g.groups_curated is not None for g in done.gold)
    (last,) = lake.open(SILVER_TRAJECTORIES).history(limit=1)
    assert last["operationMetrics"]["num_added_rows"] == 2  # only the new trajectories


def test_live_delivery_follows_the_dataset_by_its_change_feed(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    follower = LiveMaterializer(lake, OPTIONS)
    dataset, delivered = None, []
    for round_ in range(5):
        rows = group_of(f"g{round_}", [round_, 5], [1.0, 0.0], version=1 + round_ // 3)
        if round_:  # a late reward rewrites the previous group's rows
            rows.append(feedback({"trajectory_uid": f"g{round_ - 1}-r1"}, "reward", 0.5))
        land(lake, rows)
        follower.step()
        dataset = dataset or Dataset(lake, "live")
        batch = dataset.next_batch(1, consumer="trainer", timeout=2.0)
        assert batch is not None
        delivered += batch.groups
        kept = dataset._newest
        assert kept is not None and kept.version == lake.version(gold_dataset_table("live"))
        columns = kept.rows.drop("unit").columns
        read = LiveRows.read(lake, gold_dataset_table("live"), kept.version, columns)
        same(kept.rows, read.rows, ["step_key"])  # what the feed applied = a full read
        same(kept.units, read.units, ["unit"])
    assert delivered == ["1:g0", "1:g1", "1:g2", "2:g3", "2:g4"]


def test_the_follower_compacts_the_small_files_its_rounds_append(tmp_path, monkeypatch):
    monkeypatch.setattr(live, "COMPACT_EVERY_S", 0.0)
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    follower = LiveMaterializer(lake, OPTIONS)
    compacted: dict[str, int] = {}
    for n in range(24):  # one table per round: each is compacted every ~10 rounds
        land(lake, group_of(f"c{n}", [5, n], [1.0, 0.0], version=1, turns=2))
        done = follower.step()
        assert done.gold and all(len(g.added) == 1 for g in done.gold), done.gold
        assert len(done.compacted) <= 1
        compacted |= done.compacted
    assert compacted[SILVER_STEPS] >= 2  # its small files merged
    for table in (SILVER_STEPS, SILVER_TRAJECTORIES, GOLD_LINEAGE, gold_dataset_table("live")):
        assert len(lake.open(table).file_uris()) <= 12, table  # not one per round (24)
    assert Dataset(lake, "live").steps()["step_key"].n_unique() == 24 * 2 * 2  # rows kept

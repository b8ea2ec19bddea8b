"""The follower's history on disk: rows filed by trajectory come back by trajectory, group,
key and time, in the order written; a second follower finds it locked and keeps its own."""

from __future__ import annotations

from datetime import UTC, datetime

import polars as pl

from claw_pipelines.materialize import history as history_module
from claw_pipelines.materialize.history import History, fact_addresses
from claw_pipelines.materialize.live import open_history

T0 = datetime(2026, 12, 1, tzinfo=UTC)


def steps(rows: list[tuple[str, int, str, str | None, int]]) -> pl.DataFrame:
    """View-shaped step rows: (trajectory, index, group, origin key, second)."""
    return pl.DataFrame(
        {
            "step_key": [f"{t}:{i}" for t, i, _, _, _ in rows],
            "trajectory_uid": [t for t, _, _, _, _ in rows],
            "group_key": [g for _, _, g, _, _ in rows],
            "event_id": [f"ev-{t}-{i}" for t, i, _, _, _ in rows],
            "partial_event_ids": [[] for _ in rows],
            "origin_step_key": [o for _, _, _, o, _ in rows],
            "origin_trajectory": [None if o is None else o.rsplit(":", 1)[0] for *_, o, _ in rows],
            "created_at": [T0.replace(second=s) for *_, s in rows],
        },
        schema_overrides={
            "partial_event_ids": pl.List(pl.String),
            "origin_step_key": pl.String,
            "origin_trajectory": pl.String,
        },
    )


def test_rows_come_back_by_trajectory_group_key_and_time(tmp_path, monkeypatch):
    monkeypatch.setattr(history_module, "CHUNK_ROWS", 2)  # several chunks per write
    history = History(tmp_path / "h")
    first = steps([("a", 0, "g1", None, 1), ("b", 0, "g1", None, 2), ("c", 0, "g2", "gw-9:0", 3)])
    facts = pl.DataFrame(
        {"feedback_id": ["f1", "f2"], "step_key": ["a:0", None], "trajectory_uid": [None, "c"]}
    )
    history.write({"steps": first, "facts": facts.with_columns(addresses=fact_addresses(facts))})
    trajectories = pl.DataFrame(
        {
            "trajectory_uid": ["a", "c"],
            "status": ["complete", "open"],
            "last_seen_at": [T0.replace(second=1), T0.replace(second=3)],
        }
    )
    later = steps([("a", 1, "g1", None, 4)])
    history.write({"steps": later, "trajectories": trajectories}, {"versions": {"x": 1}})

    found = history.rows_of(pl.Series(["a"]))
    assert found["steps"]["step_key"].to_list() == ["a:0", "a:1"]  # in the order written
    assert found["facts"]["feedback_id"].to_list() == ["f1"]
    assert history.rows_of(pl.Series(["a"]), upto=1)["steps"].height == 1  # a snapshot's
    assert sorted(history.members(b"g", pl.Series(["g1"]))) == ["a", "b"]
    assert history.members(b"p", pl.Series(["gw-9"])).to_list() == ["c"]
    assert history.owners(b"o", pl.Series(["gw-9:0", "gw-1:0"])).to_list() == ["c"]
    events = pl.Series(["ev-b-0", "ev-z-0"])
    assert history.known(b"e", events).to_list() == ["ev-b-0"]
    assert history.known(b"f", pl.Series(["f2", "f3"])).to_list() == ["f2"]
    since = int(T0.replace(second=3).timestamp() * 1_000_000)
    assert history.stitched_since(since).to_list() == ["c"]
    assert history.stitched_since(since + 1).is_empty()
    assert history.open_trajectories()["trajectory_uid"].to_list() == ["c"]
    assert history.meta["versions"] == {"x": 1} and history.segments == 2

    history.close()  # what a restart opens again
    again = History(tmp_path / "h")
    assert again.rows_of(pl.Series(["c"]))["facts"]["feedback_id"].to_list() == ["f2"]
    assert again.segments == 2


def test_a_second_follower_finds_the_history_locked_and_keeps_its_own(tmp_path):
    first = open_history(tmp_path / "follower")
    second = open_history(tmp_path / "follower")
    assert first.path == tmp_path / "follower"
    assert second.path != first.path and second.path.parent == tmp_path
    second.write({}, {"versions": {}})
    assert first.segments == 0  # the two never share a store

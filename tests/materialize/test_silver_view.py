"""The silver view's keyed frames find the same rows a scan would, through appends, hash
merges and the compaction of superseded generations; a snapshot stays as it was taken."""

from __future__ import annotations

import numpy as np
import polars as pl

from claw_pipelines.materialize import silver_view
from claw_pipelines.materialize.silver_view import Keyed


def test_lookups_match_a_scan_through_appends_merges_and_compaction(monkeypatch):
    monkeypatch.setattr(silver_view, "MERGE_AT", 50)  # merge the hashes in often
    monkeypatch.setattr(silver_view, "COMPACT_AT", 100)  # and drop superseded rows
    rng = np.random.default_rng(3)
    frame = pl.DataFrame({"key": pl.Series([], dtype=pl.String), "group": [], "value": []})
    frame = frame.cast({"group": pl.String, "value": pl.Int64})
    keyed, truth = Keyed(["key"], frame), frame
    snapshots: list[tuple[Keyed, pl.DataFrame]] = []  # (a snapshot, what it held then)
    for round_ in range(60):
        keys = [f"k{k}" for k in rng.integers(0, 400, 30)]  # new keys and newer generations
        rows = pl.DataFrame(
            {
                "key": keys,
                "group": [None if k.endswith("7") else f"g{int(k[1:]) // 10}" for k in keys],
                "value": [round_] * len(keys),
            }
        ).unique("key", keep="last", maintain_order=True)
        keyed.put(rows)
        truth = pl.concat([truth, rows]).unique("key", keep="last", maintain_order=True)
        wanted = pl.Series([f"g{g}" for g in rng.integers(0, 45, 5)] + ["missing", None])
        mine = keyed.rows_where("group", wanted).sort("key")
        expected = truth.filter(pl.col("group").is_in(wanted.drop_nulls().implode())).sort("key")
        assert mine.equals(expected)
        by_key = keyed.rows_where("key", pl.Series(keys[:3]))
        assert by_key.sort("key").equals(truth.filter(pl.col("key").is_in(keys[:3])).sort("key"))
        if round_ % 7 == 0:  # a reader in another thread takes the view as it stands
            snapshots.append((keyed.snapshot(), truth))
    assert keyed.current().sort("key").equals(truth.sort("key"))
    assert keyed.frame.height < 60 * 30  # superseded generations were dropped
    for snapshot, then in snapshots:  # later puts, merges and compactions left them alone
        assert snapshot.current().sort("key").equals(then.sort("key"))
        wanted = pl.Series(["g3", "g17", "g40"])
        expected = then.filter(pl.col("group").is_in(wanted.implode())).sort("key")
        assert snapshot.rows_where("group", wanted).sort("key").equals(expected)

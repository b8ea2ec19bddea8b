"""Chaos (docs/DESIGN.md §19, `simulation.chaos`): shard followers under load, killed at
random with SIGKILL, the lake resharded once (2 -> 3), two trainer ranks pulling all along:
every landed group is delivered exactly once across the ranks, silver holds each key once,
and the sharded lake equals one follower's build of the same bronze."""

from __future__ import annotations

import shutil

import polars as pl
import pytest

from claw_pipelines.contracts.tables import SILVER_STEPS, gold_dataset_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import ShardLeases
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition, policy_versions
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.simulation.chaos import CHAOS_SPEC, Chaos, run_chaos


@pytest.mark.soak  # in `make soak` (CI runs it): ~20 s of kills and a resharding
@pytest.mark.xfail(
    strict=False,
    reason="docs/DESIGN.md §19: failed one run in four (a gold ShapeError after kills) before "
    "a bounded shard's first increment was kept to its share; 10/10 since, kept until it holds "
    "in CI",
)
def test_shards_killed_and_resharded_under_load_deliver_each_group_once(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    result = run_chaos(lake, tmp_path, Chaos())
    figures = result.summary()
    assert figures["acknowledged_groups"] == 36
    lost = [g for g in result.landed if result.counts[g] == 0]
    built = lake.read(gold_dataset_table(CHAOS_SPEC.name), columns=["prompt_uid"])["prompt_uid"]
    assert figures["delivered_once"] == 36, (figures, lost, built.unique().to_list())
    assert figures["lost"] == figures["twice"] == figures["unexpected"] == 0, figures
    assert all(n > 0 for n in figures["per_rank"].values()), figures  # both ranks took some
    assert figures["kills"] == 4 and figures["reshardings"] == 1
    assert "stopped: shard" in result.logs  # the 2-way followers stood down
    assert "lease taken" in result.logs
    assert all(result.exit_codes[f"{i}/3"] == 0 for i in range(3)), result.exit_codes
    leases = ShardLeases(lake, "reader").holders()
    assert leases.filter(pl.col("shard_count") == 3).height == 3
    keys = lake.read(SILVER_STEPS, columns=["step_key", "event_id"])
    assert keys["step_key"].is_unique().all() and keys["event_id"].is_unique().all()

    shutil.copytree(f"{lake.uri}/bronze", tmp_path / "one" / "bronze")
    one = Lake(str(tmp_path / "one"))
    build_silver(one)
    save_spec(one, CHAOS_SPEC)
    for version in policy_versions(one):
        build_partition(one, CHAOS_SPEC, version)
    for table in (SILVER_STEPS, gold_dataset_table(CHAOS_SPEC.name)):
        mine = lake.read(table).drop("landed_at", strict=False).sort("step_key")
        theirs = one.read(table).drop("landed_at", strict=False).sort("step_key")
        assert mine.equals(theirs, null_equal=True), table

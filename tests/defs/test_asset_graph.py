"""A snapshot of the Dagster asset graph: keys, groups, dependencies, partitions, checks.

A change to the graph is a change to what users see in the Dagster UI and what sensors, jobs
and the live materializer select: it has to be made on purpose. Regenerate with
`CLAW_UPDATE_SNAPSHOTS=1 pytest tests/defs/test_asset_graph.py` and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg

from claw_pipelines.contracts.tables import GOLD_RUN_TABLES
from claw_pipelines.definitions import defs
from claw_pipelines.defs.gold import GOLD_SPECS
from dashboards.dagster_graphql import GOLD_ASSETS

SNAPSHOT = Path(__file__).parent / "snapshots" / "asset_graph.json"


def graph_snapshot() -> dict:
    """The asset graph as plain data, sorted."""
    graph = defs.resolve_asset_graph()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        partitions = node.partitions_def
        assets[key.to_user_string()] = {
            "group": node.group_name,
            "deps": sorted(k.to_user_string() for k in node.parent_keys),
            "partitions": None if partitions is None else type(partitions).__name__,
            "partition_dimensions": sorted(
                getattr(d, "name", str(d)) for d in getattr(partitions, "partitions_defs", [])
            ),
            "checks": sorted(
                check.name for check in graph.asset_check_keys if check.asset_key == key
            ),
        }
    return {
        "assets": assets,
        "blocking_checks": sorted(
            f"{spec.asset_key.to_user_string()}:{spec.name}"
            for assets in defs.assets or []
            if isinstance(assets, dg.AssetsDefinition)
            for spec in assets.check_specs
            if spec.blocking
        ),
        "jobs": sorted(j.name for j in defs.resolve_all_job_defs() if not j.name.startswith("__")),
        "sensors": sorted(sensor.name for sensor in defs.sensors or []),
        "schedules": sorted(schedule.name for schedule in defs.schedules or []),
    }


def test_the_asset_graph_matches_its_snapshot():
    current = graph_snapshot()
    if os.environ.get("CLAW_UPDATE_SNAPSHOTS"):
        SNAPSHOT.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    assert current == json.loads(SNAPSHOT.read_text()), (
        "the asset graph changed: review it, then CLAW_UPDATE_SNAPSHOTS=1 to record it"
    )


def test_a_gold_run_launched_over_graphql_selects_the_whole_gold_asset():
    keys = {spec.key.to_user_string() for spec in GOLD_SPECS}
    assert keys == set(GOLD_RUN_TABLES)  # the multi-asset cannot be subset
    assert {"/".join(path) for path in GOLD_ASSETS} == keys

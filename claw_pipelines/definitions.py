"""The Dagster code location: every definition in `claw_pipelines/defs/`, loaded by Dagster's
own loader (`dagster.load_from_defs_folder`, configured by `dg.toml` beside this module);
adding a module there is enough."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from claw_pipelines.defs.gold import DATASETS, POLICY_VERSIONS, all_partition_keys
from claw_pipelines.defs.rebuild import gold_rebuild_job
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.defs.runs import failure_line

__all__ = [
    "DATASETS",
    "POLICY_VERSIONS",
    "ClawLake",
    "all_partition_keys",
    "defs",
    "failure_line",
    "gold_rebuild_job",
]

defs = dg.load_from_defs_folder(path_within_project=Path(__file__).parent)

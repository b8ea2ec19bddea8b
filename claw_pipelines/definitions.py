"""The Dagster code location: every definition in `claw_pipelines/defs/`, loaded automatically.

Each module of the package contributes its module-level assets, checks, jobs, sensors and
schedules, and its `defs` (a `Definitions`, e.g. the resources); adding a module is enough.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import dagster as dg
from dagster._core.definitions.unresolved_asset_job_definition import (
    UnresolvedAssetJobDefinition,
)

import claw_pipelines.defs
from claw_pipelines.defs.gold import DATASETS, POLICY_VERSIONS, all_partition_keys
from claw_pipelines.defs.resources import ClawLake

__all__ = ["DATASETS", "POLICY_VERSIONS", "ClawLake", "all_partition_keys", "defs"]

_KINDS: dict[str, tuple[type, ...]] = {
    "assets": (dg.AssetsDefinition, dg.SourceAsset),
    "jobs": (dg.JobDefinition, UnresolvedAssetJobDefinition),
    "sensors": (dg.SensorDefinition,),
    "schedules": (dg.ScheduleDefinition,),
}


def _modules(package: ModuleType) -> list[ModuleType]:
    names = sorted(m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + "."))
    return [importlib.import_module(name) for name in names]


def load_package_definitions(package: ModuleType) -> dg.Definitions:
    """Merge the definitions found at module level in every module of `package`."""
    found: dict[str, dict[int, object]] = {kind: {} for kind in _KINDS}
    merged = []
    for module in _modules(package):
        for value in vars(module).values():
            if isinstance(value, dg.Definitions):
                merged.append(value)
                continue
            for kind, types in _KINDS.items():
                if isinstance(value, types):
                    found[kind][id(value)] = value
    own = dg.Definitions(**{kind: list(values.values()) for kind, values in found.items()})
    return dg.Definitions.merge(own, *merged)


defs = load_package_definitions(claw_pipelines.defs)

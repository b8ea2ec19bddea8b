"""What a lake holds: whether there is one at all, its gold datasets and whose they are."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from claw_pipelines.contracts.access import Caller
from claw_pipelines.contracts.tables import GOLD_LINEAGE, gold_dataset_table
from claw_pipelines.lake.delta import Lake


def lake_exists(lake: Lake) -> bool:
    """Whether a local lake's directory exists (an object store has no directory to look
    for: a remote lake is taken as there, and a missing table says so instead)."""
    return lake.is_remote or Path(lake.uri).is_dir()


def gold_datasets(lake: Lake, caller: Caller | None = None) -> list[str]:
    """The gold datasets written so far (those lineage records whose table exists), sorted;
    with `caller`, only those it may read."""
    if not lake.exists(GOLD_LINEAGE):
        return []
    names = lake.read(GOLD_LINEAGE, columns=["dataset"])["dataset"].unique().sort()
    names = [name for name in names.to_list() if lake.exists(gold_dataset_table(name))]
    if caller is None or caller.sees_every_tenant:
        return names
    owners = dataset_tenants(lake)
    return [name for name in names if caller.may_read(owners.get(name))]


def owner_of(spec_tenants: set[str | None]) -> str | None:
    """The tenant whose data a dataset holds, from the tenants of the specs that wrote it: one
    tenant when every spec named the same one, else None (shared: every tenant's steps)."""
    return next(iter(spec_tenants)) if len(spec_tenants) == 1 else None


def dataset_tenants(lake: Lake) -> dict[str, str | None]:
    """Each gold dataset's owner (`owner_of` the specs its lineage records), by name."""
    if not lake.exists(GOLD_LINEAGE):
        return {}
    specs = lake.read(GOLD_LINEAGE, columns=["dataset", "spec_hash", "spec_json"]).unique(
        ["dataset", "spec_hash"]
    )
    tenants: dict[str, set[str | None]] = {}
    for name, spec_json in specs.select("dataset", "spec_json").iter_rows():  # one per spec
        tenant = json.loads(spec_json).get("tenant") if spec_json else None
        tenants.setdefault(name, set()).add(tenant)
    return {name: owner_of(found) for name, found in tenants.items()}


def dataset_tenant(lake: Lake, name: str) -> str | None:
    """The tenant a gold dataset belongs to (None: shared, or not written yet)."""
    return dataset_tenants(lake).get(name)


def tenant_filter(caller: Caller) -> pl.Expr | None:
    """The row filter of a table with a `tenant` column for `caller` (None: every row)."""
    return None if caller.sees_every_tenant else pl.col("tenant") == caller.tenant

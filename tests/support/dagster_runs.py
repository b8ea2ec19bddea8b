"""Run the project's Dagster assets for real in tests, on an ephemeral instance."""

from __future__ import annotations

import dagster as dg

from claw_pipelines.definitions import defs
from claw_pipelines.defs.gold import DATASETS, POLICY_VERSIONS


def materialize_gold_partition(
    instance: dg.DagsterInstance, resources: dict, dataset: str, policy_version: int, **options
) -> dg.ExecuteInProcessResult:
    """Materialize the gold group for one (dataset, policy_version) partition, registering
    the dynamic partition keys first."""
    instance.add_dynamic_partitions(DATASETS.name, [dataset])
    instance.add_dynamic_partitions(POLICY_VERSIONS.name, [str(policy_version)])
    key = {"dataset": dataset, "policy_version": str(policy_version)}
    return dg.materialize(
        defs.assets,
        selection=dg.AssetSelection.groups("gold"),
        resources=resources,
        instance=instance,
        partition_key=dg.MultiPartitionKey(key),
        **options,
    )

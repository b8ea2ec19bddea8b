"""Gold assets: per (dataset, policy version) partition, curated steps, prefix trees, lineage."""

import json

import dagster as dg
import polars as pl

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    GOLD_DATASETS_PREFIX,
    GOLD_LINEAGE,
    GOLD_POLICY_VERSIONS,
    GOLD_REJECTIONS_PREFIX,
    GOLD_TREES_PREFIX,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
)
from claw_pipelines.defs.checks import check_result, check_spec
from claw_pipelines.defs.keys import STEP_REWARDS, STEPS, TRAJECTORIES, table_key
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.defs.runs import (
    INPUTS_TAG,
    OP_RETRY_POLICY,
    PARTITION_TAG,
    PRIORITY_TAG,
    SINCE_TAG,
    Retries,
    failed_runs,
    partitions_in_flight,
    plan_retries,
    spec_failure,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import SpecError, load_spec, load_specs, read_specs, spec_path
from claw_pipelines.materialize.failing import report_sensor_failures
from claw_pipelines.materialize.gold import (
    GoldPartition,
    build_partition,
    partition_findings,
    policy_versions,
    spec_sources,
)
from claw_pipelines.materialize.live import materializer_running
from claw_pipelines.materialize.silver import silver_state

# the sensor's name: its failing builds are reported under it (`failing.SENSORS`)
SENSOR = "gold_partitions_sensor"

DATASETS = dg.DynamicPartitionsDefinition(name="gold_datasets")
POLICY_VERSIONS = dg.DynamicPartitionsDefinition(name="policy_versions")
GOLD_PARTITIONS = dg.MultiPartitionsDefinition(
    {"dataset": DATASETS, "policy_version": POLICY_VERSIONS}
)
DATASETS_KEY = table_key(GOLD_DATASETS_PREFIX)
TREES_KEY = table_key(GOLD_TREES_PREFIX)
LINEAGE_KEY = table_key(GOLD_LINEAGE)
REJECTIONS_KEY = table_key(GOLD_REJECTIONS_PREFIX)
SOURCES = [STEPS, STEP_REWARDS, TRAJECTORIES]
MAX_GOLD_RUNS_IN_FLIGHT = 6  # more only as these finish (claw up runs 4 at a time)

# A tuple, not a list: dagster.load_defs takes module-level lists of specs for assets.
GOLD_SPECS = (
    dg.AssetSpec(
        DATASETS_KEY,
        deps=SOURCES,
        group_name="gold",
        partitions_def=GOLD_PARTITIONS,
        description="gold/datasets/<name>: the steps a curation spec keeps, with resolved "
        "reward, status and GRPO advantage; one Delta table per dataset, partitioned by "
        "policy version (a partition write replaces exactly that version).",
    ),
    dg.AssetSpec(
        TREES_KEY,
        deps=[DATASETS_KEY],
        group_name="gold",
        partitions_def=GOLD_PARTITIONS,
        description="gold/trees/<name>: the dataset's steps merged into prefix trees (scope "
        "from the spec): exactly U tokens, every step rebuilt exactly.",
    ),
    dg.AssetSpec(
        REJECTIONS_KEY,
        deps=SOURCES,
        group_name="gold",
        partitions_def=GOLD_PARTITIONS,
        description="gold/rejections/<name>: every silver step the dataset's spec leaves "
        "out, with the reason (stale, reward, label, length, incomplete, deadline, "
        "zero_variance, ...): a view another spec can re-admit (`readmit`), and the waste "
        "ledger's source; rewritten with each partition.",
    ),
    dg.AssetSpec(
        LINEAGE_KEY,
        deps=[DATASETS_KEY, TREES_KEY],
        group_name="gold",
        partitions_def=GOLD_PARTITIONS,
        description="gold/lineage: one row per dataset partition write: spec and hash, silver "
        "and bronze versions read, code version, counts, raw vs tree tokens.",
    ),
)

GOLD_CHECKS = {
    spec.name: spec
    for spec in (
        check_spec(
            "steps_rebuild_from_trees",
            TREES_KEY,
            "Every step rebuilds exactly from its tree.",
            True,
        ),
        check_spec(
            "trees_are_minimal", TREES_KEY, "Trees hold exactly U tokens (no node twice).", True
        ),
        check_spec("steps_in_one_partition", DATASETS_KEY, "No step in two partitions.", True),
        check_spec(
            "groups_are_complete",
            DATASETS_KEY,
            "When the spec requires it, every kept prompt group is complete.",
            True,
        ),
        check_spec(
            "partition_within_staleness",
            DATASETS_KEY,
            "No steps in a partition older than the spec's max_policy_staleness.",
            True,
        ),
    )
}


@dg.multi_asset(
    name="gold",
    specs=GOLD_SPECS,
    check_specs=list(GOLD_CHECKS.values()),
    can_subset=False,
    description="Curate, merge into prefix trees and write one (dataset, policy version).",
)
def gold(context: dg.AssetExecutionContext, claw: ClawLake):
    """Build the partition named by the run's partition key."""
    keys = context.partition_key.keys_by_dimension
    lake = claw.lake()
    try:
        spec = load_spec(lake, keys["dataset"])
        part = build_partition(lake, spec, int(keys["policy_version"]))
    except SpecError as exc:  # this dataset only: one line naming the file and the field
        path = spec_path(keys["dataset"])
        line = str(exc) if str(exc).startswith(path) else f"{path}: {exc}"
        raise spec_failure(line) from None
    for key, metadata in partition_metadata(lake, part).items():
        yield dg.MaterializeResult(asset_key=key, metadata=metadata)
    for name, finding in partition_findings(lake, part).items():
        yield check_result(GOLD_CHECKS[name], finding)


def partition_metadata(lake: Lake, part: GoldPartition) -> dict[dg.AssetKey, dict]:
    """The metadata of each gold asset's materialization for a partition write: the spec,
    counts, tokens, the silver versions read and the Delta version written."""
    summary = {
        "dataset": part.spec.name,
        "spec_hash": part.spec.spec_hash,
        "policy_version": part.policy_version,
        "steps": part.steps.height,
        "raw_tokens": part.raw_tokens,
        "tree_tokens": part.tree_tokens,
        "token_ratio": round(part.tree_tokens / part.raw_tokens, 4) if part.raw_tokens else 1.0,
        "source_versions": dg.MetadataValue.json(part.source_versions),
        "rejected_steps": part.rejected.height,
    }
    versions = {
        DATASETS_KEY: part.dataset_version,
        TREES_KEY: part.trees_version,
        REJECTIONS_KEY: part.rejections_version,
        LINEAGE_KEY: lake.version(GOLD_LINEAGE),
    }
    return {s.key: summary | {"delta_version": versions[s.key] or 0} for s in GOLD_SPECS}


def partition_fingerprints(lake: Lake, specs: dict[str, CurationSpec]) -> dict[str, str]:
    """For each (dataset, policy version) partition of `specs`, a fingerprint of what its
    build reads: the spec hash and the version's steps, rewards and trajectory states (silver
    as of its last completed run). A partition is rebuilt when its fingerprint changes."""
    if not lake.exists(SILVER_STEPS) or not lake.exists(SILVER_STEP_REWARDS):
        return {}
    at = silver_state(lake).versions
    steps = lake.read(
        SILVER_STEPS, at[SILVER_STEPS], columns=["step_key", "trajectory_uid", "policy_version"]
    )
    rewards = lake.read(
        SILVER_STEP_REWARDS,
        at[SILVER_STEP_REWARDS],
        columns=["step_key", "reward", "reward_status"],
    )
    states = lake.read(
        SILVER_TRAJECTORIES, at[SILVER_TRAJECTORIES], columns=["trajectory_uid", "status"]
    )
    per_version = (
        steps.with_columns(pl.col("policy_version").fill_null(0))
        .join(rewards, on="step_key", how="left")
        .join(states, on="trajectory_uid", how="left")
        .sort("step_key")
        .group_by("policy_version")
        .agg(fingerprint=pl.struct(pl.all()).hash().sum())
    )
    published = lake.version(GOLD_POLICY_VERSIONS)  # staleness counts from it
    return {
        dg.MultiPartitionKey({"dataset": name, "policy_version": str(version)}): (
            f"{_specs_hash(lake, spec)}-{fingerprint}-{published}"
        )
        for name, spec in specs.items()
        for version, fingerprint in per_version.iter_rows()
    }


def _specs_hash(lake: Lake, spec: CurationSpec) -> str:
    """The spec's hash, and those of the specs it re-admits from (a broken chain: its
    builds fail, naming the field)."""
    try:
        return "-".join([spec.spec_hash, *spec_sources(lake, spec).values()])
    except SpecError:
        return f"{spec.spec_hash}-unresolved"


gold_job = dg.define_asset_job(
    "gold_job",
    selection=dg.AssetSelection.assets(*(s.key for s in GOLD_SPECS)),
    description="Build gold partitions (one run per dataset and policy version).",
    op_retry_policy=OP_RETRY_POLICY,
)


def _build_order(key: dg.MultiPartitionKey, seen: dict[str, str]) -> tuple[bool, int]:
    """Never-built partitions first (a new spec), then the newest policy versions."""
    return str(key) in seen, -int(key.keys_by_dimension["policy_version"])


@dg.sensor(
    name=SENSOR,
    job=gold_job,
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=15,  # a new spec is built within a minute
    description="Adds a dataset partition for each valid curation spec and a policy-version "
    "partition for each version in silver, and requests a gold run for every partition "
    "whose inputs (spec, steps, rewards, trajectory states) changed, unless a run of that "
    "partition is already queued or running (at most 6 gold runs in flight; new specs "
    "first). An invalid spec file stops only its own dataset. A failed run is asked for "
    "again with backoff (tag claw/retry), then reported as failing until its inputs change. "
    "Idle while a live materializer (claw materialize --follow) keeps gold up to date.",
)
def gold_partitions_sensor(context: dg.SensorEvaluationContext, claw: ClawLake):
    """Keep the gold partitions in step with the specs and silver, one run per partition."""
    lake, retries = claw.lake(), Retries.from_settings(claw.settings())
    if materializer_running(lake):
        return dg.SkipReason("the live materializer (claw materialize --follow) keeps gold up")
    shelf = read_specs(lake)
    for error in shelf.errors.values():
        context.log.warning(f"not building {error}")
    fingerprints = partition_fingerprints(lake, shelf.specs)
    seen = json.loads(context.cursor) if context.cursor else {}
    datasets = sorted({k.keys_by_dimension["dataset"] for k in fingerprints})
    versions = sorted({k.keys_by_dimension["policy_version"] for k in fingerprints}, key=int)
    known_datasets = set(context.instance.get_dynamic_partitions(DATASETS.name))
    known_versions = set(context.instance.get_dynamic_partitions(POLICY_VERSIONS.name))
    busy = partitions_in_flight(context.instance)
    inputs = {str(key): fingerprint for key, fingerprint in fingerprints.items()}
    failed = failed_runs(context.instance, gold_job.name, lambda run: run.tags.get(PARTITION_TAG))
    plan = plan_retries(failed, inputs, retries, SENSOR)
    report_sensor_failures(lake, SENSOR, plan.failing)
    for build in plan.failing:
        context.log.warning(f"failing: {build.line()}")
    changed = [
        key
        for key, fingerprint in fingerprints.items()
        if seen.get(str(key)) != fingerprint and str(key) not in busy
    ]
    chosen = sorted(changed, key=lambda k: _build_order(k, seen))
    room = max(0, MAX_GOLD_RUNS_IN_FLIGHT - len(busy))
    retried = [run for run in plan.due if run.key not in busy][:room]
    chosen = chosen[: room - len(retried)]
    requests = [
        dg.RunRequest(
            run_key=f"{key}|{fingerprints[key]}",
            partition_key=key,
            tags={INPUTS_TAG: fingerprints[key]}
            | ({PRIORITY_TAG: "1"} if str(key) not in seen else {})
            | ({SINCE_TAG: str(failed[str(key)].since)} if str(key) in failed else {}),
        )
        for key in chosen
    ]
    requests += [
        dg.RunRequest(
            run_key=f"{run.key}|{run.inputs}|retry{run.tries}",
            partition_key=dg.MultiPartitionKey(
                dict(zip(("dataset", "policy_version"), run.key.split("|"), strict=True))
            ),
            tags=run.retry_tags(),
        )
        for run in retried
    ]
    # a partition left for later keeps its old fingerprint, so a later tick asks again
    context.update_cursor(json.dumps(seen | {str(k): fingerprints[k] for k in chosen}))
    return dg.SensorResult(
        run_requests=requests,
        dynamic_partitions_requests=[
            DATASETS.build_add_request([d for d in datasets if d not in known_datasets]),
            POLICY_VERSIONS.build_add_request([v for v in versions if v not in known_versions]),
        ],
    )


def all_partition_keys(lake: Lake) -> list[dg.MultiPartitionKey]:
    """Every (dataset, policy version) partition the lake's specs and silver define."""
    return [
        dg.MultiPartitionKey({"dataset": name, "policy_version": str(version)})
        for name in sorted(load_specs(lake))  # valid specs; `read_specs` names the others
        for version in policy_versions(lake)
    ]

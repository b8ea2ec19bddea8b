"""Full rebuilds and backfills of a dataset as one Dagster run split across processes.

`gold_rebuild_job` plans the dataset's policy-version partitions (every one silver holds, or
those asked for), splits them into shares of about equal steps, and maps one op over the
shares: Dagster's multiprocess executor runs the shares in parallel, a process each
(`workers` at a time); on Kubernetes the run is a pod of the K8sRunLauncher, and with
`CLAW_REBUILD_EXECUTOR=k8s` (the chart's values) each share is a Kubernetes Job of its own
(dagster-k8s's `k8s_job_executor`). Each share
builds its partitions with the gold asset's own code (`build_partition`) and reports each as
a materialization of the gold assets' partition, with the same checks, so the asset
history shows the rebuild as it shows a partition run. Partitions of one dataset are written
by separate writers (`claw.gold.v<version>`): two shares' commits to the same tables rebase
over each other (docs/DESIGN.md §19), never build a partition twice.
"""

import dagster as dg
import polars as pl
import pydantic

from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.defs.checks import check_evaluation
from claw_pipelines.defs.gold import (
    DATASETS,
    GOLD_CHECKS,
    POLICY_VERSIONS,
    partition_metadata,
)
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.defs.runs import OP_RETRY_POLICY, spec_failure
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import SpecError, load_spec, spec_path
from claw_pipelines.materialize.gold import Curations, build_partition, partition_findings
from claw_pipelines.settings import ClawSettings

REBUILD_JOB = "gold_rebuild_job"


class RebuildConfig(dg.Config):
    """What to rebuild: a dataset, some of its policy versions (none: every one silver
    holds), split into `shares` shares (the processes that may build at once)."""

    dataset: str
    policy_versions: list[int] = pydantic.Field(default_factory=list)
    shares: int = 2


def steps_per_version(lake: Lake) -> dict[int, int]:
    """How many silver steps each policy version holds (steps without one count as 0)."""
    if not lake.exists(SILVER_STEPS):
        return {}
    counts = (
        lake.read(SILVER_STEPS, columns=["policy_version"])
        .select(pl.col("policy_version").fill_null(0))
        .group_by("policy_version")
        .len()
    )
    return dict(zip(counts["policy_version"].to_list(), counts["len"].to_list(), strict=True))


def split_versions(sizes: dict[int, int], shares: int) -> list[list[int]]:
    """The versions in at most `shares` non-empty shares of about equal steps (the largest
    version first, each to the lightest share), each share in version order."""
    loads = [[0, i, []] for i in range(max(1, shares))]
    for version in sorted(sizes, key=lambda v: (-sizes[v], v)):
        lightest = min(loads)
        lightest[0] += sizes[version]
        lightest[2].append(version)
    return [sorted(share) for _, _, share in sorted(loads, key=lambda s: s[1]) if share]


@dg.op(out=dg.DynamicOut(list), description="Split the dataset's partitions into shares.")
def plan_rebuild(context: dg.OpExecutionContext, config: RebuildConfig, claw: ClawLake):
    """One output a share: the policy versions it builds."""
    lake = claw.lake()
    try:
        load_spec(lake, config.dataset)
    except SpecError as exc:
        path = spec_path(config.dataset)
        raise spec_failure(str(exc) if str(exc).startswith(path) else f"{path}: {exc}") from None
    sizes = steps_per_version(lake)
    asked = config.policy_versions or sorted(sizes)
    missing = [v for v in asked if v not in sizes]
    if missing:
        held = ", ".join(map(str, sorted(sizes))) or "none"
        raise dg.Failure(
            f"silver/steps has policy versions {held}; policy version {missing[0]} does not exist"
        )
    context.instance.add_dynamic_partitions(DATASETS.name, [config.dataset])
    context.instance.add_dynamic_partitions(POLICY_VERSIONS.name, [str(v) for v in asked])
    shares = split_versions({v: sizes[v] for v in asked}, config.shares)
    context.log.info(f"{config.dataset}: {len(asked)} partitions in {len(shares)} shares")
    for index, share in enumerate(shares):
        yield dg.DynamicOutput([config.dataset, *share], mapping_key=f"share_{index}")


@dg.op(
    retry_policy=OP_RETRY_POLICY,
    description="Build a share's partitions, each reported as the gold assets' partition.",
)
def rebuild_share(context: dg.OpExecutionContext, claw: ClawLake, share: list):
    """Build each partition of the share; a failed blocking check fails the share after its
    other partitions are built."""
    lake = claw.lake()
    dataset, versions = share[0], share[1:]
    spec = load_spec(lake, dataset)
    blocked, built, curations = [], [], Curations()
    for version in versions:
        part = build_partition(lake, spec, int(version), curations=curations)
        key = str(dg.MultiPartitionKey({"dataset": dataset, "policy_version": str(version)}))
        for asset, metadata in partition_metadata(lake, part).items():
            yield dg.AssetMaterialization(asset_key=asset, partition=key, metadata=metadata)
        for name, finding in partition_findings(lake, part).items():
            check = GOLD_CHECKS[name]
            yield check_evaluation(check, finding, key)
            if check.blocking and not finding.passed:
                blocked.append(f"blocking check {check.asset_key.to_user_string()}[{key}]:{name}")
        built.append({"policy_version": int(version), "steps": part.steps.height})
    if blocked:
        raise dg.Failure(f"{blocked[0]} failed", metadata={"failed": len(blocked)})
    yield dg.Output(built)


@dg.op(description="The partitions every share built.")
def rebuilt(context: dg.OpExecutionContext, shares: list) -> list:
    """Every share's partitions, in version order."""
    built = sorted((p for share in shares for p in share), key=lambda p: p["policy_version"])
    context.log.info(f"rebuilt {len(built)} partitions, {sum(p['steps'] for p in built)} steps")
    return built


def rebuild_executor(kind: str | None = None) -> dg.ExecutorDefinition:
    """The executor the shares run on (`kind`, or CLAW_REBUILD_EXECUTOR): processes of the
    run's own (multiprocess), or a Kubernetes Job a share (k8s, the `k8s` extra)."""
    kind = kind or ClawSettings().rebuild_executor
    if kind == "multiprocess":
        return dg.multiprocess_executor
    try:
        from dagster_k8s import k8s_job_executor
    except ImportError as exc:
        raise ImportError(
            "CLAW_REBUILD_EXECUTOR=k8s needs dagster-k8s: pip install 'claw-lakehouse[k8s]'"
        ) from exc
    return k8s_job_executor


@dg.job(
    name=REBUILD_JOB,
    executor_def=rebuild_executor(),
    resource_defs={"claw": ClawLake()},
    description="Rebuild a dataset's partitions (all, or some policy versions) in parallel "
    "shares, a process or a Kubernetes Job each (config: dataset, policy_versions, shares; "
    "the executor's max_concurrent bounds how many run at once).",
    tags={"claw/rebuild": "true"},
)
def gold_rebuild_job() -> None:
    """Plan, build the shares in parallel, collect."""
    rebuilt(plan_rebuild().map(rebuild_share).collect())

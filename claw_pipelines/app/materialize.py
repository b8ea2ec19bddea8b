"""`claw materialize`: run the Dagster assets in-process against the configured lake, or,
with `--follow`, keep them up to date continuously.

Unpartitioned assets (silver) run first, in one run; partitioned ones (gold) then run once per
(dataset, policy version) partition that the lake's specs and silver define. `follow` runs
the live materializer (`claw_pipelines.materialize.live`) and reports its increments to Dagster.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from claw_pipelines.settings import ClawSettings

# Failures are reported once, as one line: no Dagster error logs with stack traces.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


@dataclass
class MaterializeReport:
    """What a materialization did: assets written, check outcomes, success."""

    success: bool = True
    assets: dict[str, dict[str, object]] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # why a check failed
    errors: list[str] = field(default_factory=list)  # one line per failure, in order

    @property
    def error(self) -> str | None:
        """Every failure, a line each (None: none)."""
        return "\n".join(self.errors) if self.errors else None

    def add(self, result, partition: str | None = None) -> None:
        """Fold one Dagster run's outcome into the report."""
        suffix = f"[{partition}]" if partition else ""
        for event in result.get_asset_materialization_events():
            materialization = event.materialization
            own = f"[{materialization.partition}]" if materialization.partition else suffix
            self.assets[materialization.asset_key.to_user_string() + own] = {
                k: getattr(v, "value", v) for k, v in materialization.metadata.items()
            }
        blocked = []
        for evaluation in result.get_asset_check_evaluations():
            own = f"[{evaluation.partition}]" if evaluation.partition else suffix
            name = f"{evaluation.asset_key.to_user_string()}{own}:{evaluation.check_name}"
            self.checks[name] = evaluation.passed
            if not evaluation.passed and evaluation.description:
                self.notes[name] = evaluation.description
            if not evaluation.passed and evaluation.blocking:
                blocked.append(f"blocking check {name} failed: {evaluation.description}")
        if not result.success:
            line = blocked[0] if blocked else _failure_line(result)
            if partition and "|" in partition:  # a gold partition: say whose spec it is
                from claw_pipelines.lake.specs import spec_path

                path = spec_path(partition.split("|", 1)[0])
                said = line.removeprefix(f"{path}: ")  # the build may have named it
                line = f"{path} ({partition}): {said}"
            self.fail(line)

    def fail(self, error: str) -> None:
        """Mark the materialization failed, with one more line of why (each once)."""
        self.success = False
        if error not in self.errors:
            self.errors.append(error)


def _failure_line(result) -> str:
    """A failed run's error as one line (see `defs.runs.failure_line`)."""
    from claw_pipelines.definitions import failure_line

    return failure_line(result.all_events)


def _selection(select: Sequence[str] | None):
    import dagster as dg

    if not select:
        return dg.AssetSelection.all()
    chosen = None
    for item in select:
        text = item if ":" in item else f'key:"{item}"'
        part = dg.AssetSelection.from_string(text)
        chosen = part if chosen is None else chosen | part
    return chosen.required_multi_asset_neighbors()


def materialize(
    settings: ClawSettings,
    select: Sequence[str] | None = None,
    datasets: Sequence[str] | None = None,
    policy_versions: Sequence[int] | None = None,
    parallel: int | None = None,
) -> MaterializeReport:
    """Materialize the selected assets (all by default; `silver/*`, `key:...`, `group:...`);
    gold partitions can be narrowed to some datasets and policy versions, a run each. With
    `parallel`, each dataset's partitions are one run of `gold_rebuild_job` instead: that
    many processes building shares of them at once (Dagster's multiprocess executor).

    Uses the Dagster instance of `DAGSTER_HOME` when set (runs show in the UI), else an
    ephemeral one (a temporary one when processes share it).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dagster's own beta/deprecation notices
        import dagster as dg

        from claw_pipelines.definitions import (
            DATASETS,
            POLICY_VERSIONS,
            ClawLake,
            all_partition_keys,
            defs,
        )
        from claw_pipelines.lake.delta import Lake
        from claw_pipelines.lake.specs import read_specs

        graph = defs.resolve_asset_graph()
        chosen = _selection(select).resolve(graph)
        if not chosen:
            assets = ", ".join(sorted(k.to_user_string() for k in graph.materializable_asset_keys))
            raise LookupError(f"no asset matches {' '.join(select or [])!r} (assets: {assets})")
        shelf = read_specs(Lake.from_settings(settings))
        known = sorted(set(shelf.specs) | set(shelf.errors))
        for name in datasets or []:
            if name not in known:
                raise LookupError(
                    f"no dataset {name!r}: its spec does not exist (specs: "
                    f"{', '.join(known)}; `claw spec list` shows them)"
                )
        partitioned = {k for k in chosen if graph.get(k).partitions_def is not None}
        plain = {k for k in chosen - partitioned if graph.get(k).is_materializable}
        instance = (
            dg.DagsterInstance.get()
            if os.environ.get("DAGSTER_HOME")
            else dg.DagsterInstance.ephemeral()
        )
        resources = {"claw": ClawLake(lake_uri=settings.lake_uri)}
        report = MaterializeReport()

        def run(keys, partition_key=None):
            return dg.materialize(
                defs.assets,
                selection=dg.AssetSelection.assets(*keys),
                resources=resources,
                instance=instance,
                partition_key=partition_key,
                run_config=QUIET,
                raise_on_error=False,
            )

        if plain:
            report.add(run(plain))
        if partitioned and report.success:
            lake = Lake.from_settings(settings)
            bad = read_specs(lake).errors  # each fails its own dataset; the others build
            for name, error in sorted(bad.items()):
                if not datasets or name in datasets:
                    report.fail(str(error))
            keys = all_partition_keys(lake)
            missing = _missing_policy_versions(keys, policy_versions)
            if missing:
                report.fail(missing)
            if parallel is not None:
                names = sorted({k.keys_by_dimension["dataset"] for k in keys})
                for name in [n for n in names if not datasets or n in datasets]:
                    rebuild(settings, name, policy_versions, parallel, report)
                return report
            for key in keys:
                dims = key.keys_by_dimension
                if datasets and dims["dataset"] not in datasets:
                    continue
                if policy_versions and int(dims["policy_version"]) not in policy_versions:
                    continue
                instance.add_dynamic_partitions(DATASETS.name, [dims["dataset"]])
                instance.add_dynamic_partitions(POLICY_VERSIONS.name, [dims["policy_version"]])
                report.add(run(partitioned, key), str(key))
    return report


def rebuild(
    settings: ClawSettings,
    dataset: str,
    policy_versions: Sequence[int] | None = None,
    shares: int = 2,
    report: MaterializeReport | None = None,
) -> MaterializeReport:
    """One run of `gold_rebuild_job`: `dataset`'s partitions (or `policy_versions`') in
    `shares` shares, built by as many processes at once; what it did, added to `report`."""
    import tempfile

    import dagster as dg

    from claw_pipelines.definitions import gold_rebuild_job

    config = {
        "ops": {
            "plan_rebuild": {
                "config": {
                    "dataset": dataset,
                    "policy_versions": list(policy_versions or []),
                    "shares": shares,
                }
            }
        },
        "resources": {"claw": {"config": {"lake_uri": settings.lake_uri}}},
        "execution": {"config": {"max_concurrent": shares, "start_method": {"forkserver": {}}}},
        **QUIET,
    }
    report = report if report is not None else MaterializeReport()
    job = dg.reconstructable(gold_rebuild_job)  # its shares run in processes of their own
    with contextlib.ExitStack() as stack:
        if os.environ.get("DAGSTER_HOME"):
            instance = dg.DagsterInstance.get()
        else:  # processes share a run's events through an instance on disk
            home = stack.enter_context(tempfile.TemporaryDirectory(prefix="claw-dagster-"))
            instance = stack.enter_context(dg.DagsterInstance.local_temp(home))
        report.add(stack.enter_context(dg.execute_job(job, instance, run_config=config)))
    return report


def _missing_policy_versions(keys, asked: Sequence[int] | None) -> str | None:
    """Why some asked-for policy versions have no gold partition (None when all have one)."""
    held = sorted({int(key.keys_by_dimension["policy_version"]) for key in keys})
    missing = [version for version in asked or [] if version not in held]
    if not missing:
        return None
    shown = ", ".join(map(str, held)) or "none"
    return f"silver/steps has policy versions {shown}; policy version {missing[0]} does not exist"


def follow(
    settings: ClawSettings,
    poll_s: float = 0.2,
    stop: threading.Event | None = None,
    say: Callable[[str], None] = print,
    datasets: Sequence[str] | None = None,
    shard: str | None = None,
) -> None:
    """`claw materialize --follow`: keep silver and every spec's gold (or `datasets`') up to
    date (see `claw_pipelines.materialize.live`) until `stop` is set. With `shard` ("i/N"):
    shard i of N's share only, under its lease (waiting while another follower holds it);
    a follower whose lease was taken over stops (SystemExit naming the shard). Each
    increment is reported to the Dagster instance of `DAGSTER_HOME` (when set) as runless
    materializations of the same assets, with the versions in their metadata, so the UI's
    asset history shows it."""
    from claw_pipelines.contracts.errors import Fenced
    from claw_pipelines.contracts.shards import Slot
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.lake.leases import LeaseLost
    from claw_pipelines.materialize.live import LiveMaterializer

    stop = stop or threading.Event()
    slot = None if shard is None else Slot.parse(shard)
    lake = Lake.from_settings(settings)
    lake.verify_store()  # a writer: wrong credentials or an unsafe store stop it here, in a line
    live = LiveMaterializer.from_settings(lake, settings, datasets or None, slot)
    report = _dagster_reporter() if os.environ.get("DAGSTER_HOME") else None
    of = "" if slot is None else f" shard {slot}"
    say(f"claw materialize --follow{of}: {lake.uri} (every {poll_s:g} s; Ctrl-C stops)")
    failures, waited = 0, False
    try:
        while not stop.is_set():
            try:
                done = live.step()
            except (LeaseLost, Fenced) as exc:  # another follower owns the shard now
                raise SystemExit(f"claw materialize --follow{of}: stopped: {exc}") from None
            except Exception as exc:  # keep following: the next round starts from the lake
                failures += 1
                say(f"round failed ({type(exc).__name__}: {exc}); retrying")
                stop.wait(min(5.0, 0.5 * failures))
                continue
            failures = 0
            if done.waiting:
                if not waited:
                    say(f"shard {slot}: held by another follower; waiting for its lease")
                waited = True
                stop.wait(max(poll_s, 1.0))
                continue
            if waited:
                say(f"shard {slot}: lease taken (token {live.lease and live.lease.token})")
                waited = False
            for name, error in done.spec_errors.items():
                if name not in live.reported_errors:
                    say(f"not building {error}")
            live.reported_errors = set(done.spec_errors)
            for failing in done.failed.values():
                again = failing.retry_at - time.monotonic()
                tries = f"failure {failing.attempts}; next try in {again:.0f} s"
                say(f"not building {failing.error} ({tries})")
            if done.changed:
                say(_round_line(done))
                if report is not None:
                    report(done)
            else:
                stop.wait(poll_s)
    finally:
        live.close()


def _round_line(done) -> str:
    """One line per round that wrote something."""
    parts = []
    if done.silver is not None and done.silver.bronze_rows:
        run = done.silver
        parts.append(
            f"silver to bronze v{run.bronze_version}: +{run.steps_added} steps"
            f" ({done.silver_seconds:.2f} s)"
        )
    for inc in done.gold:
        if inc.changed:
            counts = f"+{len(inc.added)} ~{len(inc.rewritten)} -{len(inc.removed)}"
            beside = ", beside" if inc.dataset in done.beside else ""
            parts.append(f"{inc.dataset}: {counts} groups ({inc.seconds:.2f} s{beside})")
    for table, files in done.compacted.items():
        parts.append(f"compacted {table}: {files} files ({done.compact_seconds:.2f} s)")
    return f"{done.seconds:.2f} s  " + "; ".join(parts)


def _dagster_reporter() -> Callable:
    """A function reporting a round's writes to the Dagster instance as runless events."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import dagster as dg

        from claw_pipelines.definitions import DATASETS, POLICY_VERSIONS, defs

    instance = dg.DagsterInstance.get()
    keys = defs.resolve_asset_graph().get_all_asset_keys()
    silver_keys = sorted(k for k in keys if k.path[0] == "silver")
    gold_keys = sorted(k for k in keys if k.path[0] == "gold")
    by = {"materialized_by": "claw materialize --follow"}

    def report(done) -> None:
        run = done.silver
        if run is not None and run.bronze_rows:
            summary = {k: v for k, v in run.summary().items() if v is not None}
            for key in silver_keys:
                version = run.versions.get("/".join(key.path))
                metadata = summary | by | {"delta_version": version or 0}
                instance.report_runless_asset_event(
                    dg.AssetMaterialization(asset_key=key, metadata=metadata)
                )
        for inc in done.gold:
            if not inc.changed:
                continue
            versions = [str(v) for v in inc.partitions]
            instance.add_dynamic_partitions(DATASETS.name, [inc.dataset])
            instance.add_dynamic_partitions(POLICY_VERSIONS.name, versions)
            for version, part in inc.partitions.items():
                partition = dg.MultiPartitionKey(
                    {"dataset": inc.dataset, "policy_version": str(version)}
                )
                metadata = by | {
                    "reason": part.reason,
                    "steps": part.lineage.get("steps", 0),
                    "dataset_version": inc.dataset_version or 0,
                    "source_versions": dg.MetadataValue.json(inc.source_versions),
                }
                for key in gold_keys:
                    instance.report_runless_asset_event(
                        dg.AssetMaterialization(
                            asset_key=key, partition=partition, metadata=metadata
                        )
                    )

    return report

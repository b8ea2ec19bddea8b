"""`claw materialize`: run the Dagster assets in-process against the configured lake."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from claw_pipelines.settings import ClawSettings


@dataclass
class MaterializeReport:
    """What a materialization did: assets written, check outcomes, success."""

    success: bool
    assets: dict[str, dict[str, object]] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    error: str | None = None


def _selection(select: Sequence[str] | None):
    import dagster as dg

    if not select:
        return dg.AssetSelection.all()
    chosen = None
    for item in select:
        part = (
            dg.AssetSelection.from_string(item)
            if ":" in item
            else dg.AssetSelection.from_string(f'key:"{item}"')
        )
        chosen = part if chosen is None else chosen | part
    return chosen.required_multi_asset_neighbors()


def materialize(settings: ClawSettings, select: Sequence[str] | None = None) -> MaterializeReport:
    """Materialize the selected assets (all by default; `silver/*`, `key:...`, `group:...`).

    Uses the Dagster instance of `DAGSTER_HOME` when set (runs show in the UI), else an
    ephemeral one.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Dagster's own beta/deprecation notices
        import dagster as dg

        from claw_pipelines.definitions import defs
        from claw_pipelines.defs.resources import ClawLake

        selection = _selection(select)
        if not selection.resolve(defs.resolve_asset_graph()):
            raise LookupError(f"no asset matches {' '.join(select or [])!r}")
        instance = (
            dg.DagsterInstance.get()
            if os.environ.get("DAGSTER_HOME")
            else dg.DagsterInstance.ephemeral()
        )
        result = dg.materialize(
            defs.assets,
            selection=selection,
            resources={"claw": ClawLake(lake_uri=settings.lake_uri)},
            instance=instance,
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
            raise_on_error=False,
        )
    report = MaterializeReport(success=result.success)
    for event in result.get_asset_materialization_events():
        materialization = event.materialization
        report.assets[materialization.asset_key.to_user_string()] = {
            k: getattr(v, "value", v) for k, v in materialization.metadata.items()
        }
    for evaluation in result.get_asset_check_evaluations():
        name = f"{evaluation.asset_key.to_user_string()}:{evaluation.check_name}"
        report.checks[name] = evaluation.passed
    if not result.success:
        failures = [e for e in result.all_events if e.is_step_failure]
        report.error = (
            failures[0].step_failure_data.error.message.strip().splitlines()[0]
            if failures and failures[0].step_failure_data.error
            else "the run failed"
        )
    return report

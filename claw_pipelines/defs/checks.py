"""Asset checks from quality findings: one way to declare them and one way to report them."""

import dagster as dg

from claw_pipelines.ops.integrity import REPAIR_HINT
from claw_pipelines.transforms.quality import Finding


def check_spec(
    name: str, asset: dg.AssetKey, description: str, blocking: bool
) -> dg.AssetCheckSpec:
    """A check declared beside its asset; blocking checks stop downstream assets."""
    return dg.AssetCheckSpec(name, asset=asset, description=description, blocking=blocking)


def check_result(spec: dg.AssetCheckSpec, finding: Finding) -> dg.AssetCheckResult:
    """The Dagster result of a finding (a failed blocking check is an error, else a warning;
    a failed one says how many rows, which, and how to recover)."""
    return dg.AssetCheckResult(
        check_name=spec.name, asset_key=spec.asset_key, **_outcome(spec, finding)
    )


def check_evaluation(
    spec: dg.AssetCheckSpec, finding: Finding, partition: str
) -> dg.AssetCheckEvaluation:
    """A finding as an op reports it for one partition of its asset (as `check_result`)."""
    return dg.AssetCheckEvaluation(
        asset_key=spec.asset_key,
        check_name=spec.name,
        blocking=spec.blocking,
        partition=partition,
        **_outcome(spec, finding),
    )


def _outcome(spec: dg.AssetCheckSpec, finding: Finding) -> dict:
    """Passed, severity, description and metadata of a finding."""
    description = None
    if not finding.passed:
        shown = ", ".join(finding.sample[:3])
        description = f"{finding.failures} of {finding.checked} failed (e.g. {shown})"
        if spec.blocking:
            description += f"; {REPAIR_HINT}"
    return {
        "passed": finding.passed,
        "description": description,
        "severity": dg.AssetCheckSeverity.ERROR if spec.blocking else dg.AssetCheckSeverity.WARN,
        "metadata": {
            "failures": finding.failures,
            "checked": finding.checked,
            "sample": dg.MetadataValue.json(finding.sample),
        },
    }

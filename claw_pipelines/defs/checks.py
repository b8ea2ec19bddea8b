"""Asset checks from quality findings: one way to declare them and one way to report them."""

import dagster as dg

from claw_pipelines.quality import Finding


def check_spec(
    name: str, asset: dg.AssetKey, description: str, blocking: bool
) -> dg.AssetCheckSpec:
    """A check declared beside its asset; blocking checks stop downstream assets."""
    return dg.AssetCheckSpec(name, asset=asset, description=description, blocking=blocking)


def check_result(spec: dg.AssetCheckSpec, finding: Finding) -> dg.AssetCheckResult:
    """The Dagster result of a finding (a failed blocking check is an error, else a warning)."""
    return dg.AssetCheckResult(
        check_name=spec.name,
        asset_key=spec.asset_key,
        passed=finding.passed,
        severity=dg.AssetCheckSeverity.ERROR if spec.blocking else dg.AssetCheckSeverity.WARN,
        metadata={
            "failures": finding.failures,
            "checked": finding.checked,
            "sample": dg.MetadataValue.json(finding.sample),
        },
    )

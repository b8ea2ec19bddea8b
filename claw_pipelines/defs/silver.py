"""Silver assets: one incremental run writes steps, feedback, conflicts, rewards, trajectories."""

import dagster as dg

from claw_pipelines.contracts.tables import TABLES
from claw_pipelines.defs.checks import check_result, check_spec
from claw_pipelines.defs.keys import (
    BRONZE,
    FEEDBACK,
    STEP_CONFLICTS,
    STEP_REWARDS,
    STEPS,
    TRAJECTORIES,
)
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.materialize.silver import SilverOptions, build_silver, silver_findings


def _spec(key: dg.AssetKey, deps: list[dg.AssetKey], notes: str = "") -> dg.AssetSpec:
    description = TABLES["/".join(key.path)].description + (f" {notes}" if notes else "")
    return dg.AssetSpec(key, deps=deps, description=description, group_name="silver")


# A tuple, not a list: dagster.load_defs takes module-level lists of specs for assets.
SILVER_SPECS = (
    _spec(
        STEPS,
        [BRONZE],
        "From white-box steps, proxied completions and Claw-R1 records; unscoped calls are "
        "stitched into trajectories by token prefixes; duplicates dropped, conflicts kept out.",
    ),
    _spec(FEEDBACK, [BRONZE], "Feedback records, trajectory completions, rewards in steps."),
    _spec(STEP_CONFLICTS, [BRONZE]),
    _spec(TRAJECTORIES, [STEPS, FEEDBACK]),
    _spec(STEP_REWARDS, [STEPS, FEEDBACK, TRAJECTORIES], "Latest reward fact wins."),
)  # in dependency order: a multi-asset yields its results topologically


# (check name, asset, blocking): blocking checks stop downstream assets on bad data.
SILVER_CHECKS = {
    "step_keys_are_unique": check_spec(
        "step_keys_are_unique", STEPS, "Every step_key appears once.", True
    ),
    "lengths_are_consistent": check_spec(
        "lengths_are_consistent",
        STEPS,
        "Log-probs and masks have one entry per response token.",
        True,
    ),
    "turns_nest": check_spec(
        "turns_nest",
        STEPS,
        "Each turn's prompt starts with its previous turn's prompt + response, unless the "
        "agent rewrote or truncated its history (a new fragment); a failure reveals "
        "retokenization drift (fragment_reason reply_retokenized) and names the steps.",
        False,
    ),
    "steps_have_no_conflicts": check_spec(
        "steps_have_no_conflicts",
        STEPS,
        "No step arrived under a taken step_key with other tokens.",
        False,
    ),
    "token_ids_are_exact": check_spec(
        "token_ids_are_exact",
        STEPS,
        "Every step's ids are what the model saw and sampled (from the server, the client, or "
        "computed and confirmed by the server's counts); a failure names the steps labelled "
        "local_unverified, which the built-in specs leave out.",
        False,
    ),
    "rewards_are_finite": check_spec(
        "rewards_are_finite", FEEDBACK, "Rewards and ratings are finite.", True
    ),
    "feedback_targets_exist": check_spec(
        "feedback_targets_exist",
        FEEDBACK,
        "Every fact addresses a known step or trajectory.",
        False,
    ),
}


class SilverRunConfig(dg.Config):
    """Which bronze version to read up to (-1: the newest)."""

    bronze_version: int = -1


@dg.multi_asset(
    name="silver",
    specs=SILVER_SPECS,
    check_specs=list(SILVER_CHECKS.values()),
    can_subset=False,
    description="Bring silver up to a bronze version, reading only what bronze gained.",
)
def silver(context: dg.AssetExecutionContext, config: SilverRunConfig, claw: ClawLake):
    """Read the bronze change feed, build the new silver rows, append; yield checks."""
    lake = claw.lake()
    options = SilverOptions.from_settings(claw.settings())
    version = None if config.bronze_version < 0 else config.bronze_version
    run = build_silver(lake, options, bronze_version=version)
    context.log.info(f"silver run: {run.summary()}")
    summary = {k: v for k, v in run.summary().items() if v is not None}
    rows = {
        STEPS: run.steps_added,
        FEEDBACK: run.feedback_added,
        STEP_CONFLICTS: run.conflicts_added,
        TRAJECTORIES: run.trajectories,
        STEP_REWARDS: run.steps_total,
    }
    for spec in SILVER_SPECS:
        table = "/".join(spec.key.path)
        yield dg.MaterializeResult(
            asset_key=spec.key,
            metadata={
                **summary,
                "rows_written": rows[spec.key],
                "delta_version": run.versions.get(table) or 0,
            },
            data_version=dg.DataVersion(str(run.versions.get(table))),
        )
    for name, finding in silver_findings(lake, run).items():
        yield check_result(SILVER_CHECKS[name], finding)

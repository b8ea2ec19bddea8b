"""Silver trajectories: steps grouped with status, returns and policy versions spanned.

Status: the latest completion fact decides (`complete` or `abandoned`); otherwise a step
marked `is_last` completes it; otherwise a trajectory idle for longer than the idle timeout
(measured against the newest record in silver, so reruns agree) is `abandoned`; else `open`.
"""

from __future__ import annotations

import polars as pl

from claw_pipelines.transforms.feedback import FACT_ORDER, step_aliases


def trajectory_statuses(
    steps: pl.DataFrame, facts: pl.DataFrame, clock_us: int, idle_us: int
) -> pl.DataFrame:
    """One row per trajectory with steps (silver/trajectories without the return)."""
    _, trajectory_alias = step_aliases(steps)
    ends = (
        facts.filter(pl.col("kind") == "completion")
        .join(trajectory_alias, left_on="trajectory_uid", right_on="alias")
        .drop("trajectory_uid")
        .rename({"trajectory_uid_right": "trajectory_uid"})
        .sort(FACT_ORDER)
        .group_by("trajectory_uid", "tenant")
        .agg(ended=pl.col("value_text").last())
    )
    grouped = (
        steps.sort("trajectory_uid", "step_index")
        .group_by("trajectory_uid", maintain_order=True)
        .agg(
            prompt_uid=pl.col("prompt_uid").drop_nulls().first(),
            tenant=pl.col("tenant").first(),
            num_steps=pl.len().cast(pl.Int64),
            step_keys=pl.col("step_key"),
            min_policy_version=pl.col("policy_version").min(),
            max_policy_version=pl.col("policy_version").max(),
            first_seen_at=pl.col("created_at").min(),
            last_seen_at=pl.col("created_at").max(),
            any_last=pl.col("is_last").fill_null(False).any(),
        )
    )
    idle = pl.col("last_seen_at").dt.epoch("us") < clock_us - idle_us
    return (
        grouped.join(ends, on=["trajectory_uid", "tenant"], how="left")
        .with_columns(
            status=pl.when(pl.col("ended").is_not_null())
            .then(pl.col("ended"))
            .when(pl.col("any_last"))
            .then(pl.lit("complete"))
            .when(idle)
            .then(pl.lit("abandoned"))
            .otherwise(pl.lit("open"))
        )
        .drop("ended", "any_last")
    )


def with_returns(statuses: pl.DataFrame, rewards: pl.DataFrame) -> pl.DataFrame:
    """Add `resolved_return`: the sum of the trajectory's resolved step rewards (null if none)."""
    returns = (
        rewards.filter(pl.col("reward").is_not_null())
        .group_by("trajectory_uid")
        .agg(resolved_return=pl.col("reward").sort().sum())  # sorted: order-free float sum
    )
    return statuses.join(returns, on="trajectory_uid", how="left")

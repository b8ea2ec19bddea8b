"""Gold steps in other systems' column names and shapes (pure: frames in, frames out)."""

from __future__ import annotations

import polars as pl


def verl_frame(steps: pl.DataFrame) -> pl.DataFrame:
    """Gold steps in verl's column names and shapes (`claw export --format verl-parquet`
    writes them; its module doc lists the columns)."""
    ones = pl.col("response_ids").list.eval(pl.element() * 0 + 1).cast(pl.List(pl.Int8))
    zeros = pl.col("response_ids").list.eval(pl.element() * 0.0).cast(pl.List(pl.Float32))
    last_reward = pl.col("reward").fill_null(0.0).cast(pl.Float32)
    return steps.select(
        uid=pl.coalesce("prompt_uid", "trajectory_uid"),
        prompts="prompt_ids",
        responses="response_ids",
        response_mask=pl.coalesce(pl.col("response_mask"), ones),
        old_log_probs="rollout_log_probs",
        token_level_rewards=pl.when(pl.col("response_ids").list.len() > 0)
        .then(
            pl.concat_list(
                zeros.list.head(pl.col("response_ids").list.len() - 1),
                last_reward,
            )
        )
        .otherwise(zeros),
        reward="reward",
        reward_status="reward_status",
        advantage="advantage",
        step_key="step_key",
        trajectory_uid="trajectory_uid",
        step_index="step_index",
        policy_version="policy_version",
    )

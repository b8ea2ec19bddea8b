"""Judges' reward facts side by side: each judge version's latest reward per step, and how
often two judge versions agree on the steps both scored."""

from __future__ import annotations

import polars as pl

from claw_pipelines.transforms.feedback import FACT_ORDER

AGREE_WITHIN = 1e-9  # two rewards this close are the same verdict


def judge_rewards(facts: pl.DataFrame) -> pl.DataFrame:
    """One row per (step, judge, version): its latest reward (`silver/feedback` facts of
    judges; other facts are ignored)."""
    return (
        facts.filter(
            (pl.col("kind") == "reward")
            & pl.col("judge").is_not_null()
            & pl.col("step_key").is_not_null()
        )
        .sort(FACT_ORDER)
        .group_by("step_key", "judge", "judge_version", maintain_order=True)
        .agg(reward=pl.col("value_number").last())
        .with_columns(judge_label=pl.col("judge") + " v" + pl.col("judge_version"))
    )


def judge_agreement(facts: pl.DataFrame) -> pl.DataFrame:
    """Per pair of judge versions: the steps both scored and the share they agree on."""
    rewards = judge_rewards(facts).select("step_key", "judge_label", "reward")
    pairs = rewards.join(rewards, on="step_key", suffix="_b").filter(
        pl.col("judge_label") < pl.col("judge_label_b")
    )
    schema = {"judge_a": pl.String, "judge_b": pl.String, "common_steps": pl.UInt32}
    if pairs.is_empty():
        return pl.DataFrame(schema=schema | {"agreement": pl.Float64})
    return (
        pairs.group_by(judge_a="judge_label", judge_b="judge_label_b")
        .agg(
            common_steps=pl.len(),
            agreement=((pl.col("reward") - pl.col("reward_b")).abs() <= AGREE_WITHIN).mean(),
        )
        .sort("judge_a", "judge_b")
    )

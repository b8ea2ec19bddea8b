"""Reward and feedback facts, and how they resolve to a reward per step.

Facts are append-only; nothing is updated. Resolution rules (also in the README):
- a fact addresses a step (`step_key`) or a trajectory (`trajectory_uid`) of its own tenant;
  keys the gateway gave unscoped calls before stitching are followed to the stitched step;
- per step, the latest reward fact addressed to it wins (by `created_at`, then arrival,
  then id); a trajectory reward addresses its last step, or every step when so configured;
  a versioned judge's rewards (`judge` set) never resolve by this rule: a curation spec that
  names the judge (`reward_judge`) resolves from its facts instead (`judge_rewards`);
- ratings (latest wins, count kept), labels (the set) and corrections (count) addressed to a
  step or to its trajectory are carried as quality signals;
- `reward_status`: `final` when a reward resolved, else `pending` while the trajectory is
  open, else `missing`.
"""

from __future__ import annotations

from typing import Literal

import polars as pl

RewardTarget = Literal["last", "every"]
FACT_ORDER = ["created_at", "received_at", "feedback_id"]
_UTC_US = pl.Datetime("us", "UTC")


def _json(path: str) -> pl.Expr:
    return pl.col("payload").str.json_path_match(path)


def _timestamp(path: str) -> pl.Expr:
    parsed = _json(path).str.to_datetime(time_unit="us", time_zone="UTC", strict=False)
    return parsed.fill_null(pl.col("received_at"))


def _facts(frame: pl.DataFrame, **columns: pl.Expr) -> pl.DataFrame:
    base = {
        "step_key": pl.lit(None, pl.String),
        "trajectory_uid": pl.lit(None, pl.String),
        "value_number": pl.lit(None, pl.Float64),
        "value_text": pl.lit(None, pl.String),
        "value_json": pl.lit(None, pl.String),
        "annotator": pl.lit(None, pl.String),
        "judge": pl.lit(None, pl.String),
        "judge_version": pl.lit(None, pl.String),
        "metadata": pl.lit(None, pl.String),
        "created_at": pl.col("received_at"),
        "origin_kind": pl.col("kind"),
    }
    base.update(columns)
    return frame.select(
        "feedback_id",
        *(expr.alias(name) for name, expr in base.items()),
        "tenant",
        pl.col("received_at").cast(_UTC_US),
        "event_id",
    )


def bronze_facts(bronze: pl.DataFrame) -> pl.DataFrame:
    """Facts from `feedback` and `trajectory_complete` records (one per distinct event_id)."""
    records = bronze.filter(pl.col("kind").is_in(["feedback", "trajectory_complete"])).unique(
        "event_id", keep="first", maintain_order=True
    )
    feedback = records.filter(pl.col("kind") == "feedback").with_columns(
        feedback_id=pl.col("event_id"), fact_kind=_json("$.kind"), value=_json("$.value")
    )
    is_object = pl.col("value").str.starts_with("{")
    textual = pl.col("fact_kind").is_in(["label", "comment"]) | (
        (pl.col("fact_kind") == "correction") & ~is_object
    )
    from_feedback = _facts(
        feedback,
        step_key=_json("$.target.step_key"),
        trajectory_uid=_json("$.target.trajectory_uid"),
        kind=pl.col("fact_kind"),
        value_number=pl.when(pl.col("fact_kind").is_in(["reward", "rating"])).then(
            pl.col("value").cast(pl.Float64, strict=False)
        ),
        value_text=pl.when(textual).then(pl.col("value")),
        value_json=pl.when(is_object).then(pl.col("value")),
        source=_json("$.source"),
        annotator=_json("$.annotator"),
        judge=_json("$.judge"),
        judge_version=_json("$.judge_version"),
        metadata=_json("$.metadata"),
        created_at=_timestamp("$.created_at"),
    )
    completions = records.filter(pl.col("kind") == "trajectory_complete").with_columns(
        feedback_id=pl.col("event_id"), reward=_json("$.reward").cast(pl.Float64, strict=False)
    )
    common = {
        "trajectory_uid": _json("$.trajectory_uid"),
        "source": pl.lit("trajectory_complete"),
        "metadata": _json("$.metadata"),
    }
    ends = _facts(completions, kind=pl.lit("completion"), value_text=_json("$.status"), **common)
    rewards = _facts(
        completions.filter(pl.col("reward").is_not_null()).with_columns(
            feedback_id=pl.col("event_id") + ":reward"
        ),
        kind=pl.lit("reward"),
        value_number=pl.col("reward"),
        **common,
    )
    return pl.concat([from_feedback, ends, rewards], how="vertical_relaxed")


def step_reward_facts(steps: pl.DataFrame) -> pl.DataFrame:
    """Rewards submitted inside steps, as facts addressed to those steps."""
    with_reward = steps.filter(pl.col("reward").is_not_null()).with_columns(
        feedback_id=pl.col("event_id") + ":reward", received_at=pl.col("created_at")
    )
    return _facts(
        with_reward,
        step_key=pl.col("step_key"),
        trajectory_uid=pl.col("trajectory_uid"),
        kind=pl.lit("reward"),
        value_number=pl.col("reward"),
        source=pl.lit("step"),
    )


def step_aliases(steps: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(step alias → step_key, trajectory alias → trajectory_uid), identities included."""
    origin = steps.filter(pl.col("origin_step_key").is_not_null())
    step_alias = pl.concat(
        [
            steps.select(alias="step_key", step_key="step_key"),
            origin.select(alias="origin_step_key", step_key="step_key"),
        ]
    ).unique("alias", keep="first")
    trajectory_alias = pl.concat(
        [
            steps.select(alias="trajectory_uid", trajectory_uid="trajectory_uid"),
            origin.select(
                alias=pl.col("origin_step_key").str.replace(r":[0-9]+$", ""),
                trajectory_uid="trajectory_uid",
            ),
        ]
    ).unique("alias", keep="first")
    return step_alias, trajectory_alias


def addressed_facts(
    steps: pl.DataFrame, facts: pl.DataFrame, reward_to: RewardTarget = "last"
) -> pl.DataFrame:
    """One row per (fact, step it applies to), of the same tenant; `target` says how."""
    step_alias, trajectory_alias = step_aliases(steps)
    keyed = steps.select("step_key", "trajectory_uid", "step_index", "tenant")
    to_step = (
        facts.filter(pl.col("step_key").is_not_null())
        .drop("trajectory_uid")
        .join(step_alias.rename({"alias": "step_key", "step_key": "resolved"}), on="step_key")
        .drop("step_key")
        .rename({"resolved": "step_key"})
        .join(keyed, on=["step_key", "tenant"])
        .with_columns(target=pl.lit("step"))
    )
    on_trajectory = (
        facts.filter(pl.col("step_key").is_null() & pl.col("trajectory_uid").is_not_null())
        .drop("step_key")
        .join(
            trajectory_alias.rename({"alias": "trajectory_uid", "trajectory_uid": "resolved"}),
            on="trajectory_uid",
        )
        .drop("trajectory_uid")
        .rename({"resolved": "trajectory_uid"})
    )
    last = keyed.filter(pl.col("step_index") == pl.col("step_index").max().over("trajectory_uid"))
    every_step = on_trajectory.filter(
        (pl.col("kind") != "reward") | pl.lit(reward_to == "every")
    ).join(keyed, on=["trajectory_uid", "tenant"])
    last_step = on_trajectory.filter(
        (pl.col("kind") == "reward") & pl.lit(reward_to == "last")
    ).join(last, on=["trajectory_uid", "tenant"])
    return pl.concat(
        [to_step, pl.concat([every_step, last_step]).with_columns(target=pl.lit("trajectory"))],
        how="diagonal_relaxed",
    )


def resolve_rewards(
    steps: pl.DataFrame,
    facts: pl.DataFrame,
    statuses: pl.DataFrame,
    reward_to: RewardTarget = "last",
) -> pl.DataFrame:
    """Each step's resolved reward, status and quality signals (rules in the module doc).

    `steps`: step_key, trajectory_uid, step_index, tenant, origin_step_key.
    `statuses`: trajectory_uid, status.
    """
    applied = addressed_facts(steps, facts, reward_to).sort(FACT_ORDER)
    by_rule = pl.col("judge").is_null() if "judge" in applied.columns else pl.lit(True)
    rewards = (
        applied.filter((pl.col("kind") == "reward") & by_rule)
        .group_by("step_key", maintain_order=True)
        .agg(
            reward=pl.col("value_number").last(),
            reward_source=pl.col("source").last(),
            reward_feedback_id=pl.col("feedback_id").last(),
            reward_target=pl.col("target").last(),
            num_reward_facts=pl.len().cast(pl.Int64),
        )
    )
    ratings = (
        applied.filter(pl.col("kind") == "rating")
        .group_by("step_key")
        .agg(rating=pl.col("value_number").last(), num_ratings=pl.len().cast(pl.Int64))
    )
    labels = (
        applied.filter(pl.col("kind") == "label")
        .group_by("step_key")
        .agg(labels=pl.col("value_text").unique().sort())
    )
    corrections = (
        applied.filter(pl.col("kind") == "correction")
        .group_by("step_key")
        .agg(num_corrections=pl.len().cast(pl.Int64))
    )
    when = [c for c in ("created_at",) if c in steps.columns]  # lets writes prune by time
    resolved = steps.select("step_key", "trajectory_uid", "step_index", *when)
    for part in (rewards, ratings, labels, corrections):
        resolved = resolved.join(part, on="step_key", how="left")
    open_now = statuses.select("trajectory_uid", is_open=pl.col("status") == "open")
    return (
        resolved.join(open_now, on="trajectory_uid", how="left")
        .with_columns(
            reward_status=pl.when(pl.col("reward").is_not_null())
            .then(pl.lit("final"))
            .when(pl.col("is_open").fill_null(True))
            .then(pl.lit("pending"))
            .otherwise(pl.lit("missing")),
            num_reward_facts=pl.col("num_reward_facts").fill_null(0),
            num_ratings=pl.col("num_ratings").fill_null(0),
            num_corrections=pl.col("num_corrections").fill_null(0),
            labels=pl.col("labels").fill_null([]),
        )
        .drop("is_open")
    )


def unresolved_targets(steps: pl.DataFrame, facts: pl.DataFrame) -> pl.DataFrame:
    """Facts whose step or trajectory does not exist (for this tenant)."""
    step_alias, trajectory_alias = step_aliases(steps)
    owners = steps.select("step_key", "trajectory_uid", "tenant")
    step_ok = step_alias.join(owners.select("step_key", "tenant"), on="step_key").select(
        "alias", "tenant"
    )
    trajectory_ok = trajectory_alias.join(
        owners.select("trajectory_uid", "tenant").unique(), on="trajectory_uid"
    ).select("alias", "tenant")
    by_step = facts.filter(pl.col("step_key").is_not_null()).join(
        step_ok, left_on=["step_key", "tenant"], right_on=["alias", "tenant"], how="anti"
    )
    by_trajectory = facts.filter(
        pl.col("step_key").is_null() & pl.col("trajectory_uid").is_not_null()
    ).join(
        trajectory_ok,
        left_on=["trajectory_uid", "tenant"],
        right_on=["alias", "tenant"],
        how="anti",
    )
    return pl.concat([by_step, by_trajectory])


def reward_by_policy_version(steps: pl.DataFrame) -> pl.DataFrame:
    """Per policy version, oldest first: its steps, those whose reward is final (`rewarded`)
    and their mean, lowest and highest reward. `steps`: `policy_version`, `reward` and
    `reward_status` per step (silver's steps with their resolved rewards); steps of no
    version are left out."""
    final = pl.col("reward").filter(pl.col("reward_status") == "final")
    return (
        steps.drop_nulls("policy_version")
        .group_by("policy_version")
        .agg(
            steps=pl.len().cast(pl.Int64),
            rewarded=final.len().cast(pl.Int64),
            mean_reward=final.mean(),
            min_reward=final.min(),
            max_reward=final.max(),
        )
        .sort("policy_version")
    )

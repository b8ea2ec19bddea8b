"""Curation: which silver steps a spec keeps, and their GRPO advantages (docs/DESIGN.md §6).

Works on the small columns only (no token ids): the gold build fetches tokens for the rows
kept. Rules:
- step filters: reward status and range, labels, rating, token source, behaviour log-probs,
  finish reason,
  prompt/response length, trajectory status, sources, tenants, policy versions (explicit, or
  within `max_policy_staleness` of the newest version in silver);
- group filters, on the prompt group (its `prompt_uid`, else the trajectory alone), judged on
  all of the group's trajectories in silver: all complete, at least N trajectories (waiting
  rules: a group that fails them waits, unless `group_deadline_s` after its first step has
  passed, when it is released as it stands or skipped; `admission` says which), returns
  not all equal;
- `advantage = grpo`: every step of a trajectory gets (R - mean) / (std + eps), R its
  trajectory's resolved return, mean and std (sample std; 0 for one trajectory) over the
  group's trajectories; null unless every trajectory of the group is complete with a return.
Steps without a policy version belong to version 0.
- partial rollouts: an aborted generation in silver is one nothing continued yet (a
  continuation absorbs it, `transforms.partials`): it waits (`incomplete`) while its
  trajectory is open and is left out (`aborted`) once the trajectory ended.
- retries: when a client sends the same call again (the same prompt, right after the
  call it repeats, which nothing continued), the earlier call's steps are retry orphans:
  `superseded_by` names the retry's first step, and specs drop them unless `keep_superseded`.
"""

from __future__ import annotations

from datetime import datetime

import polars as pl

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.transforms.judges import judge_rewards
from claw_pipelines.transforms.partials import is_aborted, oldest_version, with_runs

GROUP = "group_key"
# the silver/steps columns `candidates` reads (small ones: no token ids)
CANDIDATE_STEP_COLUMNS = [
    "step_key",
    "trajectory_uid",
    "step_index",
    "prompt_uid",
    "policy_version",
    "token_source",
    "has_log_probs",
    "tokenizer",
    "finish_reason",
    "tenant",
    "source_kind",
    "prompt_len",
    "response_len",
    "prompt_id",
    "metadata",
    "fragment",
    "fragment_reason",
    "policy_version_runs",  # a joined partial rollout's versions (transforms.partials)
    "policy_run_lengths",
]


# what `superseded_by` and `generation_ms` need of a step's metadata, drawn out once
CALL_COLUMNS = ["choice_index", "generation_given", "upstream_ms", "call"]


def with_call_columns(steps: pl.DataFrame) -> pl.DataFrame:
    """Steps with the CALL_COLUMNS drawn from their `metadata` (which is dropped)."""
    if "metadata" not in steps.columns:
        return steps
    meta = pl.col("metadata").str.json_path_match
    drawn = [
        meta("$.choice_index").cast(pl.Int64, strict=False).alias("choice_index"),
        meta("$.generation_ms").cast(pl.Float64, strict=False).alias("generation_given"),
        meta("$.upstream_ms").cast(pl.Float64, strict=False).alias("upstream_ms"),
        meta("$.response_id").alias("call"),
    ]
    # only metadata with something in it is parsed ("{}" and null draw nulls)
    filled = steps["metadata"].str.len_bytes().fill_null(0) > 2
    if filled.all():
        return steps.with_columns(drawn).drop("metadata")
    values = steps.filter(filled).select(drawn)
    nulls = pl.DataFrame(
        {c: pl.repeat(None, steps.height, dtype=t, eager=True) for c, t in values.schema.items()}
    )
    where = filled.arg_true()
    columns = [nulls[c].scatter(where, values[c]) for c in values.columns]
    return steps.with_columns(columns).drop("metadata")


def superseded_by(steps: pl.DataFrame) -> pl.Series:
    """Per step (in `steps` order): the step_key of the retry that supersedes it, or null.

    A trajectory's steps, in index order, form calls: a call starts at each step whose
    `metadata.choice_index` is 0 or absent (the choices of one call with `n` > 1 follow
    it). A call whose next call in the trajectory has the same prompt (`prompt_id`) was
    retried before anything continued it: each of its steps is superseded by that next
    call's first step. (Unscoped calls never share a trajectory with their retry.)"""
    steps = with_call_columns(steps)
    # a retry repeats a prompt within its trajectory: only such trajectories are ordered
    pair = pl.struct("trajectory_uid", "prompt_id")
    repeats = steps.filter(pl.col("prompt_id").is_not_null() & pair.is_duplicated())
    inside = steps["trajectory_uid"].is_in(repeats["trajectory_uid"].unique().implode())
    marked = pl.repeat(None, steps.height, dtype=pl.String, eager=True)
    if repeats.height:
        marked = marked.scatter(inside.arg_true(), _superseded_within(steps.filter(inside)))
    return marked.alias("superseded_by")


def _superseded_within(steps: pl.DataFrame) -> pl.Series:
    """`superseded_by` over steps with their call columns, whole trajectories only."""
    trajectory, prompt, key = pl.col("trajectory_uid"), pl.col("prompt_id"), pl.col("step_key")
    frame = (
        steps.select("step_key", "trajectory_uid", "step_index", "prompt_id")
        .with_columns(
            row=pl.int_range(pl.len(), dtype=pl.UInt32),
            starts=steps["choice_index"].fill_null(0) == 0,
        )
        .sort("trajectory_uid", "step_index")
    )
    # in that order a call is a run of rows from its first step (a trajectory's first row
    # opens one too), so calls are numbered by one running count, and each call's next one
    # is the next first step when it is in the same trajectory
    frame = frame.with_columns(starts=pl.col("starts") | trajectory.ne_missing(trajectory.shift(1)))
    frame = frame.with_columns(call=pl.col("starts").cum_sum() - 1)
    retried = trajectory.shift(-1).eq_missing(trajectory) & prompt.shift(-1).eq(prompt)
    by_call = frame.filter("starts").select(pl.when(retried).then(key.shift(-1)))
    marked = frame.select("row", superseded_by=by_call.to_series().gather(frame["call"]))
    return marked.sort("row")["superseded_by"].alias("superseded_by")


def generation_ms(steps: pl.DataFrame) -> pl.Series:
    """Per step: how long the model took to generate it, in ms, when known: the client's
    `metadata.generation_ms`, else the proxied call's upstream time (`metadata.upstream_ms`)
    shared evenly by the call's choices; null for steps that carry neither."""
    frame = with_call_columns(steps)
    share = pl.when(pl.col("call").is_null()).then(1).otherwise(pl.len().over("call"))
    out = frame.select(pl.coalesce("generation_given", pl.col("upstream_ms") / share))
    return out.to_series().alias("generation_ms")


def judged(frame: pl.DataFrame, facts: pl.DataFrame, judge: str, version: str) -> pl.DataFrame:
    """`candidates` with rewards resolved from one judge version's facts instead: a step's
    reward is the judge's latest for it (by `created_at`, arrival, id); without one, a step
    that had a final reward is `missing`; a trajectory's return is the sum of its steps'
    judge rewards (null when it has none)."""
    latest = judge_rewards(facts).filter(
        (pl.col("judge") == judge) & (pl.col("judge_version") == version)
    )
    latest = latest.select("step_key", judge_reward="reward")
    out = frame.join(latest, on="step_key", how="left", maintain_order="left")
    scored = pl.col("judge_reward").is_not_null()
    return out.with_columns(
        reward=pl.col("judge_reward"),
        reward_status=pl.when(scored)
        .then(pl.lit("final"))
        .when(pl.col("reward_status") == "final")
        .then(pl.lit("missing"))
        .otherwise(pl.col("reward_status")),
        trajectory_return=pl.when(scored.any().over("trajectory_uid")).then(
            pl.col("judge_reward").sort().sum().over("trajectory_uid")
        ),
    ).drop("judge_reward")


def candidates(
    steps: pl.DataFrame, rewards: pl.DataFrame, trajectories: pl.DataFrame
) -> pl.DataFrame:
    """Silver's small step columns beside each step's resolved reward and trajectory, and
    the retry that supersedes it (`superseded_by`)."""
    steps = with_call_columns(steps)
    steps = steps.with_columns(superseded_by(steps), generation_ms(steps)).drop(CALL_COLUMNS)
    # labels are rare: joined apart from their (few) rows, the list column is not gathered
    # for every step (at 2 M steps that gather cost as much as the join itself)
    labelled = rewards.filter(pl.col("labels").list.len() > 0).select("step_key", "labels")
    return (
        steps.join(
            rewards.select("step_key", "reward", "reward_status", "rating"),
            on="step_key",
            how="left",
        )
        .join(labelled, on="step_key", how="left")
        .join(
            trajectories.select(
                "trajectory_uid",
                trajectory_status="status",
                trajectory_return="resolved_return",
                trajectory_first_seen="first_seen_at",
                trajectory_last_seen="last_seen_at",
            ),
            on="trajectory_uid",
            how="left",
        )
        .with_columns(
            pl.col("policy_version").fill_null(0),
            pl.col("reward_status").fill_null("pending"),
            pl.col("labels").fill_null([]),
            pl.coalesce("prompt_uid", "trajectory_uid").alias(GROUP),
        )
    )


def _in(column: str, allowed: list | None) -> pl.Expr:
    return pl.lit(True) if allowed is None else pl.col(column).is_in(allowed)


def _at_least(column: str, bound: float | None) -> pl.Expr:
    return pl.lit(True) if bound is None else (pl.col(column) >= bound).fill_null(False)


def _at_most(column: str, bound: float | None) -> pl.Expr:
    return pl.lit(True) if bound is None else (pl.col(column) <= bound).fill_null(False)


def step_checks(spec: CurationSpec, newest_version: int) -> dict[str, pl.Expr]:
    """The spec's per-step filters, one predicate per rejection reason (true: passes)."""
    stale = (
        None if spec.max_policy_staleness is None else newest_version - spec.max_policy_staleness
    )
    # the version a step's staleness is judged by: its oldest token's (step), or the version
    # that finished it (token: its older tokens are masked out of the loss instead)
    judged = pl.col("policy_version") if spec.staleness == "token" else oldest_version()
    fresh = pl.lit(True) if stale is None else (judged >= stale).fill_null(False)
    labels = [pl.col("labels").list.contains(label) for label in spec.require_labels]
    labels += [~pl.col("labels").list.contains(label) for label in spec.exclude_labels]
    # an aborted step still in silver was not continued (a continuation absorbs it): it waits
    # while its trajectory is open, and is left out once the trajectory ended
    aborted = is_aborted()
    ended = pl.col("trajectory_status").is_not_null() & (pl.col("trajectory_status") != "open")
    checks = {
        "superseded": [pl.lit(True) if spec.keep_superseded else pl.col("superseded_by").is_null()],
        "aborted": [~(aborted & ended)],
        "stale": [_in("policy_version", spec.policy_versions), fresh],
        "reward": [
            pl.col("reward_status").is_in(spec.reward_status),
            _at_least("reward", spec.reward_min),
            _at_most("reward", spec.reward_max),
            _at_least("rating", spec.min_rating),
            _at_least("trajectory_return", spec.min_return),
        ],
        "label": labels,
        "length": [
            _at_least("prompt_len", spec.min_prompt_tokens),
            _at_most("prompt_len", spec.max_prompt_tokens),
            _at_least("response_len", spec.min_response_tokens),
            _at_most("response_len", spec.max_response_tokens),
        ],
        "tokens": [_in("token_source", spec.token_sources)],
        "log_probs": [pl.col("has_log_probs") if spec.require_log_probs else pl.lit(True)],
        "source": [
            _in("finish_reason", spec.finish_reasons),
            _in("source_kind", spec.sources),
            _in("tenant", spec.tenants),
        ],
        "incomplete": [_in("trajectory_status", spec.trajectory_status), ~(aborted & ~ended)],
    }
    return {  # null (an unknown value) fails, as a filter drops it
        reason: pl.all_horizontal(exprs or [pl.lit(True)]).fill_null(False)
        for reason, exprs in checks.items()
    }


def group_stats(frame: pl.DataFrame) -> pl.DataFrame:
    """Per prompt group, over its trajectories in silver: size, completeness, return stats."""
    per_trajectory = frame.group_by("trajectory_uid").agg(
        pl.col(GROUP).first(),
        pl.col("trajectory_status").first(),
        pl.col("trajectory_return").first(),
        pl.col("trajectory_first_seen").first(),
    )
    return per_trajectory.group_by(GROUP).agg(
        group_first_seen=pl.col("trajectory_first_seen").min(),
        group_size=pl.len().cast(pl.Int64),
        group_complete=(pl.col("trajectory_status") == "complete").all(),
        group_scored=(
            (pl.col("trajectory_status") == "complete") & pl.col("trajectory_return").is_not_null()
        ).all(),
        # sorted first: float sums then do not depend on row order (increments and full
        # builds must agree to the bit)
        group_mean=pl.col("trajectory_return").sort().mean(),
        group_std=pl.col("trajectory_return").sort().std(ddof=1).fill_null(0.0),
        group_distinct_returns=pl.col("trajectory_return").drop_nulls().n_unique(),
    )


def _past_deadline(spec: CurationSpec, clock: pl.Expr) -> pl.Expr:
    """Whether a step's group is past the spec's deadline (never, without one)."""
    if spec.group_deadline_s is None:
        return pl.lit(False)
    deadline = pl.duration(microseconds=int(spec.group_deadline_s * 1_000_000))
    return (clock - pl.col("group_first_seen") >= deadline).fill_null(False)


def admission(spec: CurationSpec, clock: pl.Expr) -> pl.Expr:
    """Per step (beside its group stats): "ready" when its group meets the spec's waiting
    rules (complete, big enough), "deadline" when it does not but its deadline passed and the
    spec releases it, else null (waiting, or skipped past its deadline)."""
    ready = pl.lit(True)
    if spec.complete_groups_only:
        ready = ready & pl.col("group_complete")
    if spec.min_group_size is not None:
        ready = ready & (pl.col("group_size") >= spec.min_group_size)
    late = _past_deadline(spec, clock) if spec.on_deadline == "release" else pl.lit(False)
    return pl.when(ready).then(pl.lit("ready")).when(late).then(pl.lit("deadline"))


def _selection(rows: pl.DataFrame, spec: CurationSpec) -> pl.DataFrame:
    """Per trajectory of the rows still in (no reason yet): the reason `spec.select` leaves
    it out, or null when it keeps it."""
    trajectories = (
        rows.filter(pl.col("reasons").list.len() == 0)
        .group_by("trajectory_uid")
        .agg(pl.col(GROUP).first(), pl.col("trajectory_return").first())
    )
    ranked = trajectories.sort(
        "trajectory_return", "trajectory_uid", descending=[True, False], nulls_last=True
    )
    first = pl.col("trajectory_uid").first().over(GROUP)
    scored = ranked.filter(pl.col("trajectory_return").is_not_null())
    worst = scored.sort("trajectory_return", "trajectory_uid", descending=[False, False])
    worst = worst.group_by(GROUP, maintain_order=True).agg(worst=pl.col("trajectory_uid").first())
    out = ranked.with_columns(best=first == pl.col("trajectory_uid")).join(
        worst, on=GROUP, how="left"
    )
    out = out.with_columns(
        distinct=pl.col("trajectory_return").drop_nulls().n_unique().over(GROUP),
        best=pl.col("best") & pl.col("trajectory_return").is_not_null(),
    )
    if spec.select == "best_per_group":
        reason = pl.when(~pl.col("best")).then(pl.lit("not_selected"))
    else:
        pair = pl.col("best") | (pl.col("trajectory_uid") == pl.col("worst"))
        reason = (
            pl.when(pl.col("distinct") < 2)
            .then(pl.lit("zero_variance"))
            .when(~pair.fill_null(False))
            .then(pl.lit("not_selected"))
        )
    return out.select("trajectory_uid", selection=reason)


def classify(
    frame: pl.DataFrame,
    spec: CurationSpec,
    newest: int | None = None,
    clock: datetime | None = None,
) -> pl.DataFrame:
    """Every step of `frame` beside its group stats, `admission`, and why `spec` leaves it
    out: `reasons` (every rule it fails, in REJECTION_REASONS order) and `reason` (the first;
    null for the steps the spec keeps). Staleness counts from `newest` (default: the newest
    version in `frame`); deadlines from `clock` (default: the newest trajectory activity in
    `frame`). Given both, `frame` may hold some groups of silver only: each group is judged
    on its own rows. A spec of one tenant sees that tenant's steps only (others' are not its
    rejections)."""
    if spec.tenant is not None:
        frame = frame.filter(pl.col("tenant") == spec.tenant)
    frame = with_runs(frame)
    if newest is None:
        top = frame["policy_version"].max()
        newest = 0 if top is None else int(top)
    if clock is None:
        clock = frame["trajectory_last_seen"].max()
    clock = pl.lit(clock, dtype=pl.Datetime("us", "UTC"))
    failed = [pl.when(~ok).then(pl.lit(r)) for r, ok in step_checks(spec, newest).items()]
    waiting = pl.col("admission").is_null()
    skipped = waiting & _past_deadline(spec, clock) & (spec.on_deadline == "skip")
    failed += [
        pl.when(skipped).then(pl.lit("deadline")).when(waiting).then(pl.lit("incomplete")),
        pl.when(
            pl.lit(spec.drop_zero_variance_groups) & (pl.col("group_distinct_returns") < 2)
        ).then(pl.lit("zero_variance")),
    ]
    rows = (
        frame.join(group_stats(frame), on=GROUP, how="left", maintain_order="left")
        .with_columns(admission=admission(spec, clock))
        .with_columns(reasons=pl.concat_list(failed).list.drop_nulls())
    )
    if spec.select != "all":
        rows = rows.join(_selection(rows, spec), on="trajectory_uid", how="left")
        rows = rows.with_columns(
            reasons=pl.concat_list("reasons", pl.col("selection").fill_null("")).list.eval(
                pl.element().filter(pl.element() != "")
            )
        ).drop("selection")
    return rows.with_columns(
        reason=pl.col("reasons").list.first(), newest_policy_version=pl.lit(newest, pl.Int64)
    )


def kept_steps(classified: pl.DataFrame, spec: CurationSpec) -> pl.DataFrame:
    """The steps of a `classify` result the spec keeps, with `advantage` and `spec_hash`."""
    kept = classified.filter(pl.col("reason").is_null()).drop("reasons", "reason")
    advantage = pl.lit(None, pl.Float64)
    if spec.advantage == "grpo":
        advantage = (
            pl.when(pl.col("group_scored"))
            .then(
                (pl.col("trajectory_return") - pl.col("group_mean"))
                / (pl.col("group_std") + spec.advantage_eps)
            )
            .otherwise(None)
        )
    return kept.with_columns(advantage=advantage, spec_hash=pl.lit(spec.spec_hash))


def rejected_steps(classified: pl.DataFrame, spec: CurationSpec) -> pl.DataFrame:
    """The steps of a `classify` result the spec leaves out, with their reasons."""
    rejected = classified.filter(pl.col("reason").is_not_null())
    return rejected.with_columns(spec_hash=pl.lit(spec.spec_hash))


def tree_ids(frame: pl.DataFrame, spec: CurationSpec) -> pl.Series:
    """Each step's prefix tree under the spec's merge scope; where a scope holds steps of
    several tokenizers, one tree per tokenizer (`<scope>@<fingerprint>`): ids of different
    vocabularies never share a prefix."""
    column = {"trajectory": "trajectory_uid", "prompt_group": GROUP, "none": "step_key"}
    scope = pl.col(column[spec.merge])
    if "tokenizer" not in frame.columns or frame["tokenizer"].n_unique() <= 1:
        return frame[column[spec.merge]].alias("tree_id")  # one tokenizer: nothing to cut
    mixed = pl.col("tokenizer").fill_null("").n_unique().over(scope) > 1
    split = scope + "@" + pl.col("tokenizer").fill_null("unknown")
    return frame.select(pl.when(mixed).then(split).otherwise(scope).alias("tree_id")).to_series()

"""The waste ledger: per dataset and policy version, what its spec admitted and what it left
out (by reason), in steps, tokens, generated tokens and generation time, and how much of what
it left out another dataset re-admitted; and the generated tokens discarded inside admitted
steps: those a spec with token-level staleness masks out of the loss (`masked`, `stale`).
Aborted generations nothing continued are the rejections `aborted`. Read from gold/datasets
and gold/rejections (small columns), the specs and the published policy versions."""

from __future__ import annotations

import polars as pl

from claw_pipelines.contracts.tables import (
    gold_dataset_table,
    gold_rejection_table,
)
from claw_pipelines.lake.catalog import gold_datasets
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import published_version
from claw_pipelines.lake.specs import SpecError, load_spec

ROW_SCHEMA = {
    "step_key": pl.String,
    "policy_version": pl.Int64,
    "prompt_len": pl.Int64,
    "response_len": pl.Int64,
    "generation_ms": pl.Float64,
}
RUN_COLUMNS = {"policy_version_runs": pl.List(pl.Int64), "policy_run_lengths": pl.List(pl.Int64)}
LEDGER_SCHEMA = {
    "dataset": pl.String,
    "policy_version": pl.Int64,
    "outcome": pl.String,
    "reason": pl.String,
    "steps": pl.Int64,
    "tokens": pl.Int64,
    "generated_tokens": pl.Int64,
    "generation_s": pl.Float64,
    "readmitted_steps": pl.Int64,
    "readmitted_tokens": pl.Int64,
    "readmitted_by": pl.List(pl.String),
}


def _admitted_of(left_out: pl.DataFrame, admitted: pl.DataFrame) -> pl.Series:
    """The step keys of `admitted` worth testing `left_out`'s keys against: when it holds
    many more rows, only those among the left-out keys (a set of the few is built, the many
    probe it), else all of them."""
    if admitted.height > 4 * left_out.height:
        keys = left_out["step_key"].implode()
        return admitted.filter(pl.col("step_key").is_in(keys))["step_key"].implode()
    return admitted["step_key"].implode()


def _rows(lake: Lake, table: str, extra: dict[str, pl.DataType]) -> pl.DataFrame:
    """The ledger's columns of a gold table and `extra` ones (empty when it does not exist
    yet; a column declared since it was written reads as nulls)."""
    schema = ROW_SCHEMA | extra
    if not lake.exists(table):
        return pl.DataFrame(schema=schema)
    frame = lake.read(table, columns=list(schema))
    return frame.cast(schema)  # type: ignore[arg-type]


def token_floor(lake: Lake, name: str) -> int | None:
    """The policy version below which dataset `name`'s spec masks tokens out of the loss
    (token-level staleness: the newest published minus max_policy_staleness), or None."""
    try:
        spec = load_spec(lake, name)
    except SpecError:
        return None
    published = published_version(lake)
    if spec.staleness != "token" or spec.max_policy_staleness is None or published is None:
        return None
    return published - spec.max_policy_staleness


def _masked(admitted: pl.DataFrame, floor: int) -> pl.DataFrame:
    """Per policy version of admitted steps: the steps with tokens generated before `floor`
    and those tokens (masked out of the loss), as ledger rows (outcome `masked`)."""
    runs = admitted.select(
        "policy_version",
        "step_key",
        v=pl.coalesce("policy_version_runs", pl.concat_list(pl.col("policy_version"))),
        n=pl.coalesce("policy_run_lengths", pl.concat_list(pl.col("response_len"))),
    ).explode("v", "n")
    stale = runs.filter(pl.col("v") < floor)
    masked = stale.group_by("policy_version").agg(
        steps=pl.col("step_key").n_unique().cast(pl.Int64),
        tokens=pl.col("n").sum().cast(pl.Int64),
    )
    return masked.with_columns(
        generated_tokens="tokens",
        generation_s=pl.lit(None, pl.Float64),
        readmitted_steps=pl.lit(0, pl.Int64),
        readmitted_tokens=pl.lit(0, pl.Int64),
        readmitted_by=pl.lit([], pl.List(pl.String)),
        outcome=pl.lit("masked"),
    )


def waste_ledger(lake: Lake, datasets: list[str] | None = None) -> pl.DataFrame:
    """One row per (dataset, policy version, outcome, reason): `outcome` is `admitted`
    (reason null), `rejected`, or `masked` (reason `stale`: generated tokens of admitted
    steps a token-level staleness spec masks out of the loss now; those steps are counted
    among the admitted too); steps, tokens (prompt + response), generated tokens (response)
    and generation seconds (of the steps whose time is known); for rejected rows, the steps
    and tokens another dataset admitted (`readmitted_*`, `readmitted_by`). Per dataset and
    policy version, admitted plus rejected is every step its spec looked at."""
    names = gold_datasets(lake) if datasets is None else datasets
    read: dict[str, pl.DataFrame] = {}

    def admitted(name: str) -> pl.DataFrame:
        if name not in read:
            read[name] = _rows(lake, gold_dataset_table(name), RUN_COLUMNS)
        return read[name]

    every = gold_datasets(lake)
    tokens = pl.col("prompt_len").fill_null(0) + pl.col("response_len").fill_null(0)
    figures = {
        "steps": pl.len().cast(pl.Int64),
        "tokens": tokens.sum().cast(pl.Int64),
        "generated_tokens": pl.col("response_len").fill_null(0).sum().cast(pl.Int64),
        "generation_s": pl.col("generation_ms").sum() / 1000,
    }
    parts = []
    for name in names:
        # admitted steps are summed as they are (nothing re-admits them): no per-step work
        parts.append(
            admitted(name)
            .group_by("policy_version")
            .agg(**figures)
            .with_columns(
                outcome=pl.lit("admitted"),
                reason=pl.lit(None, pl.String),
                readmitted_steps=pl.lit(0, pl.Int64),
                readmitted_tokens=pl.lit(0, pl.Int64),
                readmitted_by=pl.lit([], pl.List(pl.String)),
                dataset=pl.lit(name),
            )
        )
        floor = token_floor(lake, name)
        if floor is not None and admitted(name).height:
            parts.append(
                _masked(admitted(name), floor).with_columns(
                    reason=pl.lit("stale"), dataset=pl.lit(name)
                )
            )
        left_out = _rows(lake, gold_rejection_table(name), {"reason": pl.String})
        if left_out.is_empty():
            continue
        # per other dataset: which of the steps this one left out it admitted
        others = sorted(other for other in every if other != name)
        flags = [f"admitted by {other}" for other in others]
        left_out = left_out.with_columns(
            pl.col("step_key").is_in(_admitted_of(left_out, admitted(other))).alias(flag)
            for other, flag in zip(others, flags, strict=True)
        )
        again = pl.any_horizontal(pl.lit(False), *flags)
        by = [pl.when(pl.col(f).any()).then(pl.lit(o)) for o, f in zip(others, flags, strict=True)]
        parts.append(
            left_out.group_by("policy_version", "reason")
            .agg(
                **figures,
                readmitted_steps=again.sum().cast(pl.Int64),
                readmitted_tokens=tokens.filter(again).sum().cast(pl.Int64),
                readmitted_by=pl.concat_list(by).list.drop_nulls()
                if by
                else pl.lit([], pl.List(pl.String)),
            )
            .with_columns(outcome=pl.lit("rejected"), dataset=pl.lit(name))
        )
    if not parts:
        return pl.DataFrame(schema=LEDGER_SCHEMA)
    ledger = pl.concat(parts, how="diagonal_relaxed").select(list(LEDGER_SCHEMA))
    return ledger.cast(LEDGER_SCHEMA).sort(  # type: ignore[arg-type]
        "dataset", "policy_version", "outcome", "reason", nulls_last=True
    )

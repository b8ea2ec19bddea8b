"""The waste ledger: per dataset and policy version, what its spec admitted and what it left
out (by reason), in steps, tokens and generation time, and how much of what it left out
another dataset re-admitted. Read from gold/datasets and gold/rejections (small columns)."""

from __future__ import annotations

import polars as pl

from claw_pipelines.contracts.tables import (
    gold_dataset_table,
    gold_rejection_table,
)
from claw_pipelines.lake.catalog import gold_datasets
from claw_pipelines.lake.delta import Lake

ROW_SCHEMA = {
    "step_key": pl.String,
    "policy_version": pl.Int64,
    "prompt_len": pl.Int64,
    "response_len": pl.Int64,
    "generation_ms": pl.Float64,
}
LEDGER_COLUMNS = list(ROW_SCHEMA)
LEDGER_SCHEMA = {
    "dataset": pl.String,
    "policy_version": pl.Int64,
    "outcome": pl.String,
    "reason": pl.String,
    "steps": pl.Int64,
    "tokens": pl.Int64,
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


def _rows(lake: Lake, table: str, extra: list[str]) -> pl.DataFrame:
    """The ledger's columns of a gold table (empty when it does not exist yet)."""
    if not lake.exists(table):
        return pl.DataFrame(schema=ROW_SCHEMA | {column: pl.String for column in extra})
    frame = lake.read(table, columns=[*LEDGER_COLUMNS, *extra])
    return frame.with_columns(pl.col("generation_ms").cast(pl.Float64))


def waste_ledger(lake: Lake, datasets: list[str] | None = None) -> pl.DataFrame:
    """One row per (dataset, policy version, outcome, reason): `outcome` is `admitted`
    (reason null) or `rejected`; steps, tokens (prompt + response) and generation seconds
    (of the steps whose time is known); for rejected rows, the steps and tokens another
    dataset admitted (`readmitted_*`, `readmitted_by`). Per dataset and policy version,
    admitted plus rejected is every step its spec looked at."""
    names = gold_datasets(lake) if datasets is None else datasets
    read: dict[str, pl.DataFrame] = {}

    def admitted(name: str) -> pl.DataFrame:
        if name not in read:
            read[name] = _rows(lake, gold_dataset_table(name), [])
        return read[name]

    every = gold_datasets(lake)
    tokens = pl.col("prompt_len").fill_null(0) + pl.col("response_len").fill_null(0)
    figures = {
        "steps": pl.len().cast(pl.Int64),
        "tokens": tokens.sum().cast(pl.Int64),
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
        left_out = _rows(lake, gold_rejection_table(name), ["reason"])
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

"""The waste ledger on the Curation and Optimization pages: what each dataset admitted and
left out (by reason), in steps, tokens and generation time, and what another re-admitted."""

from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from dashboards import data


def reasons_chart(per_reason: pl.DataFrame) -> alt.Chart:
    """Steps and tokens left out, per reason (`reason`, `steps`, `tokens`)."""
    return (
        alt.Chart(per_reason.to_pandas())
        .mark_bar()
        .encode(
            alt.X("steps:Q", title="steps left out"),
            alt.Y("reason:N", title="reason", sort="-x"),
            tooltip=["reason", "steps", "tokens"],
        )
    )


def show_ledger(at: data.Where, dataset: str | None = None) -> None:
    """The ledger's table and a tokens-by-outcome chart (one dataset, or all of them)."""
    st.subheader("Waste ledger")
    ledger = data.ledger(at, dataset)
    if ledger.is_empty():
        st.caption("No dataset built yet: the ledger fills as gold partitions are written.")
        return
    st.caption(
        "Per dataset and policy version: what its spec admitted, what it left out by reason "
        "(`aborted`: generations aborted and never continued), how much of that another "
        "dataset re-admitted (generation time: steps whose time is known), and the generated "
        "tokens of admitted steps masked out of the loss as stale (`masked`, token-level "
        "staleness; the chart leaves them out: they are among the admitted)."
    )
    shown = ledger.with_columns(
        outcome=pl.when(pl.col("reason").is_null())
        .then(pl.col("outcome"))
        .otherwise(pl.col("outcome") + ": " + pl.col("reason")),
        readmitted_by=pl.col("readmitted_by").list.join(", "),
    ).drop("reason")
    st.altair_chart(
        alt.Chart(shown.filter(~pl.col("outcome").str.starts_with("masked")).to_pandas())
        .mark_bar()
        .encode(
            alt.X("sum(tokens):Q", title="tokens"),
            alt.Y("dataset:N", title="dataset"),
            alt.Color("outcome:N", title="outcome"),
            tooltip=["dataset", "policy_version", "outcome", "steps", "tokens", "generation_s"],
        ),
        width="stretch",
    )
    st.dataframe(shown, hide_index=True, width="stretch")

"""Optimization: how much the prefix trees save, per dataset and partition, and one drawn."""

from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from claw_pipelines.contracts.tables import GOLD_LINEAGE
from dashboards import data, ledger_view, tree_view

at, names = data.open_dataset_page("Optimization")

lineage = data.table(
    at,
    GOLD_LINEAGE,
    (
        "dataset",
        "policy_version",
        "dataset_version",
        "steps",
        "raw_tokens",
        "tree_tokens",
        "written_at",
    ),
)
latest = lineage.sort("written_at").group_by("dataset", "policy_version").agg(pl.all().last())
name = st.selectbox("dataset", names)
mine = latest.filter(pl.col("dataset") == name).sort("policy_version")
raw, tree = int(mine["raw_tokens"].sum()), int(mine["tree_tokens"].sum())
a, b, c = st.columns(3)
a.metric("raw tokens", f"{raw:,}")
b.metric("tree tokens", f"{tree:,}")
c.metric("saved", f"{raw - tree:,}", f"token_ratio {tree / raw:.3f}" if raw else None)
st.dataframe(
    mine.with_columns(token_ratio=pl.col("tree_tokens") / pl.col("raw_tokens")),
    hide_index=True,
    width="stretch",
)

ledger_view.show_ledger(at, name)

version = st.selectbox("policy version", mine["policy_version"].to_list())
segments = data.tree_segments(at, name, int(version))
if segments.is_empty():
    st.caption("this partition holds no steps")
    st.stop()
per_tree = (
    segments.group_by("tree_id")
    .agg(
        steps=pl.len(),
        tree_tokens=pl.col("own").sum(),
        raw_tokens=pl.col("end_depth").sum(),
        raw_attention=(pl.col("end_depth") ** 2).sum(),
        tree_attention=(pl.col("own") * pl.col("end_depth")).sum(),
    )
    .with_columns(token_ratio=pl.col("tree_tokens") / pl.col("raw_tokens"))
)
st.subheader("token_ratio per tree")
st.altair_chart(
    alt.Chart(per_tree.to_pandas())
    .mark_bar()
    .encode(
        alt.X("token_ratio:Q", bin=alt.Bin(maxbins=30), title="token_ratio (tree / flat tokens)"),
        alt.Y("count()", title="trees"),
    ),
    width="stretch",
)
saved_attention = 1 - per_tree["tree_attention"].sum() / max(1, per_tree["raw_attention"].sum())
st.metric("attention work saved (query x key pairs)", f"{saved_attention:.0%}")

st.subheader("A tree")
tree_id = st.selectbox("tree", per_tree.sort("steps", descending=True)["tree_id"].to_list())
st.graphviz_chart(tree_view.tree_dot(segments.filter(pl.col("tree_id") == tree_id)))

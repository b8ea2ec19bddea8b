"""Overview: records over time by source, steps, trajectories, reward by policy version,
tokens, datasets, versions."""

from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_LINEAGE,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
)
from dashboards import data

at, versions = data.open_page("Overview", needs=BRONZE_EVENTS)

steps = data.table(at, SILVER_STEPS, ("prompt_len", "response_len"))
trajectories = data.table(at, SILVER_TRAJECTORIES, ("status",))
bronze = data.records_per_second(at, versions[BRONZE_EVENTS])
left, middle, right, last = st.columns(4)
left.metric("bronze records", f"{int(bronze['records'].sum()):,}")
middle.metric("silver steps", f"{steps.height:,}" if steps is not None else "—")
tokens = (
    int(steps.select(pl.sum("prompt_len") + pl.sum("response_len")).item())
    if steps is not None and steps.height
    else 0
)
right.metric("tokens in steps", f"{tokens:,}")
last.metric("trajectories", f"{trajectories.height:,}" if trajectories is not None else "—")

st.subheader("Records per second, by source")
st.altair_chart(data.records_chart(bronze, bars=True), width="stretch")

if trajectories is not None and trajectories.height:
    st.subheader("Trajectories by status")
    counts = trajectories.group_by("status").agg(trajectories=pl.len()).sort("status")
    st.altair_chart(
        alt.Chart(counts.to_pandas())
        .mark_bar()
        .encode(
            alt.X("status:N", title="status"),
            alt.Y("trajectories:Q", title="trajectories"),
            tooltip=["status", "trajectories"],
        ),
        width="stretch",
    )
else:
    st.caption("No silver yet: run `claw materialize` (or let the Dagster sensor do it).")

st.subheader("Reward by policy version")
by_version = data.reward_by_version(at)
if by_version is None or not by_version["rewarded"].sum():
    st.caption(
        "No rewarded step yet: rewards come with white-box steps, as feedback, or as a "
        "trajectory completes."
    )
else:
    st.altair_chart(data.reward_chart(by_version), width="stretch")
    st.dataframe(by_version, hide_index=True, width="stretch")
    st.caption(
        "the mean of each policy version's steps whose reward is final (silver), between the "
        "lowest and the highest: a training loop whose reward rises shows here"
    )

st.subheader("Datasets and their freshness")
lineage = data.table(
    at, GOLD_LINEAGE, ("dataset", "policy_version", "dataset_version", "steps", "written_at")
)
if lineage is None or lineage.is_empty():
    st.caption(
        "No gold dataset yet: `claw materialize` builds the built-in `default` one."
        if data.is_admin(at)
        else "No dataset of yours yet: save a spec on the Curation page, then build it."
    )
else:
    latest = (
        lineage.sort("written_at")
        .group_by("dataset", "policy_version")
        .agg(pl.all().last())
        .sort("dataset", "policy_version")
    )
    st.dataframe(latest, hide_index=True, width="stretch")

if data.is_admin(at):  # every tenant's commits move them: an admin's to see
    st.subheader("Table versions")
    st.dataframe(
        pl.DataFrame({"table": list(versions), "delta version": list(versions.values())}),
        hide_index=True,
    )

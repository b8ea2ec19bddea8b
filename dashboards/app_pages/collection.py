"""Collection: what is entering now, from each source, and the gateway's health."""

from __future__ import annotations

import altair as alt
import polars as pl
import streamlit as st

from claw_pipelines.contracts.tables import BRONZE_EVENTS, gold_dataset_table
from dashboards import data

st.title("Collection")
at = data.where()
gateway = st.text_input(
    "gateway URL (for /metrics)", value=at.gateway_url or "http://127.0.0.1:8080"
)


@st.fragment(run_every=5)
def live() -> None:
    """Refreshes every 5 s."""
    versions = data.versions(at)
    health = data.gateway_health(gateway)
    if health is None:
        st.caption(f"gateway at {gateway} is not answering (start it with `claw up`).")
    else:
        columns = st.columns(min(4, max(1, len(health))))
        for slot, (name, value) in zip(columns * 10, sorted(health.items())[:8], strict=False):
            slot.metric(name.removeprefix("claw_"), f"{value:,.0f}")
    if versions[BRONZE_EVENTS] is None:
        st.info(data.empty_lake_help())
        return
    per_second = data.records_per_second(at, versions[BRONZE_EVENTS])
    st.subheader("Records entering, by source")
    st.altair_chart(
        alt.Chart(per_second.to_pandas())
        .mark_line(point=True)
        .encode(x="second:T", y="records:Q", color="source:N"),
        width="stretch",
    )
    recent = (
        at.lake()
        .scan(BRONZE_EVENTS, versions[BRONZE_EVENTS])
        .select("received_at", "kind", "tenant", "trajectory_uid", "event_id")
        .sort("received_at", descending=True)
        .head(50)
        .collect()
        .with_columns(source=pl.col("kind").replace_strict(data.SOURCE_OF_KIND, default="other"))
    )
    st.subheader("Latest records")
    st.dataframe(recent, hide_index=True, width="stretch")
    live_lag()


def live_lag() -> None:
    """From acknowledgement to trainers: how long the newest groups took to be available."""
    st.subheader("Live: acknowledged → available to trainers")
    running = data.materializer_status(at)
    st.caption(
        "a live materializer keeps gold up to date (claw materialize --follow)"
        if running
        else "no live materializer is running: gold moves with Dagster runs "
        "(start one with `claw materialize --follow`, or `claw up`)"
    )
    rows = []
    lake = at.lake()
    for name in data.datasets(at):
        version = lake.version(gold_dataset_table(name))
        recent = data.freshness(at, name, version).head(50)
        if recent.height:
            rows.append(
                {
                    "dataset": name,
                    "groups (newest 50)": recent.height,
                    "lag p50 (s)": round(float(recent["lag_s"].median()), 2),
                    "lag max (s)": round(float(recent["lag_s"].max()), 2),
                    "newest available": recent["available_at"].max(),
                }
            )
    if rows:
        st.dataframe(pl.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.caption("no gold dataset has groups yet")


live()

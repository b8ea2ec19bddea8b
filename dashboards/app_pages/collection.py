"""Collection: what is entering now, from each source, and the gateway's health."""

from __future__ import annotations

import time

import polars as pl
import streamlit as st

from claw_pipelines.contracts.tables import BRONZE_EVENTS, gold_dataset_table
from dashboards import data

st.title("Collection")
at = data.where()
if data.is_admin(at):  # a gateway's /metrics counts every tenant's records
    urls = st.text_input(
        "gateway URLs for /metrics (comma-separated)",
        value=at.gateway_url or "http://127.0.0.1:8080",
        help="only gateways writing this lake are shown (their claw_gateway_info names the "
        "lake); with API keys set, give the dashboard one in CLAW_GATEWAY_KEY (or start the "
        "gateways with CLAW_METRICS_PUBLIC=true)",
    )
else:
    urls = ""
    st.caption(
        "The gateways' live figures (/metrics) count every tenant's records: an admin's to "
        "see. Below, your records as the lake holds them."
    )


def gateway_figures(scrape: data.GatewayScrape) -> None:
    """The figures that matter of one gateway: acknowledged/s, rejections by reason, WAL
    backlog, its flusher."""
    gateway_id, _ = scrape.identity()
    acknowledged = scrape.total("claw_gateway_records_total")
    seen = st.session_state.setdefault("acknowledged", {})
    before = seen.get(scrape.url)
    now = time.monotonic()
    seen[scrape.url] = (now, acknowledged)
    rate = (acknowledged - before[1]) / (now - before[0]) if before and now > before[0] else None
    st.markdown(f"**gateway `{gateway_id}`** at {scrape.url}")
    a, b, c, d, e = st.columns(5)
    a.metric("acknowledged records", f"{acknowledged:,.0f}")
    b.metric("acknowledged / s", "—" if rate is None else f"{rate:,.1f}")
    c.metric("rejected requests", f"{scrape.total('claw_gateway_rejected_requests_total'):,.0f}")
    d.metric("WAL backlog", f"{scrape.total('claw_gateway_wal_backlog_bytes') / 1024:,.1f} KiB")
    e.metric("flusher", "up" if scrape.total("claw_flusher_up") else "down")
    reasons = scrape.by_label("claw_gateway_rejected_requests_total", "reason")
    if reasons:
        st.dataframe(
            pl.DataFrame({"rejected because": list(reasons), "requests": list(reasons.values())}),
            hide_index=True,
        )


def gateways(lake_uri: str) -> None:
    """Live figures of each listed gateway that writes this lake."""
    for url in (u.strip() for u in urls.split(",") if u.strip()):
        scrape = data.scrape_gateway(url, at.gateway_key)
        if scrape is None:
            st.caption(
                f"gateway at {url} is not answering /metrics (start it with `claw up`; "
                "a keyed gateway needs CLAW_GATEWAY_KEY)."
            )
        elif scrape.identity() is None or scrape.identity()[1] != lake_uri:
            writes = scrape.identity()[1] if scrape.identity() else "an unknown lake"
            st.caption(f"gateway at {url} writes {writes}, not this lake: not shown.")
        else:
            gateway_figures(scrape)


@st.fragment(run_every=5)
def live() -> None:
    """Refreshes every 5 s."""
    versions = data.versions(at)
    gateways(at.lake().uri)
    if versions[BRONZE_EVENTS] is None:
        st.info(data.empty_lake_help(at))
        return
    st.subheader("Acknowledged → bronze, per gateway (its newest 50 commits)")
    lag = data.bronze_lag(at, versions[BRONZE_EVENTS])
    if lag.is_empty():
        st.caption("no gateway commit in bronze yet")
    else:
        st.dataframe(
            lag.rename({"lag_p50_s": "lag p50 (s)", "lag_max_s": "lag max (s)"}),
            hide_index=True,
            width="stretch",
        )
    st.subheader("Token ids per gateway: exact, or flagged")
    fidelity = data.token_fidelity(at, versions[BRONZE_EVENTS])
    if fidelity.is_empty():
        st.caption("no step in bronze yet")
    else:
        st.caption(
            "exact: the server's ids (upstream), the client's (client), or computed by the "
            "gateway and confirmed by the server's token counts (local); local_unverified: "
            "computed and not confirmed, left out by the built-in specs"
        )
        st.dataframe(
            fidelity.with_columns(pl.col("exact_share").round(4)),
            hide_index=True,
            width="stretch",
            column_config={
                "exact_share": st.column_config.ProgressColumn(
                    "exact share", min_value=0.0, max_value=1.0, format="percent"
                )
            },
        )
    per_second = data.records_per_second(at, versions[BRONZE_EVENTS])
    st.subheader("Records entering, by source")
    st.altair_chart(data.records_chart(per_second), width="stretch")
    st.subheader("Latest records")
    recent = data.latest_records(at, versions[BRONZE_EVENTS])
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
    shards = data.shard_status(at)
    if shards is not None:
        st.subheader("Materializer shards")
        flagged = shards.filter(pl.col("problem").is_not_null())
        for problem in flagged["problem"].to_list():
            st.warning(problem)
        st.dataframe(shards, hide_index=True, width="stretch")
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

"""Curation: build a spec with a widget per filter, watch what it keeps, save it, build it. A
tenant's specs are its own (`tenant` set to it) and preview over its own steps only."""

from __future__ import annotations

import altair as alt
import streamlit as st

from claw_pipelines.contracts.specs import BUILTIN_SPECS, REJECTION_REASONS
from claw_pipelines.contracts.tables import TOKEN_SOURCES
from claw_pipelines.lake.catalog import dataset_tenants
from claw_pipelines.lake.specs import SpecError, read_specs, save_spec, to_yaml, validate_spec
from dashboards import dagster_graphql, data, ledger_view

st.title("Curation")
at = data.where()
lake = at.lake()
admin = data.is_admin(at)
versions = data.versions(at)
frame = data.curation_candidates(at)
if frame is None or frame.is_empty():
    st.info(data.empty_lake_help(at))
    st.stop()


choices = data.candidate_choices(at)


def options(column: str) -> list:
    return choices[column]


shelf = read_specs(lake)
# a tenant's own specs (the built-in ones are templates: their datasets are shared)
mine = {n: s for n, s in shelf.specs.items() if admin or s.tenant == at.caller.tenant}
existing = BUILTIN_SPECS | mine
if admin:  # a file that does not parse names no tenant: an admin's to fix
    for error in shelf.errors.values():  # one bad file stops only its own dataset
        st.warning(f"not built until fixed: {error}")
for build in data.failing_builds(at, set(mine)):  # the others keep building
    st.error(f"failing: {build.line()}")
starts = sorted(existing)  # the built-in default first, whatever was saved since
start_from = st.selectbox("start from", starts, starts.index("default"))
base = existing[start_from]
with st.form("spec"):
    name = st.text_input("name", value=base.name if base.name != "default" else "my-dataset")
    description = st.text_input("description", value=base.description)
    a, b, c = st.columns(3)
    reward_status = a.multiselect(
        "reward status", ["final", "pending", "missing"], base.reward_status
    )
    reward_min = b.number_input("reward min", value=base.reward_min, step=0.1)
    reward_max = c.number_input("reward max", value=base.reward_max, step=0.1)
    labels = options("labels")
    require_labels = a.multiselect(
        "require labels", labels, [x for x in base.require_labels if x in labels]
    )
    exclude_labels = b.multiselect(
        "exclude labels", labels, [x for x in base.exclude_labels if x in labels]
    )
    min_rating = c.number_input("min rating", value=base.min_rating, step=1.0)
    token_sources = a.multiselect(
        "token sources (empty: all)",
        list(TOKEN_SOURCES),
        base.token_sources or [],
        help="upstream: the server's ids; client: the client's own; local: computed by the "
        "gateway and confirmed by the server's counts; local_unverified: not confirmed",
    )
    finish_reasons = b.multiselect(
        "finish reasons (empty: all)", options("finish_reason"), base.finish_reasons or []
    )
    sources = c.multiselect(
        "sources (empty: all)", ["white_box", "proxy", "claw_r1"], base.sources or []
    )
    if admin:
        shared = "(shared: every tenant's steps)"
        owners = [shared, *sorted(set(options("tenant")) | ({base.tenant} - {None}))]
        owner = a.selectbox(
            "belongs to tenant",
            owners,
            owners.index(base.tenant) if base.tenant in owners else 0,
            help="a tenant's spec curates only that tenant's steps, and its dataset is read "
            "by that tenant's keys (and admins'); a shared one by admins only",
        )
        owner = None if owner == shared else owner
        tenants = a.multiselect("tenants (empty: all)", options("tenant"), base.tenants or [])
    else:
        owner, tenants = at.caller.tenant, []
    trajectory_status = b.multiselect(
        "trajectory status (empty: all)",
        ["open", "complete", "abandoned"],
        base.trajectory_status or [],
    )
    policy_versions = c.multiselect(
        "policy versions (empty: all)", options("policy_version"), base.policy_versions or []
    )
    min_prompt_tokens = a.number_input("min prompt tokens", value=base.min_prompt_tokens, step=1)
    max_prompt_tokens = b.number_input("max prompt tokens", value=base.max_prompt_tokens, step=1)
    max_policy_staleness = c.number_input(
        "max policy staleness", value=base.max_policy_staleness, step=1
    )
    min_response_tokens = a.number_input(
        "min response tokens", value=base.min_response_tokens, step=1
    )
    max_response_tokens = b.number_input(
        "max response tokens", value=base.max_response_tokens, step=1
    )
    min_group_size = c.number_input("min group size", value=base.min_group_size, step=1)
    complete_groups_only = a.checkbox("complete groups only", base.complete_groups_only)
    drop_zero_variance_groups = b.checkbox(
        "drop zero-variance groups", base.drop_zero_variance_groups
    )
    merge = c.selectbox(
        "merge",
        ["trajectory", "prompt_group", "none"],
        ["trajectory", "prompt_group", "none"].index(base.merge),
    )
    advantage = a.selectbox("advantage", ["none", "grpo"], ["none", "grpo"].index(base.advantage))
    selections = ["all", "best_per_group", "best_and_worst"]
    select = b.selectbox("select from each group", selections, selections.index(base.select))
    min_return = c.number_input("min trajectory return", value=base.min_return, step=0.1)
    require_log_probs = a.checkbox(
        "require behaviour log-probs",
        base.require_log_probs,
        help="off-policy correction needs them; steps without are left out (reason log_probs)",
    )
    drawable = existing if admin else mine  # rejections of datasets the caller may read
    others = ["(silver)", *sorted(n for n in drawable if n != base.name)]
    source = base.readmit.dataset if base.readmit else "(silver)"
    readmit_from = a.selectbox(
        "draw from: silver, or what another dataset rejects",
        others,
        others.index(source) if source in others else 0,
    )
    readmit_reasons = b.multiselect(
        "re-admit only these reasons (empty: all)",
        list(REJECTION_REASONS),
        (base.readmit.reasons or []) if base.readmit else [],
    )
    preview, save = st.columns(2)
    previewed = preview.form_submit_button("preview")
    saved = save.form_submit_button("save spec", type="primary")

fields = {
    "name": name,
    "description": description,
    "tenant": owner,
    "reward_status": reward_status,
    "reward_min": reward_min,
    "reward_max": reward_max,
    "require_labels": require_labels,
    "exclude_labels": exclude_labels,
    "min_rating": min_rating,
    "token_sources": token_sources or None,
    "require_log_probs": require_log_probs,
    "finish_reasons": finish_reasons or None,
    "sources": sources or None,
    "tenants": tenants or None,
    "trajectory_status": trajectory_status or None,
    "policy_versions": policy_versions or None,
    "min_prompt_tokens": min_prompt_tokens,
    "max_prompt_tokens": max_prompt_tokens,
    "max_policy_staleness": max_policy_staleness,
    "min_response_tokens": min_response_tokens,
    "max_response_tokens": max_response_tokens,
    "min_group_size": min_group_size,
    "complete_groups_only": complete_groups_only,
    "drop_zero_variance_groups": drop_zero_variance_groups,
    "merge": merge,
    "advantage": advantage,
    "select": select,
    "min_return": min_return,
    "readmit": None
    if readmit_from == "(silver)"
    else {"dataset": readmit_from, "reasons": readmit_reasons or None},
    "reward_judge": base.reward_judge.model_dump() if base.reward_judge else None,
}
try:
    spec = validate_spec(fields)
except SpecError as exc:
    st.error(f"invalid spec: {exc}")
    st.stop()

try:
    preview = data.preview_summary(at, spec)
except SpecError as exc:
    st.error(f"invalid spec: {exc}")
    st.stop()
a, b, c, d = st.columns(4)
a.metric("steps kept", f"{preview.kept:,} / {preview.steps:,}")
b.metric("trajectories", f"{preview.trajectories:,}")
c.metric("prompt groups", f"{preview.groups:,}")
d.metric("in complete groups", f"{preview.in_complete_groups:,}")
if preview.left_out.height:
    st.caption(
        "Left out, by the first rule each step fails (kept in gold/rejections/<name> once "
        "built; another spec can re-admit them)"
    )
    st.altair_chart(ledger_view.reasons_chart(preview.left_out), width="stretch")
if preview.kept:
    charts = st.columns(3)
    for slot, (column, title) in zip(charts, preview.HISTOGRAMS, strict=False):
        chart = data.histogram_chart(preview.bins[column], title, "steps")
        slot.altair_chart(chart, width="stretch")
    charts[2].altair_chart(
        alt.Chart(preview.staleness.to_pandas())
        .mark_bar()
        .encode(
            alt.X("staleness:O", title="policy versions behind the newest"),
            alt.Y("steps:Q", title="steps"),
        ),
        width="stretch",
    )
st.code(to_yaml(spec), language="yaml")


def taken(name: str) -> bool:
    """Whether `name` is a dataset or spec another tenant (or every tenant) owns."""
    if name in BUILTIN_SPECS:
        return True
    if name in shelf.specs and shelf.specs[name].tenant != at.caller.tenant:
        return True
    owners = dataset_tenants(lake)
    return name in owners and owners[name] != at.caller.tenant


if saved:
    if not admin and taken(spec.name):
        st.error(f"the name {spec.name!r} is taken: choose another")
    else:
        try:
            save_spec(lake, spec)
            st.success(f"saved specs/{spec.name}.yaml (hash {spec.spec_hash})")
        except SpecError as exc:
            st.error(f"invalid spec: {exc}")

if st.button("build this dataset now"):
    saved_spec = read_specs(lake).specs.get(spec.name)
    if saved_spec is None or not (admin or saved_spec.tenant == at.caller.tenant):
        st.error("save the spec first")
        st.stop()
    from claw_pipelines.materialize.gold import policy_versions as all_versions

    versions_to_build = all_versions(lake) if admin else options("policy_version")
    if admin and dagster_graphql.is_up(at.dagster_url):  # Dagster's runs are an admin's
        try:
            runs = dagster_graphql.launch_gold(at.dagster_url, spec.name, versions_to_build)
        except dagster_graphql.DagsterUnavailable as exc:
            st.error(str(exc))
        else:
            links = ", ".join(f"v{v} [{r[:8]}]({at.dagster_url}/runs/{r})" for v, r in runs.items())
            st.success(f"Dagster runs building {spec.name}: {links}")
    else:
        from claw_pipelines.materialize.gold import build_partition

        for version in versions_to_build:
            try:
                part = build_partition(lake, saved_spec, version)
            except Exception as exc:  # a deployment's dashboard writes specs/ only
                if not data.refused_by_the_store(exc):
                    raise
                st.info(
                    "this dashboard's lake identity may not write gold: the materializer "
                    "builds the saved spec's dataset within seconds"
                )
                break
            st.write(
                f"built {spec.name} v{version} in-process: {part.steps.height} steps, "
                f"dataset version {part.dataset_version}"
            )

st.divider()
ledger_view.show_ledger(at, base.name)  # the dataset the spec started from

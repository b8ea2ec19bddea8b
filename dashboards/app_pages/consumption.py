"""Consumption: batches exactly as trainers get them, who took what, what trainers fed back
(behaviour vs trainer log-probs), lineage and diffs."""

from __future__ import annotations

import polars as pl
import streamlit as st

from claw_pipelines.contracts.tables import GOLD_CONSUMPTION, GOLD_LINEAGE, gold_dataset_table
from dashboards import data, tree_view

at, names = data.open_dataset_page("Consumption")
lake = at.lake()
name = st.selectbox("dataset", names)
newest = lake.version(gold_dataset_table(name))
version = st.number_input("dataset version", min_value=0, max_value=newest, value=newest)
partitions = data.dataset_partitions(at, name, int(version))
if not partitions:
    st.caption("this version holds no steps")
    st.stop()
a, b, c = st.columns(3)
policy = a.selectbox("policy version", partitions)
layout = b.radio("layout", ["tree", "flat"], horizontal=True)
size = c.number_input("batch size (steps)", min_value=1, value=32)


st.subheader("First batch, as `consume.batches` yields it")
batch = data.first_batch(at, name, int(version), int(policy), int(size), layout)
if batch is not None:
    left, middle, right = st.columns(3)
    left.metric("steps", len(batch.step_keys))
    middle.metric("tokens", f"{batch.num_tokens:,}")
    right.metric("trained tokens", f"{int(batch.loss_mask.sum()):,}")
    first_tree = int(batch.tree_offsets[1] - batch.tree_offsets[0])
    if first_tree <= 4000:
        st.caption(
            f"Ancestor mask of the first tree ({first_tree} tokens, in blocks): a query token "
            "attends to the keys of its own path from the root only"
        )
        st.altair_chart(tree_view.mask_chart(batch.block_attention_mask(0)), width="stretch")
    else:
        st.caption(f"first tree has {first_tree:,} tokens: mask not drawn")
    segments = data.tree_segments(at, name, int(policy))
    holding = segments.filter(pl.col("step_key") == batch.step_keys[0])["tree_id"]
    if holding.len():
        st.caption("the stored prefix tree of the batch's first step")
        st.graphviz_chart(tree_view.tree_dot(segments.filter(pl.col("tree_id") == holding[0])))
    st.dataframe(
        pl.DataFrame(
            {"step_key": batch.step_keys, "tokens": [len(i) for i in batch.step_token_index]}
        ),
        hide_index=True,
    )

st.subheader("Consumption log")
log = data.table(
    at,
    GOLD_CONSUMPTION,
    (
        "consumer",
        "dataset",
        "dataset_version",
        "policy_version",
        "batch_index",
        "step_keys",
        "consumed_at",
    ),
)
if log is None or log.is_empty():
    st.caption("No trainer has pulled batches with `consumer=` yet.")
else:
    mine = log.filter(pl.col("dataset") == name).with_columns(steps=pl.col("step_keys").list.len())
    st.dataframe(
        mine.group_by("consumer").agg(
            batches=pl.len(), steps=pl.col("steps").sum(), last=pl.col("consumed_at").max()
        ),
        hide_index=True,
    )

st.subheader("Consumers' positions")
positions = data.consumers(at, name, newest)
if positions.is_empty():
    st.caption("No trainer has pulled from this dataset yet (`next_batch` or `batches`).")
else:
    st.dataframe(positions, hide_index=True, width="stretch")
    st.caption(
        "live consumers (`next_batch`) get each group once per rank, or up to `max_uses` "
        "times: `groups` counts the distinct groups a rank was given, `deliveries` every "
        "delivery (more than `groups` when groups were reused); `not_yet_given` counts the "
        "groups of this rank's share that are available but not delivered yet"
    )

st.subheader("Trainer feedback: behaviour vs trainer log-probs")
feedback = data.trainer_feedback(at, name)
if feedback is None:
    st.caption(
        "No trainer has fed back on this dataset yet: after a `next_batch`, "
        "`ds.record_feedback(batch, log_probs, loss=..., step=...)` records the trainer's "
        "log-probs beside the behaviour ones."
    )
else:
    overall, (low, high) = feedback.overall, feedback.overall.band
    a, b, c, d = st.columns(4)
    a.metric("tokens compared", f"{overall.tokens_compared:,}")
    if overall.tokens_compared:
        b.metric("mean |b - t|", f"{overall.mean_abs_diff:.4g}")
        c.metric("KL k3 (k1)", f"{overall.k3:.4g} ({overall.k1:.4g})")
        d.metric(f"ratios outside [{low}, {high}]", f"{overall.outside_band:.1%}")
    st.caption(
        "b: the behaviour policy's log-prob of a response token (captured at generation), "
        "t: the trainer's; r = exp(t - b). k1 = mean(b - t), k3 = mean(r - 1 - log r): "
        "KL(behaviour || trainer) estimates. Per policy version:"
    )
    st.dataframe(feedback.by_policy_version, hide_index=True, width="stretch")
    st.caption("The steps whose log-probs differ most (mean |b - t|):")
    st.dataframe(feedback.worst_steps, hide_index=True, width="stretch")
    st.caption("Per batch fed back, newest first (the first 200):")
    newest_first = feedback.by_batch.sort("recorded_at", descending=True).head(200)
    st.dataframe(newest_first, hide_index=True, width="stretch")

st.subheader("Lineage of each version")
lineage = data.table(
    at,
    GOLD_LINEAGE,
    (
        "dataset",
        "dataset_version",
        "policy_version",
        "spec_hash",
        "source_versions",
        "code_version",
        "steps",
        "token_ratio",
        "written_at",
    ),
)
if lineage is not None:
    mine = lineage.filter(pl.col("dataset") == name).sort("dataset_version")
    st.dataframe(data.lineage_table(mine), hide_index=True, width="stretch")
    st.caption("`source ...` columns: the version of each table the build read")

st.subheader("Diff between two versions")
a, b = st.columns(2)
old = a.number_input("from version", min_value=0, max_value=newest, value=max(0, newest - 1))
new = b.number_input("to version", min_value=0, max_value=newest, value=newest)
diff = data.version_diff(at, name, int(old), int(new))
in_before = pl.col("policy_version_before").is_not_null()
in_after = pl.col("policy_version").is_not_null()
added, removed = diff.filter(~in_before), diff.filter(~in_after)
changed = diff.filter(in_before & in_after)
a, b, c = st.columns(3)
a.metric("steps added", f"{added.height:,}")
b.metric("steps removed", f"{removed.height:,}")
c.metric("reward or advantage changed", f"{changed.height:,}")
what_changed = pl.concat(
    [
        added.select("step_key", "policy_version", change=pl.lit("added"), now=pl.col("reward")),
        removed.select(
            "step_key",
            policy_version="policy_version_before",
            change=pl.lit("removed"),
            before=pl.col("reward_before"),
        ),
        changed.select(
            "step_key",
            "policy_version",
            change=pl.lit("reward/advantage changed"),
            before=pl.col("reward_before"),
            now=pl.col("reward"),
        ),
    ],
    how="diagonal_relaxed",
).rename({"before": "reward before", "now": "reward now"})
if what_changed.is_empty():
    st.caption(f"versions {old} and {new} hold the same steps with the same rewards")
else:
    st.dataframe(what_changed.head(1000), hide_index=True, width="stretch")
    st.caption(f"{what_changed.height:,} changed steps (the first 1,000 listed)")

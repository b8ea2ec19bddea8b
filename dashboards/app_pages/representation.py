"""Representation: one step as the lake holds it — tokens, text, log-probs, rewards, lineage,
and the fragments of its trajectory (where the agent compacted or rewrote its history)."""

from __future__ import annotations

import html
import math

import altair as alt
import polars as pl
import streamlit as st

from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
)
from claw_pipelines.transforms.judges import judge_agreement, judge_rewards
from dashboards import data

at, versions = data.open_page("Representation", needs=SILVER_STEPS)

steps = data.step_table(at)
st.subheader("Steps")
a, b, c, d = st.columns(4)
policy = a.selectbox("policy version", ["all", *data.distinct(steps, "policy_version")])
reward_status = b.selectbox("reward status", ["all", *data.distinct(steps, "reward_status")])
status = c.selectbox("trajectory status", ["all", *data.distinct(steps, "trajectory_status")])
text = d.text_input("id contains (step, trajectory or group)")
chosen = steps
for column, value in (
    ("policy_version", policy),
    ("reward_status", reward_status),
    ("trajectory_status", status),
):
    if value != "all":
        chosen = chosen.filter(pl.col(column) == value)
if text:
    chosen = chosen.filter(
        pl.any_horizontal(
            pl.col(c).str.contains(text, literal=True)
            for c in ("step_key", "trajectory_uid", "group_key")
        )
    )
SHOWN = 500
st.caption(
    f"{chosen.height:,} of {steps.height:,} steps match; the newest {min(SHOWN, chosen.height)} "
    "are listed. Pick a row to open the step."
)
listed = chosen.top_k(SHOWN, by="created_at").sort("created_at", descending=True)
picked = st.dataframe(
    listed,
    hide_index=True,
    width="stretch",
    height=280,
    on_select="rerun",
    selection_mode="single-row",
    key="steps",
)
if listed.is_empty():
    st.warning("no step matches these filters")
    st.stop()
rows = picked.selection.rows if picked is not None else []
key = listed["step_key"][rows[0] if rows else 0]
found = data.steps_matching(at, versions[SILVER_STEPS], "step_key", key)
step = found.filter(pl.col("step_key") == key).to_dicts()[0]

left, right = st.columns(2)
fragment = step.get("fragment") or 0
started = f" (starts it: `{step['fragment_reason']}`)" if step.get("fragment_reason") else ""
left.markdown(
    f"**{step['step_key']}** · {step['source_kind']} · token source `{step['token_source']}` · "
    f"policy v{step['policy_version']} · model `{step['model']}` · fragment {fragment}{started}"
)
right.markdown(f"prompt `{step['prompt_id']}` · response `{step['response_id']}`")
boundaries = st.toggle("show token boundaries", value=False)
chat = data.step_tokenizer(at, step.get("tokenizer"))
if chat is None:
    st.caption(
        "this step names no tokenizer the lake holds: its ids are shown as numbers (claw import "
        "--tokenizer, or a gateway with CLAW_TOKENIZER, names it)"
    )
else:
    st.caption(f"decoded with its tokenizer `{chat.name}` ({chat.fingerprint})")


def pieces(ids: list[int]) -> list[str]:
    if chat is None:
        return [f"{token} " for token in ids]
    return [chat.decode([token]) for token in ids]


def render(ids: list[int], logprobs: list[float] | None = None) -> str:
    spans = []
    for position, text in enumerate(pieces(ids)):
        style = "border-right:1px solid #bbb;" if boundaries else ""
        title = f"id {ids[position]}"
        if logprobs is not None and position < len(logprobs):
            p = math.exp(logprobs[position])
            style += f"background: rgba(255, 80, 0, {0.75 * (1 - p):.2f});"
            title += f", logprob {logprobs[position]:.3f}"
        spans.append(f'<span style="{style}" title="{title}">{html.escape(text)}</span>')
    body = "".join(spans)
    return f'<div style="white-space: pre-wrap; font-family: monospace">{body}</div>'


st.subheader("Prompt")
st.html(render(step["prompt_ids"][-2000:]))
st.subheader("Response (shaded by how unlikely each sampled token was)")
st.html(render(step["response_ids"], step["rollout_log_probs"]))

st.subheader("Reward facts and how they resolved")
rewards = data.rows_of_step(
    at,
    SILVER_STEP_REWARDS,
    key,
    step["trajectory_uid"],
    (
        "step_key",
        "reward",
        "reward_status",
        "reward_source",
        "reward_target",
        "num_reward_facts",
        "rating",
        "labels",
    ),
)
if rewards is not None:
    st.dataframe(rewards, hide_index=True)
facts = data.rows_of_step(
    at,
    SILVER_FEEDBACK,
    key,
    step["trajectory_uid"],
    (
        "feedback_id",
        "step_key",
        "trajectory_uid",
        "kind",
        "value_number",
        "value_text",
        "source",
        "judge",
        "judge_version",
        "created_at",
        "received_at",
    ),
)
if facts is not None:
    mine = facts.filter(
        (pl.col("step_key") == key) | (pl.col("trajectory_uid") == step["trajectory_uid"])
    )
    st.dataframe(mine.sort("created_at"), hide_index=True, width="stretch")
    judged = judge_rewards(facts)
    if judged.height:
        st.subheader("Rewards by judge (`claw rescore`)")
        here = judged.filter(pl.col("step_key") == key).select("judge_label", "reward")
        if here.height:
            st.dataframe(here.transpose(column_names="judge_label"), hide_index=True)
        else:
            st.caption("no judge has scored this step")
        st.caption("How often two judge versions agree, on the steps both scored")
        st.dataframe(judge_agreement(facts), hide_index=True)

st.subheader("Lineage: the bronze record")
st.dataframe(data.bronze_event(at, versions[BRONZE_EVENTS], step["event_id"]), hide_index=True)

st.subheader("Trajectory timeline")
turns = steps.filter(pl.col("trajectory_uid") == step["trajectory_uid"]).sort("step_index")
timeline = turns.select(
    "step_index", "created_at", "prompt_len", "response_len", "reward", "fragment"
).to_pandas()
st.altair_chart(
    alt.Chart(timeline)
    .mark_circle(size=120)
    .encode(
        alt.X("created_at:T", title="acknowledged at", axis=alt.Axis(format="%H:%M:%S")),
        alt.Y("step_index:O", title="step (turn)"),
        alt.Size("response_len:Q", title="response tokens"),
        alt.Color("fragment:N", title="fragment"),
        tooltip=list(timeline.columns),
    ),
    width="stretch",
)

st.subheader("Fragments of this trajectory")
fragments = data.trajectory_fragments(turns)
st.caption(
    f"{fragments.height} fragment(s): a turn whose prompt does not extend the previous turn's "
    "prompt + response starts a new one, and says why (history_rewritten: earlier turns "
    "summarized, trimmed or edited; history_truncated: back to an earlier turn; "
    "reply_retokenized: the reply was encoded again from its text). Returns and advantages "
    "cover the whole trajectory; prefix trees share only the tokens a fragment really repeats."
)
st.dataframe(fragments, hide_index=True, width="stretch")
per_trajectory = data.fragments_per_trajectory(steps)
if per_trajectory.height > 1:
    st.caption("Trajectories by their number of fragments, and why their fragments started")
    st.dataframe(per_trajectory, hide_index=True)

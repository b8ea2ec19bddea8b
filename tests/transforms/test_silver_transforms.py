"""Silver's pure transforms on crafted frames: prefix hashing, stitching, reward resolution,
trajectory status, duplicate/conflict splitting."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from claw_pipelines.transforms.feedback import resolve_rewards, reward_by_policy_version
from claw_pipelines.transforms.hashing import (
    content_hashes,
    list_parts,
    prefix_hashes,
    sequence_hash,
    slice_content_hashes,
)
from claw_pipelines.transforms.steps import (
    renumber_clashes,
    split_duplicates,
    with_content_ids,
)
from claw_pipelines.transforms.stitching import StitchInput, stitch
from claw_pipelines.transforms.trajectories import trajectory_statuses

TOKENS = pl.List(pl.Int32)
T0 = datetime(2026, 11, 30, tzinfo=UTC)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=12), min_size=1, max_size=8))
def test_prefix_hashes_equal_the_hash_of_every_prefix(sequences):
    offsets, values, _ = list_parts(pa.array(sequences, pa.list_(pa.int32())))
    hashes = prefix_hashes(values, offsets)
    expected = [sequence_hash(seq[: k + 1]) for seq in sequences for k in range(len(seq))]
    assert [int(h) for h in hashes] == expected


def test_content_hashes_are_stable_and_tell_sequences_apart():
    lists = pa.array([[1, 2, 3], [1, 2, 3], [3, 2, 1], None, []], pa.list_(pa.int32()))
    ids = content_hashes(lists).to_pylist()
    assert ids[0] == ids[1] != ids[2]
    assert ids[3] is None and ids[4] is not None
    # BLAKE2b-128 of the little-endian int32 bytes: the same on every machine and version
    assert ids[0] == "b30a3c159d7e8193559a42a84f1fcae1"
    many = pa.array([[i, i + 1] for i in range(5000)], pa.list_(pa.int32()))
    assert len(set(content_hashes(many).to_pylist())) == 5000  # threaded path, in order


def calls(rows):
    """(tenant, received_us, prompt, response, own uid) → the calls frame of `stitch`."""
    tenant, received, prompt, response, uid = zip(*rows, strict=True)
    return with_content_ids(
        pl.DataFrame(
            {
                "tenant": tenant,
                "received_us": received,
                "prompt_ids": pl.Series(prompt, dtype=TOKENS),
                "response_ids": pl.Series(response, dtype=TOKENS),
                "trajectory_uid": uid,
            }
        )
    )


def anchors(rows, step_index, has_successor):
    """Placed steps as `stitch` sees them: hashes, content ids and lengths, no tokens."""
    frame = calls(rows)
    pairs = zip(frame["prompt_ids"].to_list(), frame["response_ids"].to_list(), strict=True)
    sequences = [p + r for p, r in pairs]
    hashes = np.array([sequence_hash(s) for s in sequences], dtype=np.uint64).view(np.int64)
    return frame.select(
        "tenant", "received_us", "trajectory_uid", "prompt_id", "response_id"
    ).with_columns(
        seq_len=pl.Series([len(s) for s in sequences], dtype=pl.Int64),
        prompt_len=frame["prompt_ids"].list.len().cast(pl.Int64),
        sequence_hash=pl.Series(hashes),
        step_index=pl.Series(step_index, dtype=pl.Int64),
        has_successor=pl.Series(has_successor, dtype=pl.Boolean),
    )


def no_anchors():
    return anchors([("t", 0, [0], [0], "x")], [0], [False]).clear()


def placed(frame):
    return list(zip(frame["trajectory_uid"], frame["step_index"], strict=True))


def test_interleaved_conversations_are_stitched_in_turn_order():
    frame = calls(
        [
            ("t", 1, [1, 2], [3], "a"),  # conversation A turn 0
            ("t", 2, [7, 8], [9], "b"),  # conversation B turn 0
            ("t", 3, [1, 2, 3, 4], [5], "c"),  # A turn 1
            ("t", 4, [7, 8, 9, 4], [6], "d"),  # B turn 1
            ("t", 5, [1, 2, 3, 4, 5, 6], [7], "e"),  # A turn 2
            ("u", 6, [1, 2, 3, 4], [5], "f"),  # another tenant: never joins A
        ]
    )
    result = stitch(StitchInput(frame, no_anchors(), window_us=10**9))
    assert placed(result) == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("f", 0)]
    assert result["continues"].to_list() == [None, None, "a:0", "b:0", "a:1", None]


def test_the_longest_match_is_the_parent_and_the_window_bounds_it():
    frame = calls(
        [
            ("t", 0, [1], [2], "a"),
            ("t", 10, [1, 2, 3], [4], "b"),
            ("t", 20, [1, 2, 3, 4, 5], [6], "c"),  # starts with both a and b: b is longer
            ("t", 500, [1, 2, 3, 4, 5, 6, 7], [8], "d"),  # c is too long ago
        ]
    )
    result = stitch(StitchInput(frame, no_anchors(), window_us=100))
    assert placed(result) == [("a", 0), ("a", 1), ("a", 2), ("d", 0)]


def test_a_parent_keeps_one_continuation_and_anchors_continue_across_runs():
    frame = calls(
        [
            ("t", 5, [1, 2, 3], [4], "retry-1"),
            ("t", 6, [1, 2, 3], [5], "retry-2"),  # same parent as retry-1: starts anew
            ("t", 7, [9, 9, 9], [1], "n"),  # continues an anchor that has a successor
        ]
    )
    placed_before = [("t", 1, [1], [2], "a"), ("t", 2, [9, 9], [9], "z"), ("t", 3, [5], [5], "q")]
    meta = anchors(placed_before, [3, 0, 0], [False, True, False])
    result = stitch(StitchInput(frame, meta, window_us=10**9))
    assert placed(result) == [("a", 4), ("retry-2", 0), ("n", 0)]
    assert result["head_anchor"].to_list() == [0, -1, -1]


def test_a_reply_with_no_tokens_is_never_a_parent():
    frame = calls(
        [
            ("t", 1, [1, 2], [], "empty"),  # a cut stream's choice that got nothing
            ("t", 2, [1, 2], [3], "rollout"),  # another rollout of the same prompt
            ("t", 3, [1, 2, 3], [4], "turn"),  # continues the rollout, not the empty reply
        ]
    )
    placed_before = [("t", 0, [1, 2], [], "old-empty")]  # an empty reply from an earlier run
    meta = anchors(placed_before, [0], [False])
    result = stitch(StitchInput(frame, meta, window_us=10**9))
    assert placed(result) == [("empty", 0), ("rollout", 0), ("rollout", 1)]
    assert result["head_anchor"].to_list() == [-1, -1, -1]


def test_a_rolling_hash_match_with_other_tokens_is_refused():
    frame = calls([("t", 5, [1, 2, 3], [4], "c")])
    forged = anchors([("t", 1, [1], [2], "a")], [0], [False]).with_columns(
        prompt_id=pl.lit("0" * 32)  # same rolling hash and length, other content
    )
    assert placed(stitch(StitchInput(frame, forged, window_us=10**9))) == [("c", 0)]


def stepframe(rows):
    """(step_key, tenant, origin_step_key) rows as a steps frame."""
    keys, tenants, origins = zip(*rows, strict=True)
    traj = [k.rsplit(":", 1)[0] for k in keys]
    index = [int(k.rsplit(":", 1)[1]) for k in keys]
    return pl.DataFrame(
        {
            "step_key": keys,
            "trajectory_uid": traj,
            "step_index": index,
            "tenant": tenants,
            "origin_step_key": pl.Series(origins, dtype=pl.String),
            "prompt_uid": ["g"] * len(keys),
            "policy_version": [1] * len(keys),
            "created_at": [T0 + timedelta(seconds=i) for i in range(len(keys))],
            "is_last": [False] * len(keys),
        }
    )


def facts(rows):
    """(id, step_key, trajectory_uid, kind, number, text, tenant, seconds) rows."""
    cols = ["feedback_id", "step_key", "trajectory_uid", "kind", "value_number", "value_text"]
    frame = pl.DataFrame(
        [r[:6] for r in rows],
        schema={
            "feedback_id": pl.String,
            "step_key": pl.String,
            "trajectory_uid": pl.String,
            "kind": pl.String,
            "value_number": pl.Float64,
            "value_text": pl.String,
        },
        orient="row",
    ).select(cols)
    return frame.with_columns(
        tenant=pl.Series([r[6] for r in rows]),
        created_at=pl.Series([T0 + timedelta(seconds=r[7]) for r in rows]),
        received_at=pl.Series([T0 + timedelta(seconds=r[7]) for r in rows]),
        source=pl.lit("test"),
    )


def resolved(steps, fact_frame, statuses=None, reward_to="last"):
    if statuses is None:
        statuses = trajectory_statuses(steps, fact_frame, clock_us=0, idle_us=10**12)
    frame = resolve_rewards(steps, fact_frame, statuses, reward_to)
    return {r["step_key"]: r for r in frame.to_dicts()}


def test_latest_reward_fact_wins_and_trajectory_rewards_go_to_the_last_step():
    steps = stepframe([("t:0", "a", None), ("t:1", "a", None), ("u:0", "a", None)])
    given_facts = facts(
        [
            ("f1", "t:0", None, "reward", 0.2, None, "a", 5),
            ("f2", "t:0", None, "reward", 0.9, None, "a", 3),  # arrived later, given earlier
            ("f3", None, "t", "reward", 1.0, None, "a", 1),
            ("f4", None, "t", "rating", 4.0, None, "a", 2),
            ("f5", "t:1", None, "label", None, "helpful", "a", 2),
            ("f6", "t:1", None, "label", None, "concise", "a", 3),
        ]
    )
    by_key = resolved(steps, given_facts)
    assert by_key["t:0"]["reward"] == 0.2 and by_key["t:0"]["reward_feedback_id"] == "f1"
    assert by_key["t:1"]["reward"] == 1.0 and by_key["t:1"]["reward_target"] == "trajectory"
    assert by_key["t:0"]["num_reward_facts"] == 2
    assert by_key["t:0"]["rating"] == 4.0 and by_key["t:1"]["rating"] == 4.0
    assert by_key["t:1"]["labels"] == ["concise", "helpful"]
    assert by_key["u:0"]["reward"] is None and by_key["u:0"]["reward_status"] == "pending"
    every = resolved(steps, given_facts.filter(pl.col("feedback_id") == "f3"), reward_to="every")
    assert every["t:0"]["reward"] == every["t:1"]["reward"] == 1.0


def test_feedback_never_crosses_tenants_and_follows_stitched_keys():
    steps = stepframe([("s:0", "a", "call-1:0"), ("s:1", "a", "call-2:0")])
    given_facts = facts(
        [
            ("f1", "call-2:0", None, "reward", 1.0, None, "a", 1),  # the key the client saw
            ("f2", "s:0", None, "reward", 5.0, None, "b", 1),  # another tenant: ignored
            ("f3", None, "call-1", "completion", None, "complete", "a", 2),
        ]
    )
    statuses = trajectory_statuses(steps, given_facts, clock_us=0, idle_us=10**12)
    assert statuses["status"].to_list() == ["complete"]
    by_key = resolved(steps, given_facts, statuses)
    assert by_key["s:1"]["reward"] == 1.0 and by_key["s:1"]["reward_status"] == "final"
    assert by_key["s:0"]["reward"] is None and by_key["s:0"]["reward_status"] == "missing"


def test_reward_by_policy_version_averages_the_final_rewards_of_each_version():
    steps = stepframe([("a:0", "t", None), ("a:1", "t", None), ("b:0", "t", None)])
    steps = steps.with_columns(policy_version=pl.Series([1, 1, 2]))
    given_facts = facts(
        [
            ("f1", None, "a", "reward", 0.5, None, "t", 1),  # a's last step; a:0 missing
            ("f2", None, "a", "completion", None, "complete", "t", 2),
            ("f3", "b:0", None, "reward", 1.0, None, "t", 3),
        ]
    )
    rewards = pl.DataFrame(list(resolved(steps, given_facts).values()))
    joined = steps.join(rewards.select("step_key", "reward", "reward_status"), on="step_key")
    by_version = reward_by_policy_version(joined)
    assert by_version.select("policy_version", "steps", "rewarded", "mean_reward").rows() == [
        (1, 2, 1, 0.5),
        (2, 1, 1, 1.0),
    ]
    unversioned = joined.with_columns(policy_version=pl.lit(None, pl.Int64))
    assert reward_by_policy_version(unversioned).is_empty()


def test_trajectory_status_open_complete_abandoned():
    steps = stepframe([("open:0", "a", None), ("idle:0", "a", None), ("last:0", "a", None)])
    steps = steps.with_columns(
        created_at=pl.Series([T0 + timedelta(hours=2), T0, T0]),
        is_last=pl.Series([False, False, True]),
    )
    given_facts = facts([("f", None, "x", "completion", None, "abandoned", "a", 0)]).clear()
    clock = int((T0 + timedelta(hours=2)).timestamp() * 1e6)
    statuses = trajectory_statuses(steps, given_facts, clock_us=clock, idle_us=3600 * 10**6)
    status = dict(zip(statuses["trajectory_uid"], statuses["status"], strict=True))
    assert status == {"open": "open", "idle": "abandoned", "last": "complete"}


def test_duplicates_are_dropped_and_conflicts_kept_out_first_received_wins():
    stored = pl.DataFrame(
        {"step_key": ["k:0"], "event_id": ["e0"], "prompt_id": ["p"], "response_id": ["r"]}
    )
    candidates = pl.DataFrame(
        {
            "step_key": ["k:0", "k:1", "k:0", "k:1", "k:1"],
            "event_id": ["e1", "e5", "e2", "e3", "e4"],
            "prompt_id": ["p", "q", "p", "q", "q"],
            "response_id": ["r", "Y", "X", "s", "s"],
            "received_at": [T0 + timedelta(seconds=s) for s in (1, 5, 2, 3, 4)],
        }
    )
    keep, conflicts, duplicates = split_duplicates(candidates, stored)
    assert candidates.filter(pl.Series(keep))["event_id"].to_list() == ["e3"]
    assert dict(zip(conflicts["event_id"], conflicts["kept_event_id"], strict=True)) == {
        "e2": "e0",  # differs from the stored step
        "e5": "e3",  # differs from the first received candidate
    }
    assert duplicates == 2  # e1 (same as stored e0) and e4 (same as e3)


def test_a_proxied_call_given_a_taken_key_gets_its_own_and_white_box_steps_stay_conflicts():
    """The gateway numbers scoped proxied steps: another call under a taken key is renumbered
    to the microsecond it arrived (the holder, stored or first received, keeps the key); the
    same event again is left to dedup, and a white-box step's key stays its client's."""
    at = [T0 + timedelta(seconds=s) for s in (1, 2, 3, 4, 5, 6)]
    candidates = pl.DataFrame(
        {
            "step_key": ["t:0", "t:1", "t:1", "t:0", "w:0", "u:0"],
            "event_id": ["e1", "e2", "e3", "e0", "e5", "e6"],
            "trajectory_uid": ["t", "t", "t", "t", "w", "u"],
            "step_index": [0, 1, 1, 0, 0, 0],
            "received_at": at,
            "received_us": [int(t.timestamp() * 1e6) for t in at],
            "source_kind": ["proxy", "claw_r1", "proxy", "proxy", "white_box", "proxy"],
            "unscoped": [False, False, False, False, False, True],
            "metadata": ['{"scoped":true}', "{}", "{}", "{}", "{}", "{}"],
        }
    )
    stored = pl.DataFrame({"step_key": ["t:0", "w:0", "u:0"], "event_id": ["e0", "e9", "e8"]})
    placed, moved = renumber_clashes(candidates, stored)
    assert moved == 2
    us = candidates["received_us"].to_list()
    assert placed["step_key"].to_list() == [
        f"t:{us[0]}",  # t:0 is stored (e0): a second call under it
        "t:1",  # the first received of t:1 keeps it
        f"t:{us[2]}",
        "t:0",  # the stored step's own event again: dedup drops it later
        "w:0",  # white-box: the client's key (a conflict or a duplicate, as before)
        "u:0",  # unscoped: stitching gave its key
    ]
    assert placed["step_index"].to_list()[:3] == [us[0], 1, us[2]]
    assert placed["metadata"].to_list()[:3] == [
        '{"renumbered_from":"t:0","scoped":true}',
        "{}",
        '{"renumbered_from":"t:1"}',
    ]
    assert renumber_clashes(placed, stored)[1] == 0  # the new keys are free


def test_stitching_is_hash_joined_not_quadratic():
    rng = np.random.default_rng(0)
    rows, now = [], 0
    for conversation in range(400):  # 400 conversations x 5 turns, interleaved in time
        history = list(rng.integers(0, 50_000, 200))
        for turn in range(5):
            response = list(rng.integers(0, 50_000, 20))
            rows.append(
                (
                    "t",
                    now + turn * 1000 + conversation,
                    history,
                    response,
                    f"c{conversation}-{turn}",
                )
            )
            history = history + response + list(rng.integers(0, 50_000, 10))
    frame = calls(sorted(rows, key=lambda r: r[1]))
    result = stitch(StitchInput(frame, no_anchors(), window_us=10**9))
    assert result["trajectory_uid"].n_unique() == 400
    by_traj = result.group_by("trajectory_uid").agg(pl.col("step_index").sort())
    assert all(steps == [0, 1, 2, 3, 4] for steps in by_traj["step_index"].to_list())


def test_slice_hashes_equal_the_hash_of_the_slice_and_null_when_out_of_range():
    lists = pa.array([[1, 2, 3, 4], [5, 6], None], pa.list_(pa.int32()))
    start, stop = np.array([1, 0, 0]), np.array([3, 3, 1])
    sliced = slice_content_hashes(lists, start, stop).to_pylist()
    assert sliced[0] == content_hashes(pa.array([[2, 3]], pa.list_(pa.int32()))).to_pylist()[0]
    assert sliced[1] is None and sliced[2] is None  # row too short, null row

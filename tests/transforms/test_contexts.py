"""Prompts stored relative to earlier steps (transforms.contexts, docs/DESIGN.md §18): forks,
retries, compaction, truncation, retokenized replies and aborted steps are encoded against
at-hand and stored steps alike and decode to exactly the prompts they were, in any row order,
mixed with rows of the layout before, and with missing steps fetched."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from claw_pipelines.transforms.contexts import (
    REFERENCE_COLUMNS,
    BrokenReference,
    decode_prompts,
    encode_prompts,
    full_layout,
    prompt_content_ids,
    token_matches,
    with_prompt_ids,
)
from claw_pipelines.transforms.hashing import content_hashes
from claw_pipelines.transforms.steps import with_content_ids

TOKENS = pl.List(pl.Int32)


def frame(rows: list[dict]) -> pl.DataFrame:
    steps = pl.DataFrame(rows, schema_overrides={"prompt_ids": TOKENS, "response_ids": TOKENS})
    return with_content_ids(steps).with_columns(
        prompt_len=pl.col("prompt_ids").list.len().cast(pl.Int64),
        response_len=pl.col("response_ids").list.len().cast(pl.Int64),
    )


def trajectory(uid: str, rng: np.random.Generator, scale: int = 1) -> list[dict]:
    """Turns of one agent: nested turns, a call with two choices and a retry, a turn after
    the second choice, an aborted generation, a reply sent back as text (retokenized), a
    compaction (history rewritten), a truncation, then nested turns again. Each piece holds
    `scale` times a few tokens."""
    rows: list[dict] = []

    def add(prompt: list[int], response: list[int], finish: str = "stop") -> None:
        rows.append(
            {
                "step_key": f"{uid}:{len(rows)}",
                "trajectory_uid": uid,
                "step_index": len(rows),
                "prompt_ids": prompt,
                "response_ids": response,
                "finish_reason": finish,
            }
        )

    def ids(n: int) -> list[int]:
        return rng.integers(0, 500, n * scale).tolist()

    system = ids(6)
    history = [*system, *ids(4)]
    for _ in range(3):  # nested turns
        reply = ids(3)
        add(history, reply)
        history = [*history, *reply, *ids(2)]
    first, second = ids(3), ids(2)
    add(history, first)  # n = 2: two choices of one call
    add(history, second)
    add(history, first)  # a retry of the same call
    history = [*history, *second, *ids(2)]  # the agent went on with the second choice
    add(history, ids(4), finish="abort")  # aborted: never referred to
    reply = ids(3)
    add(history, reply)
    add([*history, reply[0] + 1000, *reply[1:], *ids(1)], ids(2))  # reply retokenized
    kept_turn = len(rows) - 1
    compacted = [*system, *ids(5)]  # history rewritten: only the system prompt repeats
    add(compacted, ids(3))
    truncated = [*rows[kept_turn]["prompt_ids"], *rows[kept_turn]["response_ids"], *ids(2)]
    add(truncated, ids(2))  # continues an earlier turn: the turns after it were dropped
    history = [*truncated, *rows[-1]["response_ids"], *ids(3)]
    for _ in range(2):
        reply = ids(2)
        add(history, reply)
        history = [*history, *reply, *ids(1)]
    return rows


@pytest.fixture(params=[1, 700], ids=["short", "long"])
def steps(request) -> pl.DataFrame:
    """Three agents' turns: of a few tokens a piece, or of thousands (ranges compared and
    copied whole)."""
    rng = np.random.default_rng(5)
    return frame([row for uid in ("a", "b", "c") for row in trajectory(uid, rng, request.param)])


def encoded_in_runs(steps: pl.DataFrame, cut: int) -> pl.DataFrame:
    """Steps encoded in two runs: those of index < cut first, then the rest against them as
    stored (their content ids only)."""
    first = steps.filter(pl.col("step_index") < cut)
    rest = steps.filter(pl.col("step_index") >= cut)
    return pl.concat(
        [
            encode_prompts(first, first.clear().select(REFERENCE_COLUMNS)),
            encode_prompts(rest, first.select(REFERENCE_COLUMNS)),
        ]
    )


@pytest.mark.parametrize("cut", [0, 4, 8, 11])
def test_prompts_decode_exactly_whatever_the_runs_and_row_order(steps, cut):
    stored = encoded_in_runs(steps, cut)
    assert stored["prompt_ids"].null_count() == stored.height  # never mistaken for the prompt
    expected = dict(zip(steps["step_key"], steps["prompt_ids"].to_list(), strict=True))
    for seed in range(3):
        shuffled = stored.sample(fraction=1.0, shuffle=True, seed=seed)
        decoded = decode_prompts(shuffled)
        assert decoded.dtype == TOKENS
        assert dict(zip(shuffled["step_key"], decoded.to_list(), strict=True)) == expected
    # the same references whether the earlier steps were at hand or stored
    alone = encode_prompts(steps, steps.clear().select(REFERENCE_COLUMNS))
    assert (
        stored.sort("step_key")
        .select("prefix_step_key", "prefix_len")
        .equals(alone.sort("step_key").select("prefix_step_key", "prefix_len"))
    )


def test_only_new_tokens_are_stored_and_references_follow_the_turns(steps):
    stored = encode_prompts(steps, steps.clear().select(REFERENCE_COLUMNS)).filter(
        pl.col("trajectory_uid") == "a"
    )
    refs = dict(zip(stored["step_key"], stored["prefix_step_key"], strict=True))
    lengths = dict(zip(stored["step_key"], stored["prefix_len"], strict=True))
    assert refs["a:0"] is None  # the first turn: all of its prompt is new
    assert refs["a:1"] == "a:0" and refs["a:2"] == "a:1"  # nested turns: the previous one
    assert refs["a:4"] == "a:3" and lengths["a:4"] == stored["prompt_len"][3]  # a second choice
    assert stored["prompt_suffix_ids"][4].to_list() == []  # shares its call's prompt, adds none
    assert refs["a:7"] in {"a:4", "a:5"}  # after the aborted a:6, the call before it
    assert "a:6" not in refs.values()  # an aborted step may be absorbed later: never referred to
    retokenized = stored.row(8, named=True)
    assert retokenized["prefix_step_key"] == "a:7"  # keeps the previous prompt, not its reply
    assert retokenized["prefix_len"] == stored["prompt_len"][7]
    assert refs["a:9"] is None  # history rewritten: nothing before it is its prefix...
    assert refs["a:10"] is None  # ...and the call before a truncation is the compacted one
    assert refs["a:11"] == "a:10" and refs["a:12"] == "a:11"
    new_tokens = stored["prompt_suffix_ids"].list.len().sum() + stored["response_len"].sum()
    sent = stored["prompt_len"].sum() + stored["response_len"].sum()
    assert new_tokens < sent / 2


def test_rows_of_the_layout_before_and_fetched_steps_decode_too(steps):
    stored = encode_prompts(steps, steps.clear().select(REFERENCE_COLUMNS))
    old = steps.filter(pl.col("step_index") < 5).with_columns(  # written before the layout
        prefix_step_key=pl.lit(None, pl.String),
        prefix_len=pl.lit(None, pl.Int64),
        prompt_suffix_ids=pl.lit(None, TOKENS),
    )
    later = steps.filter(pl.col("step_index") >= 5)
    mixed = pl.concat(
        [old, encode_prompts(later, old.select(REFERENCE_COLUMNS))], how="diagonal_relaxed"
    )
    assert mixed.filter(pl.col("step_index") == 5)["prefix_step_key"].to_list() == [
        "a:4",
        "b:4",
        "c:4",
    ]  # a new step refers to a step stored whole (the nearest of its call's)
    whole = with_prompt_ids(mixed).sort("step_key")
    assert whole["prompt_ids"].to_list() == steps.sort("step_key")["prompt_ids"].to_list()
    assert not {"prefix_step_key", "prefix_len", "prompt_suffix_ids"} & set(whole.columns)

    asked = stored.filter(pl.col("step_key").is_in(["a:12", "c:3"]))
    fetches = []

    def fetch(wanted: pl.DataFrame) -> pl.DataFrame:
        fetches.append(wanted["trajectory_uid"].unique().sort().to_list())
        return stored.filter(pl.col("trajectory_uid").is_in(wanted["trajectory_uid"].implode()))

    decoded = decode_prompts(asked, fetch, ("trajectory_uid",))
    assert fetches == [["a", "c"]]  # one read of their trajectories, not one per level
    expected = steps.filter(pl.col("step_key").is_in(["a:12", "c:3"]))["prompt_ids"]
    assert decoded.to_list() == expected.to_list()
    assert full_layout(steps)["prompt_suffix_ids"].to_list() == steps["prompt_ids"].to_list()


def test_a_reference_that_cannot_be_resolved_is_an_error(steps):
    stored = encode_prompts(steps, steps.clear().select(REFERENCE_COLUMNS))
    with pytest.raises(BrokenReference, match="a:12 refers to a:11"):
        decode_prompts(stored.filter(pl.col("step_key") == "a:12"))
    too_long = stored.with_columns(
        prefix_len=pl.when(pl.col("step_key") == "a:1").then(10_000).otherwise("prefix_len")
    )
    with pytest.raises(BrokenReference, match="fewer"):
        decode_prompts(too_long)


def test_prompt_content_ids_hash_only_new_tokens_and_equal_whole_hashes():
    """Long turns are hashed on from the step before them (its prompt, or prompt + reply,
    compared token for token); the ids are those of each prompt hashed whole, whatever the
    row order, for forks, a rewritten history and rows of other trajectories between."""
    rng = np.random.default_rng(11)
    rows, history = [], rng.integers(0, 9_000, 5_000).tolist()
    for turn in range(6):
        reply = rng.integers(0, 9_000, 50).tolist()
        rows.append({"trajectory_uid": "long", "step_index": turn, "prompt_ids": history})
        rows[-1]["response_ids"] = reply
        if turn == 2:  # a second choice of the same call: begins with its prompt only
            rows.append({"trajectory_uid": "long", "step_index": 100 + turn, "prompt_ids": history})
            rows[-1]["response_ids"] = [1]
        if turn == 4:  # the history rewritten: hashed whole
            history = [7, *history[1:]]
        history = [*history, *reply, *rng.integers(0, 9_000, 30).tolist()]
    rows.append({"trajectory_uid": "short", "step_index": 0, "prompt_ids": [1, 2]})
    rows[-1]["response_ids"] = [3]
    steps = pl.DataFrame(
        rows, schema_overrides={"prompt_ids": TOKENS, "response_ids": TOKENS}
    ).sample(fraction=1.0, shuffle=True, seed=2)
    whole = content_hashes(steps["prompt_ids"].to_arrow()).to_pylist()
    assert prompt_content_ids(steps).to_pylist() == whole
    assert with_content_ids(steps)["prompt_id"].to_list() == whole


def test_token_matches_agree_with_comparing_slices_token_for_token():
    """Long ranges (one memcmp each) and short ones (compared in chunks) give the answer of
    slicing both sequences and comparing them, including prompts too short to hold one."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 6_000, 60)
    lengths[::7] = 0
    prompts = [rng.integers(0, 50, n).astype(np.int32) for n in lengths]
    responses = [rng.integers(0, 50, n).astype(np.int32) for n in rng.integers(0, 3_000, 60)]
    rows = rng.integers(0, 60, 400)
    c_rows = rng.integers(0, 60, 400)
    for i in range(0, 400, 2):  # half the pairs continue their candidate (prompt + reply, cut)
        whole = np.concatenate([prompts[c_rows[i]], responses[c_rows[i]]])
        more = rng.integers(0, 50, 40).astype(np.int32)  # a whole turn and new tokens, or cut
        cut = whole[: rng.integers(len(whole) // 2, len(whole) + 1)]
        prompts.append(np.concatenate([whole, more]) if i % 4 else cut)
        responses.append(responses[0])
        rows[i] = len(prompts) - 1
    cp = np.array([len(prompts[c]) for c in c_rows])
    cr = np.array([len(responses[c]) for c in c_rows])
    cp[::11] += 5  # a stated length past what the candidate holds

    def parts(seqs):
        offsets = np.r_[0, np.cumsum([len(s) for s in seqs])].astype(np.int64)
        return offsets, np.concatenate(seqs)

    head, tail = token_matches(parts(prompts), parts(responses), rows, c_rows, cp, cr)
    for k, (r, c) in enumerate(zip(rows.tolist(), c_rows.tolist(), strict=True)):
        own, theirs = prompts[r], np.concatenate([prompts[c], responses[c]])
        fits = cp[k] <= len(own) and cp[k] <= len(prompts[c])
        expect_head = fits and np.array_equal(own[: cp[k]], prompts[c][: cp[k]])
        n = cp[k] + cr[k]
        expect_tail = expect_head and n <= len(own) and np.array_equal(own[:n], theirs[:n])
        assert head[k] == expect_head, k
        assert tail[k] == expect_tail, k
    assert head.sum() > 100 and tail.sum() > 50 and (~head).sum() > 50

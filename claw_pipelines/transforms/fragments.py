"""Fragments of a trajectory: where an agent's history stops extending itself (docs/DESIGN.md §13).

An agent resends its whole conversation each turn, so a turn's prompt normally starts with its
previous turn's prompt + response ids. One that summarizes, trims or edits its history (context
compaction) sends a prompt that does not: that turn starts a new FRAGMENT of the same
trajectory. Each step gets `fragment` (0 for the first, counting up at every break) and
`fragment_reason` (null, or why the turn starts a fragment):

- `reply_retokenized`: the prompt keeps the previous turn's prompt but not its reply's ids (the
  reply was sent back as text and encoded again: the drift token-in prevents);
- `history_truncated`: the prompt repeats an earlier turn's prompt, or continues an earlier
  turn's prompt + response (the turns after it were dropped);
- `history_rewritten`: anything else (earlier turns summarized, trimmed, edited or replaced).

A trajectory's turns are its calls: runs of consecutive steps (by `step_index`) with the same
prompt, i.e. the choices of one call (n > 1) or a call and its retries. A call is judged
against its previous call (any choice of it); all its steps share a fragment and reason.

Decided on small columns and content hashes: the new steps' prompts are sliced and hashed
(BLAKE2b) against the earlier steps' content ids (`prompt_id`, `response_id`) and lengths, so
the earlier steps' tokens are never read. Steps are judged when they land, against the steps of
their trajectory silver holds by then (the gateway numbers a scoped trajectory's calls in the
order it records them, so a turn's predecessor has landed before it or with it).
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.transforms.contexts import REFERENCE_COLUMNS, token_matches
from claw_pipelines.transforms.hashing import list_parts, slice_content_hashes

REPLY_RETOKENIZED = "reply_retokenized"
HISTORY_TRUNCATED = "history_truncated"
HISTORY_REWRITTEN = "history_rewritten"
FRAGMENT_REASONS = (REPLY_RETOKENIZED, HISTORY_TRUNCATED, HISTORY_REWRITTEN)
# the reasons that mean the agent changed its history on purpose (not drift)
HISTORY_REASONS = (HISTORY_TRUNCATED, HISTORY_REWRITTEN)
# the small step columns fragments are decided on (beside the new steps' prompt ids)
FRAGMENT_INPUT_COLUMNS = [c for c in REFERENCE_COLUMNS if c != "finish_reason"]


def with_fragments(new: pl.DataFrame, earlier: pl.DataFrame) -> pl.DataFrame:
    """`new` steps (FRAGMENT_INPUT_COLUMNS and `prompt_ids`) with `fragment` and
    `fragment_reason`, judged against `earlier`: the stored steps of their trajectories
    (FRAGMENT_INPUT_COLUMNS, `fragment`, `fragment_reason`; none of `new`'s keys)."""
    if new.is_empty():
        return new.with_columns(
            fragment=pl.lit(None, pl.Int64), fragment_reason=pl.lit(None, pl.String)
        )
    steps = _turns(new, earlier)
    calls = _calls(steps)
    candidates = _previous_call_steps(steps, calls)
    extends, keeps_prompt = _continues(new, candidates)
    judged = candidates.select("call").with_columns(extends=extends, keeps_prompt=keeps_prompt)
    judged = judged.group_by("call").agg(pl.col("extends").any(), pl.col("keeps_prompt").any())
    calls = calls.join(judged, on="call", how="left")
    broken = calls.filter(pl.col("extends").not_() & pl.col("keeps_prompt").not_())
    truncated = _continue_earlier_turns(new, steps, broken)
    calls = calls.with_columns(
        truncated=pl.col("call").is_in(truncated.implode()),
        broke=(pl.col("extends").not_() & pl.col("judge")).fill_null(False),
    )
    reason = (
        pl.when(pl.col("has_stored"))
        .then(pl.col("stored_reason"))
        .when(~pl.col("broke"))
        .then(pl.lit(None, pl.String))
        .when(pl.col("keeps_prompt"))
        .then(pl.lit(REPLY_RETOKENIZED))
        .when(pl.col("truncated"))
        .then(pl.lit(HISTORY_TRUNCATED))
        .otherwise(pl.lit(HISTORY_REWRITTEN))
    )
    # a stored call keeps its number; new calls count their breaks on from the last stored one
    since_stored = pl.col("has_stored").cum_sum().over("trajectory_uid")
    base = (
        pl.when(pl.col("has_stored"))
        .then(pl.col("stored_fragment"))
        .forward_fill()
        .over("trajectory_uid")
        .fill_null(0)
    )
    breaks = pl.col("broke").cast(pl.Int64).cum_sum().over("trajectory_uid", since_stored)
    fragment = (
        pl.when(pl.col("has_stored")).then(pl.col("stored_fragment")).otherwise(base + breaks)
    )
    decided = calls.select("call", fragment=fragment, fragment_reason=reason)
    fresh = steps.filter(pl.col("row").is_not_null()).select("row", "call")
    placed = fresh.join(decided, on="call").sort("row")
    return new.with_columns(
        fragment=placed["fragment"].cast(pl.Int64),
        fragment_reason=placed["fragment_reason"].cast(pl.String),
    )


def _turns(new: pl.DataFrame, earlier: pl.DataFrame) -> pl.DataFrame:
    """New and stored steps in trajectory and index order, numbered into calls (`call`); `row`
    indexes `new` (null for stored steps)."""
    stored = earlier.select(
        *FRAGMENT_INPUT_COLUMNS,
        row=pl.lit(None, pl.Int64),
        fragment=pl.col("fragment").cast(pl.Int64).fill_null(0),  # steps before fragments: 0
        fragment_reason=pl.col("fragment_reason").cast(pl.String),
    )
    fresh = new.select(FRAGMENT_INPUT_COLUMNS).with_columns(
        row=pl.int_range(pl.len(), dtype=pl.Int64),
        fragment=pl.lit(None, pl.Int64),
        fragment_reason=pl.lit(None, pl.String),
    )
    steps = pl.concat([stored, fresh], how="vertical_relaxed").sort("trajectory_uid", "step_index")
    trajectory, prompt = pl.col("trajectory_uid"), pl.col("prompt_id")
    starts = trajectory.ne_missing(trajectory.shift(1)) | prompt.ne_missing(prompt.shift(1))
    return steps.with_columns(call=starts.cum_sum().cast(pl.Int64))


def _calls(steps: pl.DataFrame) -> pl.DataFrame:
    """One row per call: its first new step (`row`), whether silver holds some of its steps
    (then their fragment and reason are the call's), and whether it is to be judged (new, with
    a previous call in its trajectory)."""
    stored = pl.col("row").is_null()
    calls = steps.group_by("call", maintain_order=True).agg(
        pl.col("trajectory_uid").first(),
        pl.col("row").drop_nulls().first(),
        pl.col("prompt_id").first(),
        has_stored=stored.any(),
        stored_fragment=pl.col("fragment").filter(stored).first(),
        stored_reason=pl.col("fragment_reason").filter(stored).first(),
    )
    follows = pl.col("trajectory_uid").eq_missing(pl.col("trajectory_uid").shift(1))
    return calls.with_columns(judge=follows & ~pl.col("has_stored"))


def _previous_call_steps(steps: pl.DataFrame, calls: pl.DataFrame) -> pl.DataFrame:
    """(call to judge, its first new row) beside each step of its previous call."""
    judged = calls.filter("judge").select("call", "row", previous=pl.col("call") - 1)
    return judged.join(
        steps.select(
            pl.col("call").alias("previous"),
            "prompt_id",
            "response_id",
            "prompt_len",
            "response_len",
            c_row="row",
        ),
        on="previous",
    )


def _continues(new: pl.DataFrame, pairs: pl.DataFrame) -> tuple[pl.Series, pl.Series]:
    """Per pair (a new row, an earlier step): whether the row's prompt starts with the step's
    prompt + response, and whether it starts with the step's prompt at least. An earlier
    step among the new ones (`c_row`) is compared token for token, a stored one on the
    content ids of the prompt's slices."""
    rows = pairs["row"].to_numpy()
    middle = pairs["prompt_len"].to_numpy()
    stop = middle + pairs["response_len"].to_numpy()
    head = np.zeros(len(rows), dtype=bool)
    tail = np.zeros(len(rows), dtype=bool)
    at_hand = np.zeros(len(rows), dtype=bool)
    if "c_row" in pairs.columns and "response_ids" in new.columns and len(rows):
        at_hand = pairs["c_row"].is_not_null().to_numpy()
        local = np.flatnonzero(at_hand)
        if len(local):
            p_off, p_val, _ = list_parts(new["prompt_ids"].to_arrow())
            r_off, r_val, _ = list_parts(new["response_ids"].to_arrow())
            c_rows = pairs["c_row"].to_numpy()[local].astype(np.int64)
            head[local], tail[local] = token_matches(
                (p_off, p_val),
                (r_off, r_val),
                rows[local],
                c_rows,
                middle[local],
                stop[local] - middle[local],
            )
    remote = np.flatnonzero(~at_hand)
    if len(remote):
        prompts = new["prompt_ids"].to_arrow()
        ids, responses = pairs["prompt_id"].gather(remote), pairs["response_id"].gather(remote)
        start = np.zeros(len(remote), dtype=middle.dtype)
        head[remote] = _slices_match(prompts, rows[remote], start, middle[remote], ids)
        tail[remote] = _slices_match(prompts, rows[remote], middle[remote], stop[remote], responses)
    return pl.Series(head & tail), pl.Series(head)


def _continue_earlier_turns(
    new: pl.DataFrame, steps: pl.DataFrame, broken: pl.DataFrame
) -> pl.Series:
    """The broken calls whose prompt repeats an earlier turn's prompt or continues an earlier
    turn's prompt + response (an earlier call than the previous one, of any fragment)."""
    if broken.is_empty():
        return pl.Series("call", [], pl.Int64)
    earlier = steps.select(
        "trajectory_uid",
        "prompt_id",
        "response_id",
        "prompt_len",
        "response_len",
        earlier_call="call",
        c_row="row",
    )
    pairs = broken.select(
        "call", "row", "trajectory_uid", own_prompt="prompt_id", previous=pl.col("call") - 1
    ).join(earlier, on="trajectory_uid")
    pairs = pairs.filter(pl.col("earlier_call") < pl.col("previous"))
    repeats = pairs.filter(pl.col("own_prompt") == pl.col("prompt_id"))["call"]
    extends, _ = _continues(new, pairs)
    return pl.concat([repeats, pairs.filter(extends)["call"]]).unique()


def _slices_match(
    lists: pa.Array | pa.ChunkedArray,
    rows: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    ids: pl.Series,
) -> np.ndarray:
    """Per pair i: whether lists[rows[i]][start[i]:stop[i]] has the content id ids[i]. Each
    row's slices are hashed in passes (one slice per row a pass); only the rows asked for."""
    matched = np.zeros(len(rows), dtype=bool)
    if len(rows) == 0:
        return matched
    unique, local = np.unique(rows, return_inverse=True)
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    if len(unique) * 4 < len(lists):  # a few rows: copied apart, so a pass skips the rest
        lists = lists.take(pa.array(unique))
    else:  # most rows: read in place (a copy would cost what the hashing does)
        unique, local = np.arange(len(lists)), rows
    order = np.argsort(local, kind="stable")
    firsts = np.r_[0, np.flatnonzero(np.diff(local[order])) + 1]
    rank = np.empty(len(rows), dtype=np.int64)
    rank[order] = np.arange(len(rows)) - np.repeat(firsts, np.diff(np.r_[firsts, len(rows)]))
    wanted = ids.cast(pl.String)
    for r in range(int(rank.max()) + 1):
        pass_ = np.flatnonzero(rank == r)
        begin = np.full(len(unique), -1, dtype=np.int64)  # an invalid range: not hashed
        end = np.full(len(unique), -2, dtype=np.int64)
        begin[local[pass_]], end[local[pass_]] = start[pass_], stop[pass_]
        hashes = pl.Series(slice_content_hashes(lists, begin, end)).gather(local[pass_])
        matched[pass_] = (hashes == wanted.gather(pass_)).fill_null(False).to_numpy()
    return matched

"""Contexts stored once: a step's prompt kept relative to an earlier step (docs/DESIGN.md §18).

An agent resends its whole context on every call, so a turn's prompt is mostly the previous
turn's prompt + response. Silver steps and gold datasets store such a prompt as a reference
and the new tokens only:

- `prefix_step_key`: the step whose sequence (`prompt_ids + response_ids`) the prompt begins
  with (null: none; the whole prompt is new),
- `prefix_len`: how many tokens of that sequence it begins with (0 when none),
- `prompt_suffix_ids`: the prompt's tokens after them.

So prompt = (prompt + response of `prefix_step_key`)[:prefix_len] + prompt_suffix_ids, and
`prompt_ids` is null. Rows written before this layout hold their whole prompt in `prompt_ids`
(`prompt_suffix_ids` null) and read as they are. A reference names a step of the same
trajectory (silver) or of the same tree of the same partition (gold), never an aborted one
(a partial rollout may be absorbed, and leave, later): the rows a reader asks for and their
trajectory or tree resolve every reference.

Encoding (`encode_prompts`): a step's candidates are the steps of the nearest earlier call of
its trajectory (the choices of one call, a call and its retries share a prompt). The longest
of "begins with its prompt + response" and "begins with its prompt" wins (then the nearest
candidate: the choice is a function of the steps alone). A candidate whose
tokens are at hand (written in the same run) is compared token for token; a stored one on the
BLAKE2b-128 content ids of the two slices (`prompt_id`, `response_id`: stored tokens are
never read back). Decoding (`decode_prompts`) is vectorized: every prompt's length is known
up front, so one buffer is filled by range copies, the referenced prompts a level (a
reference depth) at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.transforms.hashing import (
    arrow_of,
    content_hashes,
    list_parts,
    slice_content_hashes,
    strings,
)
from claw_pipelines.transforms.partials import is_aborted
from claw_pipelines.transforms.ranges import copy_ranges, equal_ranges, range_index

PREFIX_TYPES = {
    "prefix_step_key": pl.String,
    "prefix_len": pl.Int64,
    "prompt_suffix_ids": pl.List(pl.Int32),
}
# what decoding reads of a step (and of the steps its prompt refers to)
STORED_PROMPT_COLUMNS = [
    "step_key",
    "prompt_ids",
    "response_ids",
    "prefix_step_key",
    "prefix_len",
    "prompt_suffix_ids",
]
# the small columns of a stored step a new one may refer to
REFERENCE_COLUMNS = [
    "step_key",
    "trajectory_uid",
    "step_index",
    "prompt_id",
    "response_id",
    "prompt_len",
    "response_len",
    "finish_reason",
]
# a step's stored reference as silver chose it, carried beside its whole prompt (gold keeps it
# where it holds: `encode_prompts`' `given`)
CARRIED_REFERENCE = {"prefix_step_key": "silver_prefix_step_key", "prefix_len": "silver_prefix_len"}
_SLICED_FROM = 64  # rows this long on average are joined by slices, not an index


class BrokenReference(ValueError):
    """A stored prompt refers to a step that is not there, or to more tokens than it has."""


def full_layout(rows: pl.DataFrame) -> pl.DataFrame:
    """`rows` (with full `prompt_ids`) in the stored layout with no reference: the whole
    prompt as its suffix."""
    return rows.with_columns(
        prefix_step_key=pl.lit(None, pl.String),
        prefix_len=pl.lit(0, pl.Int64),
        prompt_suffix_ids=pl.col("prompt_ids").cast(pl.List(pl.Int32)),
        prompt_ids=pl.lit(None, pl.List(pl.Int32)),
    )


def encode_prompts(
    new: pl.DataFrame, earlier: pl.DataFrame, given: pl.DataFrame | None = None
) -> pl.DataFrame:
    """`new` steps (REFERENCE_COLUMNS, full `prompt_ids`, `response_ids`) in the stored
    layout: each prompt relative to a step of its trajectory when it begins with one's
    tokens. `earlier`: stored steps of their trajectories (REFERENCE_COLUMNS; any of `new`'s
    keys among them are ignored). `given` (a row per row of `new`: `prefix_step_key`,
    `prefix_len`): references already known to hold, kept as they are without comparing
    tokens (null: the row is encoded)."""
    if new.is_empty():
        return full_layout(new)
    pairs = _candidates(new, earlier)
    prefix = np.zeros(new.height, dtype=np.int64)
    ref = np.full(new.height, -1, dtype=np.int64)  # index into `pairs`
    known = None
    if given is not None:
        known = given["prefix_step_key"].is_not_null().to_numpy()
        pairs = pairs.filter(~pl.Series(known).gather(pairs["row"]))
    if pairs.height:
        lengths = _matched(new, pairs)
        rows = pairs["row"].to_numpy()
        nearest = pairs["c_index"].to_numpy()
        order = np.lexsort((-nearest, -lengths, rows))  # per row: the longest, then nearest
        best = np.ones(len(order), dtype=bool)
        best[1:] = rows[order][1:] != rows[order][:-1]
        chosen = order[best & (lengths[order] > 0)]
        prefix[rows[chosen]] = lengths[chosen]
        ref[rows[chosen]] = chosen
    at = pl.Series(ref, dtype=pl.Int64)
    refs = (
        pairs["key"].gather(at.set(at < 0, None))
        if pairs.height
        else pl.Series([None] * len(ref), dtype=pl.String)
    )
    refs = refs.cast(pl.String)
    if given is not None and known is not None and known.any():
        refs = given["prefix_step_key"].cast(pl.String).fill_null(refs)
        prefix = np.where(known, given["prefix_len"].fill_null(0).to_numpy(), prefix)
    return new.with_columns(
        prefix_step_key=refs,
        prefix_len=pl.Series(prefix, dtype=pl.Int64),
        prompt_suffix_ids=pl.Series(_tails(new["prompt_ids"].to_arrow(), prefix)),
        prompt_ids=pl.lit(None, pl.List(pl.Int32)),
    )


def _tails(lists: pa.Array | pa.ChunkedArray, start: np.ndarray) -> pa.Array:
    """Each row's ids from `start` on: the kept ranges joined (one copy of them; rows of a
    few tokens each by one gather)."""
    offsets, values, _ = list_parts(lists)
    lengths = np.diff(offsets) - start
    values = values.astype(np.int32, copy=False)
    begins = offsets[:-1] + start
    if len(lengths) and lengths.sum() >= _SLICED_FROM * len(lengths):
        ends = begins + lengths
        kept = np.concatenate(
            [values[b:e] for b, e in zip(begins.tolist(), ends.tolist(), strict=True)]
        )
    else:
        kept = values[range_index(begins, lengths)]
    new_offsets = np.r_[0, np.cumsum(lengths)]
    return pa.ListArray.from_arrays(arrow_of(new_offsets.astype(np.int32)), arrow_of(kept))


def _candidates(new: pl.DataFrame, earlier: pl.DataFrame) -> pl.DataFrame:
    """(row of `new`, candidate) pairs: the steps of the nearest earlier call of the row's
    trajectory that is not aborted. Candidate columns: key, c_index, c_prompt_len, c_response_len,
    c_prompt_id, c_response_id, c_row (its row in `new`, null: stored)."""
    cols = REFERENCE_COLUMNS
    fresh = new.select(cols).with_columns(c_row=pl.int_range(pl.len(), dtype=pl.Int64))
    stored = earlier.select(cols).filter(~pl.col("step_key").is_in(new["step_key"].implode()))
    nodes = pl.concat(
        [stored.with_columns(c_row=pl.lit(None, pl.Int64)), fresh], how="vertical_relaxed"
    ).cast({"step_index": pl.Int64, "prompt_len": pl.Int64, "response_len": pl.Int64})
    nodes = nodes.filter(~is_aborted()).sort("trajectory_uid", "step_index")
    trajectory, prompt = pl.col("trajectory_uid"), pl.col("prompt_id")
    starts = trajectory.ne_missing(trajectory.shift(1)) | prompt.ne_missing(prompt.shift(1))
    nodes = nodes.with_columns(call=starts.cum_sum().cast(pl.Int64))
    asked = fresh.select("trajectory_uid", "step_index", row="c_row").sort("step_index")
    nearest = asked.join_asof(
        nodes.select("trajectory_uid", "step_index", "call").sort("step_index"),
        on="step_index",
        by="trajectory_uid",
        strategy="backward",
        allow_exact_matches=False,
        check_sortedness=False,  # sorted by step_index; polars cannot check within `by`
    ).filter(pl.col("call").is_not_null())
    return (
        nearest.select("row", "call", "step_index")
        .join(
            nodes.select(
                "call",
                "c_row",
                key="step_key",
                c_index="step_index",
                c_prompt_len="prompt_len",
                c_response_len="response_len",
                c_prompt_id="prompt_id",
                c_response_id="response_id",
            ),
            on="call",
        )
        .filter(pl.col("c_index") < pl.col("step_index"))  # that call's earlier steps only
    )


def _matched(new: pl.DataFrame, pairs: pl.DataFrame) -> np.ndarray:
    """Per pair: how many tokens of the candidate's sequence the row's prompt begins with:
    all of them, else its prompt's, else 0."""
    rows = pairs["row"].to_numpy()
    own = new["prompt_len"].to_numpy().astype(np.int64)[rows]
    cp = pairs["c_prompt_len"].to_numpy().astype(np.int64)
    cr = pairs["c_response_len"].to_numpy().astype(np.int64)
    head = np.zeros(len(rows), dtype=bool)
    tail = np.zeros(len(rows), dtype=bool)
    at_hand = pairs["c_row"].is_not_null().to_numpy()
    p_off, p_val, _ = list_parts(new["prompt_ids"].to_arrow())
    r_off, r_val, _ = list_parts(new["response_ids"].to_arrow())
    fits_head = cp <= own
    fits_tail = fits_head & (cp + cr <= own)
    local = np.flatnonzero(at_hand)
    if len(local):  # the candidate's tokens are at hand: compared token for token
        c_rows = pairs["c_row"].to_numpy()[local].astype(np.int64)
        head[local], tail[local] = token_matches(
            (p_off, p_val), (r_off, r_val), rows[local], c_rows, cp[local], cr[local]
        )
    remote = np.flatnonzero(~at_hand & fits_head)
    if len(remote):  # a stored candidate: its content ids (BLAKE2b-128) of both slices
        lists = new["prompt_ids"].to_arrow().take(arrow_of(rows[remote]))
        begin = np.zeros(len(remote), dtype=np.int64)
        hashes = pl.Series(slice_content_hashes(lists, begin, cp[remote]))
        head[remote] = (hashes == pairs["c_prompt_id"].gather(remote)).fill_null(False).to_numpy()
        stop = np.where(fits_tail[remote], cp[remote] + cr[remote], -2)  # invalid: no match
        hashes = pl.Series(slice_content_hashes(lists, cp[remote], stop))
        tail[remote] = (hashes == pairs["c_response_id"].gather(remote)).fill_null(False).to_numpy()
    full = head & tail & fits_tail
    return np.where(full, cp + cr, np.where(head, cp, 0))


def token_matches(
    prompts: tuple[np.ndarray, np.ndarray],
    responses: tuple[np.ndarray, np.ndarray],
    rows: np.ndarray,
    c_rows: np.ndarray,
    c_prompt_len: np.ndarray,
    c_response_len: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per pair (row, c_row) of one frame's steps (`prompts`, `responses`: offsets and values
    of its prompt and response ids): whether row's prompt begins with c_row's prompt (head),
    and continues with c_row's response (tail), compared token for token."""
    p_off, p_val = prompts
    r_off, r_val = responses
    own = np.diff(p_off)[rows]
    cp, cr = c_prompt_len.astype(np.int64), c_response_len.astype(np.int64)
    head = np.zeros(len(rows), dtype=bool)
    tail = np.zeros(len(rows), dtype=bool)
    first = np.flatnonzero(cp <= own)
    head[first] = equal_ranges(p_val, p_off[rows[first]], p_val, p_off[c_rows[first]], cp[first])
    second = np.flatnonzero(head & (cp + cr <= own))
    tail[second] = equal_ranges(
        p_val, p_off[rows[second]] + cp[second], r_val, r_off[c_rows[second]], cr[second]
    )
    return head, tail


def has_references(rows: pl.DataFrame) -> bool:
    """Whether some row's prompt refers to another step."""
    return "prefix_step_key" in rows.columns and rows["prefix_step_key"].null_count() < rows.height


Fetch = Callable[[pl.DataFrame], pl.DataFrame]


def decode_prompts(
    rows: pl.DataFrame, fetch: Fetch | None = None, scope: tuple[str, ...] = ()
) -> pl.Series:
    """The full `prompt_ids` of `rows` (STORED_PROMPT_COLUMNS and `scope`; layout columns a
    table written before lacks may be missing), in row order. A referenced step not among
    `rows` is asked of `fetch` (given the rows whose references are missing, with `scope`:
    e.g. their trajectory, whose rows it returns), as often as needed. BrokenReference when a
    reference cannot be resolved."""
    rows = stored_prompt_columns(rows, scope)
    if not has_references(rows):
        return pl.Series("prompt_ids", _own_prompts(rows), dtype=pl.List(pl.Int32))
    known = rows
    while True:
        have = known["step_key"].implode()
        wanted = known.filter(
            pl.col("prefix_step_key").is_not_null() & ~pl.col("prefix_step_key").is_in(have)
        )
        if wanted.is_empty():
            break
        more = None if fetch is None else stored_prompt_columns(fetch(wanted), scope)
        if more is not None:
            more = more.filter(~pl.col("step_key").is_in(have)).unique("step_key")
        if more is None or more.is_empty():
            key, missing = wanted.row(0, named=True)["step_key"], wanted["prefix_step_key"][0]
            raise BrokenReference(f"the prompt of step {key} refers to {missing}: not found")
        known = pl.concat([known, more], how="vertical_relaxed")
    prompts = _resolve(known)
    return pl.Series("prompt_ids", prompts.slice(0, rows.height), dtype=pl.List(pl.Int32))


def stored_prompt_columns(rows: pl.DataFrame, scope: tuple[str, ...] = ()) -> pl.DataFrame:
    """`rows`' STORED_PROMPT_COLUMNS, typed (missing ones, an older table's, as nulls), and
    the `scope` columns."""
    types = {"step_key": pl.String, "prompt_ids": pl.List(pl.Int32)}
    types |= {"response_ids": pl.List(pl.Int32)} | PREFIX_TYPES
    return rows.select(
        *(
            pl.col(c).cast(t) if c in rows.columns else pl.lit(None, t).alias(c)
            for c, t in types.items()
        ),
        *scope,
    )


def _own_prompts(rows: pl.DataFrame) -> pa.Array:
    """Each row's prompt when none refers to another step (either layout)."""
    return rows.select(pl.coalesce("prompt_suffix_ids", "prompt_ids")).to_series().to_arrow()


def _resolve(known: pl.DataFrame) -> pa.Array:
    """Every row's full prompt; references all point within `known`."""
    n = known.height
    keys = known.select("step_key", at=pl.int_range(n, dtype=pl.Int64)).unique(
        "step_key", keep="first"
    )
    ref = (
        known.select("prefix_step_key")
        .join(
            keys, left_on="prefix_step_key", right_on="step_key", how="left", maintain_order="left"
        )
        .get_column("at")
        .fill_null(-1)
        .to_numpy()
        .astype(np.int64)
    )
    s_off, s_val, _ = list_parts(_own_prompts(known))
    r_off, r_val, _ = list_parts(known["response_ids"].to_arrow())
    suffix = np.diff(s_off)
    prefix = np.where(ref >= 0, known["prefix_len"].fill_null(0).to_numpy().astype(np.int64), 0)
    lengths = prefix + suffix
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    out = np.empty(int(offsets[-1]), dtype=np.int32)
    copy_ranges(out, offsets[:-1] + prefix, s_val, s_off[:-1], suffix)
    linked = np.flatnonzero(ref >= 0)
    target = ref[linked]
    from_prompt = np.minimum(prefix[linked], lengths[target])
    from_response = prefix[linked] - from_prompt
    response_len = np.diff(r_off)[target]
    if (from_response > response_len).any():
        bad = linked[np.flatnonzero(from_response > response_len)[0]]
        raise BrokenReference(
            f"the prompt of step {known['step_key'][int(bad)]} takes {prefix[bad]} tokens of "
            f"{known['prefix_step_key'][int(bad)]}, which has fewer"
        )
    copy_ranges(
        out,
        offsets[linked] + from_prompt,
        r_val,
        r_off[target],
        from_response,
    )
    # the parts copied from referenced prompts, a reference depth at a time
    done = ref < 0
    pending = linked
    while len(pending):
        ready = pending[done[ref[pending]]]
        if not len(ready):
            raise BrokenReference("stored prompts refer to each other in a cycle")
        targets = ref[ready]
        copy_ranges(
            out,
            offsets[ready],
            out,
            offsets[targets],
            np.minimum(prefix[ready], lengths[targets]),
        )
        done[ready] = True
        pending = pending[~done[pending]]
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(arrow_of(offsets.astype(np.int32)), arrow_of(out))
    return pa.LargeListArray.from_arrays(arrow_of(offsets), arrow_of(out))


def with_prompt_ids(
    rows: pl.DataFrame, fetch: Fetch | None = None, scope: tuple[str, ...] = ()
) -> pl.DataFrame:
    """`rows` with their full `prompt_ids` (see `decode_prompts`); the layout's own columns
    are dropped."""
    prompts = decode_prompts(rows, fetch, scope)
    rest = rows.drop([c for c in PREFIX_TYPES if c in rows.columns])
    return rest.with_columns(prompts)


_INCREMENTAL_FROM = 4_096  # a prompt whose known prefix is at least this long is hashed on


def prompt_content_ids(steps: pl.DataFrame) -> pa.StringArray:
    """The content id (BLAKE2b-128, as `hashing.content_hashes`) of each step's `prompt_ids`,
    hashing only the tokens no earlier step holds: a prompt that begins with the prompt (+
    response) of the step before it in its trajectory (`trajectory_uid`, `step_index`;
    compared token for token) goes on from that step's hash state, so a turn costs its new
    tokens, not its context. The digests are the same as hashing each prompt whole."""
    prompts, responses = steps["prompt_ids"].to_arrow(), steps["response_ids"].to_arrow()
    if steps.is_empty():
        return content_hashes(prompts)
    p_off, p_val, p_valid = list_parts(prompts)
    r_off, r_val, _ = list_parts(responses)
    order = steps.select(
        pl.col("trajectory_uid"), pl.col("step_index"), row=pl.int_range(pl.len())
    ).sort("trajectory_uid", "step_index", "row", nulls_last=True)
    rows = order["row"].to_numpy().astype(np.int64)
    same = order["trajectory_uid"].eq_missing(order["trajectory_uid"].shift(1)).to_numpy()
    base = np.where(same, np.r_[-1, rows[:-1]], -1)
    p_len, r_len = np.diff(p_off), np.diff(r_off)
    carried = p_len[np.maximum(base, 0)] + r_len[np.maximum(base, 0)]
    linked = np.flatnonzero(  # only a long context is worth comparing (short ones: hashed)
        (base >= 0) & p_valid[rows] & p_valid[np.maximum(base, 0)] & (carried >= _INCREMENTAL_FROM)
    )
    if not len(linked):
        return content_hashes(prompts)
    cp = np.diff(p_off)[base[linked]]
    cr = np.diff(r_off)[base[linked]]
    head, tail = token_matches((p_off, p_val), (r_off, r_val), rows[linked], base[linked], cp, cr)
    known = np.zeros(len(rows), dtype=np.int64)  # per position in `order`: tokens carried on
    mode = np.zeros(len(rows), dtype=np.int8)  # 0: hashed whole, 1: on from the prompt, 2: +reply
    known[linked] = np.where(tail, cp + cr, np.where(head, cp, 0))
    mode[linked] = np.where(tail, 2, np.where(head, 1, 0))
    mode[known < _INCREMENTAL_FROM] = 0
    if not mode.any():
        return content_hashes(prompts)
    data = np.ascontiguousarray(p_val, dtype="<i4")
    reply = np.ascontiguousarray(r_val, dtype="<i4")
    out: list[str | None] = [None] * len(rows)
    starts, ends, r_starts, r_ends = p_off[:-1].tolist(), p_off[1:].tolist(), r_off[:-1], r_off[1:]
    valid = p_valid.tolist()
    state = None  # the hash of the previous step's prompt, kept while its trajectory goes on
    for at, (row, how, skip) in enumerate(
        zip(rows.tolist(), mode.tolist(), known.tolist(), strict=True)
    ):
        if not valid[row]:
            state = None
            continue
        if how and state is not None:
            h = state.copy()
            if how == 2:
                previous = int(base[at])
                h.update(reply[int(r_starts[previous]) : int(r_ends[previous])])
            h.update(data[starts[row] + skip : ends[row]])
        else:
            h = hashlib.blake2b(data[starts[row] : ends[row]], digest_size=16)
        out[row] = h.hexdigest()
        state = h
    return strings(out)

"""Lay out a partition's steps once as training arrays (tree-merged or flat); batches are
then contiguous slices of them. Pure numpy: the token columns are copied once, in batch order.

Per token: `input_ids`, `parent` (previous token on its path, -1 at a root), `position_ids`
(position in the original sequence), `loss_mask`, `advantages`, `token_rewards` (summed over
the steps whose response holds the token), `token_policy_versions` (the policy version that
generated it: a joined partial rollout's runs, else its step's version; the oldest when
steps share it; -1 on tokens no step generated, prompts), `behaviour_log_probs` (the mean
over the steps whose response holds the token and captured its log-prob;
`has_behaviour_log_probs` says where one did). Per step: its token indices (`token_of`), its
prompt length (its response is `token_of[k][prompt_len:]`), the depth where its own tokens
start, and the token range of its attention block (its tree, or its own sequence when flat).
With a staleness floor, response tokens of an older version are masked out of the loss
(`loss_mask` 0, no advantage) step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import numpy as np
import polars as pl

from claw_pipelines.transforms.hashing import list_parts
from claw_pipelines.transforms.partials import response_versions
from claw_pipelines.transforms.prefix_tree import (
    NO_PARENT,
    PrefixForest,
    build_forest_from_parts,
)

Layout = Literal["tree", "flat"]
# the step columns per-token policy versions are laid out from
VERSION_COLUMNS = ["policy_version", "response_len", "policy_version_runs", "policy_run_lengths"]


@dataclass(frozen=True)
class Packed:
    """Every step of a partition laid out for training, in (tree rank, step key) order."""

    layout: Layout
    input_ids: np.ndarray
    parent: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    token_rewards: np.ndarray
    token_policy_versions: np.ndarray  # int32 per token (empty when not asked for)
    behaviour_log_probs: np.ndarray  # float32 per token, 0 where no step captured one
    has_behaviour_log_probs: np.ndarray  # bool per token
    step_keys: list[str]
    token_of: list[np.ndarray]  # per step, the indices of its whole sequence's tokens
    step_starts: np.ndarray
    step_prompt_lens: np.ndarray  # per step: its prompt's tokens
    block_lo: np.ndarray  # per step: first token of its attention block
    block_hi: np.ndarray  # per step: end of its attention block


def _slices(values: np.ndarray, offsets: np.ndarray, rows: list[int]) -> list[np.ndarray]:
    return [values[offsets[i] : offsets[i + 1]] for i in rows]


def _ordered_tokens(
    frame: pl.DataFrame, order: np.ndarray, with_values: bool
) -> dict[str, np.ndarray]:
    """Lengths, response masks and (when asked) the concatenated prompt + response ids of the
    rows in `order`."""
    m_off, m_val, m_ok = list_parts(frame["response_mask"].to_arrow())
    rows = order.tolist()
    pieces = []
    if with_values:
        p_off, p_val, _ = list_parts(frame["prompt_ids"].to_arrow())
        r_off, r_val, _ = list_parts(frame["response_ids"].to_arrow())
        prompts, responses = _slices(p_val, p_off, rows), _slices(r_val, r_off, rows)
        pieces = [piece for pair in zip(prompts, responses, strict=True) for piece in pair]
    prompt_len = frame["prompt_len"].to_numpy().astype(np.int64)[order]
    response_len = frame["response_len"].to_numpy().astype(np.int64)[order]
    mask = np.ones(int(response_len.sum()), dtype=np.float32)  # absent mask: all trained
    given = np.flatnonzero(m_ok[order])
    if len(given):
        ends = np.cumsum(response_len)
        for k in given.tolist():
            i = rows[k]
            mask[ends[k] - response_len[k] : ends[k]] = m_val[m_off[i] : m_off[i + 1]]
    empty = np.zeros(0, dtype=np.int32)
    return {
        "values": np.concatenate(pieces).astype(np.int32, copy=False) if pieces else empty,
        "prompt_len": prompt_len,
        "response_len": response_len,
        "mask": mask,
    }


def _response_tokens(token_of: list[np.ndarray], prompt_len: np.ndarray) -> np.ndarray:
    """The token index of every response token, step after step (each step's after its
    prompt), as int64: numpy indexes and bincounts with it without a converted copy."""
    starts = prompt_len.tolist()
    if not token_of:
        return np.zeros(0, dtype=np.int64)
    pieces = [t[p:] for t, p in zip(token_of, starts, strict=True)]
    return np.concatenate(pieces).astype(np.int64, copy=False)


def _weights(
    response: np.ndarray,
    holders: np.ndarray,
    response_len: np.ndarray,
    mask: np.ndarray,
    advantage: np.ndarray,
    reward: np.ndarray,
    total: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss_mask, advantages, token_rewards) of the tokens `response` lists (each step's
    response tokens, step after step; `holders`: per token, how many steps' responses hold
    it): sums over the steps whose response holds a token (masked by the step's
    response_mask); each reward on its step's last token."""
    weight = mask * np.repeat(advantage, response_len)
    # when no response_mask leaves a token out, every token a response holds is trained
    trained = holders if mask.all() else np.bincount(response, weights=mask, minlength=total)
    loss = trained > 0
    advantages = np.bincount(response, weights=weight, minlength=total).astype(np.float32)
    has = response_len > 0
    last = np.cumsum(response_len)[has] - 1
    rewards = np.bincount(response[last], weights=reward[has], minlength=total)
    return loss.astype(np.int8), advantages, rewards.astype(np.float32)


def _token_versions(
    response: np.ndarray, versions: np.ndarray, holders: np.ndarray, total: int
) -> np.ndarray:
    """Per token: the version of the steps whose response holds it (the oldest when several
    do: `holders` > 1), -1 where none does. Tokens held once are assigned directly; only the
    shared ones (rollouts that sampled the same start) are sorted to find their oldest."""
    if len(versions) and versions.min() == versions.max():  # one version (a partition's)
        return (holders > 0).astype(np.int32) * np.int32(int(versions[0]) + 1) - np.int32(1)
    out = np.full(total, -1, dtype=np.int32)
    out[response] = versions
    shared = holders > 1
    if shared.any():
        again = shared[response]
        tokens, held = response[again], versions[again]
        order = np.lexsort((held, tokens))  # by token, then oldest version first
        tokens, held = tokens[order], held[order]
        first = np.r_[True, tokens[1:] != tokens[:-1]]
        out[tokens[first]] = held[first]
    return out


def _behaviour(
    response: np.ndarray,
    holders: np.ndarray,
    response_len: np.ndarray,
    log_probs: pl.Series | None,
    order: np.ndarray,
    total: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(behaviour_log_probs, has_behaviour_log_probs) of the tokens `response` lists: per
    token the mean of the log-probs the steps whose response holds it captured (a step
    captured them when its `log_probs` list, of the rows in `order`, has one per response
    token; a null or non-finite value is not captured), 0 and False where none did. Each
    step's values are one slice (no per-token work in Python); only the tokens several steps'
    responses hold (`holders` > 1: a tree's shared replies) are averaged."""
    values = np.zeros(total, dtype=np.float32)
    if log_probs is None or not len(response):
        return values, np.zeros(total, dtype=bool)
    offsets, flat, valid = list_parts(log_probs.to_arrow())
    captured = valid[order] & (np.diff(offsets)[order] == response_len)
    bounds = offsets.tolist()
    pieces = [
        flat[bounds[i] : bounds[i + 1]] if ok else np.full(n, np.nan, dtype=np.float32)
        for i, n, ok in zip(order.tolist(), response_len.tolist(), captured.tolist(), strict=True)
    ]
    read = np.concatenate(pieces).astype(np.float32, copy=False)
    finite = np.isfinite(read)
    every = bool(finite.all())
    at, kept = (response, read) if every else (response[finite], read[finite])
    values[at] = kept
    if every:
        has = holders > 0
    else:
        has = np.zeros(total, dtype=bool)
        has[at] = True
    shared = (holders > 1)[at] if (holders > 1).any() else None
    if shared is not None and shared.any():  # the mean of the values each shared token got
        tokens, which = np.unique(at[shared], return_inverse=True)
        sums = np.bincount(which, weights=kept[shared])
        values[tokens] = sums / np.bincount(which)
    return values, has


def _segment_tokens(forest: PrefixForest) -> list[np.ndarray]:
    """For each segment (parents first), the token indices of its row's whole sequence: its
    parent's up to the depth where it branches, then its own. Small per-segment copies: they
    stay in cache and reuse memory, which beats raw-sized vectorized passes here."""
    indices: list[np.ndarray] = []
    offsets, starts = forest.offsets.tolist(), forest.start.tolist()
    for k, p in enumerate(forest.parent.tolist()):
        own = np.arange(offsets[k], offsets[k + 1], dtype=np.int32)
        indices.append(own if p == NO_PARENT else np.concatenate([indices[p][: starts[k]], own]))
    return indices


def _tree_layout(frame: pl.DataFrame, order: np.ndarray, trees: np.ndarray):
    """Tree-merged arrays for the rows in `order` (whose tree ranks are `trees`)."""
    by_row = np.empty(len(order), dtype=np.int64)
    by_row[order] = trees
    parts = [frame["prompt_ids"].to_arrow(), frame["response_ids"].to_arrow()]
    return _forest_layout(build_forest_from_parts(by_row, parts), order, trees)


def _forest_layout(forest: PrefixForest, order: np.ndarray, trees: np.ndarray):
    """Per-token arrays of a forest whose trees are in rank order, and per step (rows in
    `order`, tree ranks `trees`) its token indices, own start depth and attention block."""
    sizes = np.diff(forest.offsets)
    total = forest.tree_tokens
    seg_first = forest.offsets[:-1]
    position = np.repeat(forest.start, sizes) + np.arange(total) - np.repeat(seg_first, sizes)
    parent = np.arange(total, dtype=np.int64) - 1
    nonempty = np.flatnonzero(sizes > 0)
    up = forest.parent[nonempty]
    safe = np.maximum(up, 0)
    attach = forest.offsets[safe] + forest.start[nonempty] - 1 - forest.start[safe]
    parent[seg_first[nonempty]] = np.where(up == NO_PARENT, -1, attach)
    segment_of_row = forest.segment_of_row()[order]  # in step order
    by_segment = _segment_tokens(forest)
    token_of = [by_segment[k] for k in segment_of_row.tolist()]
    tree_first = np.r_[0, np.flatnonzero(forest.tree[1:] != forest.tree[:-1]) + 1]
    tree_lo = seg_first[tree_first] if len(sizes) else np.zeros(0, np.int64)
    tree_hi = np.r_[tree_lo[1:], total].astype(np.int64)
    rank = np.searchsorted(forest.tree[tree_first], trees) if len(sizes) else trees
    return (
        forest.tokens.astype(np.int32),
        parent,
        position,
        token_of,
        forest.start[segment_of_row],
        tree_lo[rank],
        tree_hi[rank],
    )


def forest_from_segments(
    segments: pl.DataFrame, step_row: dict[str, int], rank_of_row: np.ndarray
) -> PrefixForest | None:
    """The stored prefix trees of a partition (`gold/trees` rows) as a forest over the steps'
    rows, trees reordered by rank; None when they do not match the steps one to one."""
    segments = segments.sort("tree_id", "segment")
    keys = segments["step_key"].to_list()
    if len(keys) != len(step_row) or any(k not in step_row for k in keys):
        return None
    rows = np.array([step_row[k] for k in keys], dtype=np.int64)
    ranks = rank_of_row[rows]
    move = np.argsort(ranks, kind="stable")  # trees in rank order; parents still first
    where = np.empty(len(move), dtype=np.int64)
    where[move] = np.arange(len(move))
    offsets, values, _ = list_parts(segments["tokens"].to_arrow())
    old = offsets[:-1][move].tolist(), offsets[1:][move].tolist()
    pieces = [values[a:b] for a, b in zip(*old, strict=True)]
    # a parent is numbered within its tree: its row is the tree's first row + that number
    # (less the tree's first number, for trees stored before segments were numbered so)
    tree = segments["tree_id"].to_numpy()
    first = np.flatnonzero(np.r_[True, tree[1:] != tree[:-1]]) if len(tree) else np.zeros(0, int)
    tree_start = np.repeat(first, np.diff(np.r_[first, len(tree)]))
    numbered = segments["parent"].to_numpy() - segments["segment"].to_numpy()[tree_start]
    parent = np.where(segments["parent"].to_numpy() < 0, -1, tree_start + numbered)[move]
    sizes = np.diff(offsets)[move]
    return PrefixForest(
        row=rows[move],
        tree=ranks[move],
        parent=np.where(parent < 0, NO_PARENT, where[np.maximum(parent, 0)]),
        start=segments["start_depth"].to_numpy()[move].astype(np.int64),
        length=segments["end_depth"].to_numpy()[move].astype(np.int64),
        offsets=np.r_[0, np.cumsum(sizes)].astype(np.int64),
        tokens=np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32),
    )


class StoredTreesMismatch(ValueError):
    """Stored prefix trees that do not lay out exactly the steps given."""


def pack(
    frame: pl.DataFrame,
    tree_rank: np.ndarray,
    layout: Layout,
    segments: pl.DataFrame | None = None,
    *,
    token_versions: bool = True,
    stale_floor: int | None = None,
) -> Packed:
    """Lay out the steps of `frame` (step_key, prompt_len, response_len, response_mask,
    reward, advantage, and prompt_ids/response_ids unless `segments` is given; for token
    versions policy_version and, when present, policy_version_runs/policy_run_lengths; with
    rollout_log_probs, the behaviour log-probs too), grouped by `tree_rank` (per row; a tree's
    steps stay together). With `segments` (the partition's stored prefix trees) the tree
    layout is read from them instead of being rebuilt. `token_versions`: lay out
    `token_policy_versions` (else left empty); `stale_floor`: mask response tokens generated
    before that policy version out of the loss."""
    keyed = pl.DataFrame({"step_key": frame["step_key"], "rank": tree_rank}).with_row_index("row")
    ordered = keyed.sort("rank", "step_key")
    order = ordered["row"].to_numpy().astype(np.int64)
    tokens = _ordered_tokens(frame, order, with_values=layout == "flat")
    lengths = tokens["prompt_len"] + tokens["response_len"]
    seq_offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    trees = ordered["rank"].to_numpy().astype(np.int64)
    stored = None
    if layout == "tree" and segments is not None:
        step_row = dict(zip(frame["step_key"].to_list(), range(frame.height), strict=True))
        stored = forest_from_segments(segments, step_row, np.asarray(tree_rank, dtype=np.int64))
        if stored is None:
            raise StoredTreesMismatch("the stored trees do not match the dataset's steps")
    if stored is not None:
        input_ids, parent, position, token_of, starts, lo, hi = _forest_layout(stored, order, trees)
    elif layout == "tree":
        input_ids, parent, position, token_of, starts, lo, hi = _tree_layout(frame, order, trees)
    else:
        total = int(seq_offsets[-1])
        input_ids = tokens["values"]
        position = np.arange(total, dtype=np.int64) - np.repeat(seq_offsets[:-1], lengths)
        parent = np.where(position == 0, -1, np.arange(total) - 1)
        token_of = [np.arange(a, b, dtype=np.int32) for a, b in pairwise(seq_offsets.tolist())]
        starts, lo, hi = np.zeros(len(order), np.int64), seq_offsets[:-1], seq_offsets[1:]
    advantage = frame["advantage"].fill_null(0.0).to_numpy()[order].astype(np.float32)
    reward = frame["reward"].fill_null(0.0).to_numpy()[order].astype(np.float32)
    response = _response_tokens(token_of, tokens["prompt_len"])
    mask, versions = tokens["mask"], None
    if (token_versions or stale_floor is not None) and "policy_version" in frame.columns:
        present = [c for c in VERSION_COLUMNS if c in frame.columns]
        versions = response_versions(frame.select(present)[order])
        if stale_floor is not None:
            mask = mask * (versions >= stale_floor)
    total = len(input_ids)
    holders = np.bincount(response, minlength=total)
    loss, advantages, rewards = _weights(
        response, holders, tokens["response_len"], mask, advantage, reward, total
    )
    log_probs = frame["rollout_log_probs"] if "rollout_log_probs" in frame.columns else None
    behaviour, has_behaviour = _behaviour(
        response, holders, tokens["response_len"], log_probs, order, total
    )
    token_policy_versions = np.zeros(0, dtype=np.int32)
    if token_versions and versions is not None:
        token_policy_versions = _token_versions(response, versions, holders, total)
    return Packed(
        layout=layout,
        input_ids=input_ids,
        parent=parent.astype(np.int32),
        position_ids=position.astype(np.int32),
        loss_mask=loss,
        advantages=advantages,
        token_rewards=rewards,
        token_policy_versions=token_policy_versions,
        behaviour_log_probs=behaviour,
        has_behaviour_log_probs=has_behaviour,
        step_keys=ordered["step_key"].to_list(),
        token_of=token_of,
        step_starts=np.asarray(starts, dtype=np.int64),
        step_prompt_lens=tokens["prompt_len"],
        block_lo=np.asarray(lo, dtype=np.int64),
        block_hi=np.asarray(hi, dtype=np.int64),
    )

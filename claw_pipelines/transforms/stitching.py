"""Stitch unscoped black-box calls into trajectories by their token prefixes.

An agent that knows nothing about us resends the whole conversation on each turn, so the
prompt of turn t+1 starts with the prompt + response of turn t. A call whose prompt ids start
with an earlier call's full sequence (same tenant, within the window) continues that call's
trajectory; the longest such match is its parent. Matching joins each call's prompt-prefix
hashes (64-bit rolling) against every earlier call's full-sequence hash (hash join,
vectorized); each chosen match is then verified with the BLAKE2b content ids of the slices
(so a rolling-hash collision cannot join two conversations, and placed steps' tokens are
never read back). Pointer jumping turns parent links into (trajectory, step index).

A reply with no tokens is never a parent (its prompt alone would match every later call of
the same prompt: another rollout, not a continuation). A parent keeps one continuation: the
earliest. A later call with the same parent (a fork,
another rollout of the same prompt) starts a trajectory of its own, as does a call whose
parent already has a successor. A client's retry (`client_retry` > 0: OpenAI's SDKs count
their retries in `x-stainless-retry-count`) of a call nothing continued, the same prompt
again, is placed right after that call instead, so the retry never splits the trajectory
(and curation marks the first attempt superseded).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from claw_pipelines.transforms.hashing import (
    concat_ranges,
    iter_prefix_hashes,
    list_parts,
    slice_content_hashes,
)

NO_PARENT = -1


@dataclass(frozen=True)
class StitchInput:
    """Calls to place and the earlier steps they may continue.

    `calls`: tenant, received_us (int), prompt_ids, response_ids, prompt_id, response_id,
    trajectory_uid (the call's own), and optionally client_retry (int). `anchors`, already
    placed steps, without their tokens: tenant, received_us, seq_len, sequence_hash (int64),
    prompt_id, response_id, prompt_len, trajectory_uid, step_index, has_successor.
    """

    calls: pl.DataFrame
    anchors: pl.DataFrame
    window_us: int


def _as_int64(hashes: np.ndarray) -> np.ndarray:
    return hashes.view(np.int64)


def _probes(data: StitchInput) -> tuple[pl.DataFrame, np.ndarray, np.ndarray]:
    """(probe rows, the calls' full-sequence hashes, the calls' sequence lengths).

    A probe is a call's prompt prefix whose length some candidate parent sequence has."""
    calls, anchors = data.calls, data.anchors
    seq = calls.select(pl.concat_list("prompt_ids", "response_ids")).to_series()
    offsets, values, _ = list_parts(seq.to_arrow())
    seq_len = np.diff(offsets)
    prompt_len = calls["prompt_ids"].list.len().to_numpy().astype(np.int64)
    longest = int(seq_len.max())
    wanted = np.zeros(longest + 1, dtype=bool)
    lengths = np.concatenate([seq_len, anchors["seq_len"].to_numpy().astype(np.int64)])
    wanted[lengths[lengths <= longest]] = True
    counting = np.arange(1, longest + 1, dtype=np.int64)
    full = np.empty(calls.height, dtype=np.uint64)
    rows, sizes, hashes = [], [], []
    for first, stop, prefix in iter_prefix_hashes(values, offsets):
        chunk_len = seq_len[first:stop]
        full[first:stop] = prefix[np.cumsum(chunk_len) - 1]
        size = concat_ranges(counting, chunk_len)
        row = np.repeat(np.arange(first, stop), chunk_len)
        keep = wanted[size] & (size <= prompt_len[row])
        rows.append(row[keep])
        sizes.append(size[keep])
        hashes.append(prefix[keep])
    row = np.concatenate(rows)
    probes = pl.DataFrame(
        {
            "child": row + anchors.height,
            "tenant": calls["tenant"].gather(row),
            "length": np.concatenate(sizes),
            "hash": _as_int64(np.concatenate(hashes)),
            "child_us": calls["received_us"].to_numpy()[row],
        }
    )
    return probes, full, seq_len


def _parents(data: StitchInput) -> tuple[np.ndarray, np.ndarray]:
    """(each node's verified longest earlier match or NO_PARENT, the calls' sequence hashes).
    Nodes are the anchors, then the calls."""
    calls, anchors = data.calls, data.anchors
    probes, full, seq_len = _probes(data)
    n_anchor = anchors.height
    candidates = pl.concat(
        [
            anchors.select(
                parent=pl.int_range(n_anchor, dtype=pl.Int64),
                tenant="tenant",
                length=pl.col("seq_len").cast(pl.Int64),
                hash=pl.col("sequence_hash").cast(pl.Int64),
                parent_us=pl.col("received_us").cast(pl.Int64),
                replied=pl.col("seq_len") > pl.col("prompt_len"),
            )
            .filter("replied")
            .drop("replied"),
            pl.DataFrame(
                {
                    "parent": np.arange(calls.height, dtype=np.int64) + n_anchor,
                    "tenant": calls["tenant"],
                    "length": seq_len,
                    "hash": _as_int64(full),
                    "parent_us": calls["received_us"].cast(pl.Int64),
                    "replied": calls["response_ids"].list.len().to_numpy() > 0,
                }
            )
            .filter("replied")
            .drop("replied"),
        ]
    )
    best = (
        probes.join(candidates, on=["tenant", "length", "hash"])
        .filter(
            (pl.col("parent") != pl.col("child"))
            & (pl.col("parent_us") <= pl.col("child_us"))
            & (pl.col("child_us") - pl.col("parent_us") <= data.window_us)
            & ((pl.col("parent_us") < pl.col("child_us")) | (pl.col("parent") < pl.col("child")))
        )
        .sort(["child", "length", "parent_us", "parent"], descending=[False, True, True, True])
        .unique("child", keep="first", maintain_order=True)
    )
    child, parent, size = (best[c].to_numpy() for c in ("child", "parent", "length"))
    links = np.full(n_anchor + calls.height, NO_PARENT, dtype=np.int64)
    verified = _verified(data, child - n_anchor, parent, size)
    links[child[verified]] = parent[verified]
    return links, full


def _verified(data: StitchInput, rows: np.ndarray, parent: np.ndarray, size: np.ndarray):
    """Mask of matches whose child prompt really starts with the parent's prompt + response:
    BLAKE2b of the child's prompt slices against the parent's content ids."""
    if len(rows) == 0:
        return np.zeros(0, dtype=bool)
    ids = pl.concat(
        [
            data.anchors.select("prompt_id", "response_id", "prompt_len"),
            data.calls.select(
                "prompt_id", "response_id", prompt_len=pl.col("prompt_ids").list.len()
            ),
        ],
        how="vertical_relaxed",
    )[parent]
    count = data.calls.height
    middle, stop = np.full(count, -1, dtype=np.int64), np.full(count, -1, dtype=np.int64)
    middle[rows] = ids["prompt_len"].to_numpy()
    stop[rows] = size
    prompts = data.calls["prompt_ids"].to_arrow()
    head = pl.Series(slice_content_hashes(prompts, np.zeros(count, np.int64), middle))
    tail = pl.Series(slice_content_hashes(prompts, middle, stop))
    same = (head.gather(rows) == ids["prompt_id"]) & (tail.gather(rows) == ids["response_id"])
    return same.fill_null(False).to_numpy()


def _one_continuation(parent: np.ndarray, order_us: np.ndarray, taken: np.ndarray) -> np.ndarray:
    """Keep each parent's earliest child; a parent already `taken` keeps none."""
    child = np.flatnonzero(parent != NO_PARENT)
    if len(child) == 0:
        return parent
    rank = np.lexsort((child, order_us[child], parent[child]))
    ordered = child[rank]
    first = np.ones(len(ordered), dtype=bool)
    first[1:] = parent[ordered][1:] != parent[ordered][:-1]
    kept = first & ~taken[parent[ordered]]
    result = parent.copy()
    result[ordered[~kept]] = NO_PARENT
    return result


def _retries_follow_their_attempt(
    data: StitchInput, parent: np.ndarray, received: np.ndarray, taken: np.ndarray
) -> np.ndarray:
    """Link each client retry to the latest earlier node of the same tenant and prompt (its
    attempt) when nothing continues that node; other links unchanged."""
    calls, anchors = data.calls, data.anchors
    if "client_retry" not in calls.columns:
        return parent
    n_anchor = anchors.height
    rows = np.flatnonzero(calls["client_retry"].fill_null(0).to_numpy() > 0)
    if len(rows) == 0:
        return parent
    has_child = taken.copy()
    has_child[parent[parent != NO_PARENT]] = True
    nodes = pl.concat(
        [
            anchors.select("tenant", "prompt_id"),
            calls.select("tenant", "prompt_id"),
        ],
        how="vertical_relaxed",
    ).with_columns(
        node=pl.int_range(pl.len(), dtype=pl.Int64),
        node_us=pl.Series(received, dtype=pl.Int64),
        free=pl.Series(~has_child),
    )
    retries = (
        calls[rows]
        .select("tenant", "prompt_id")
        .with_columns(
            retry=pl.Series(rows + n_anchor, dtype=pl.Int64),
            retry_us=pl.Series(received[rows + n_anchor], dtype=pl.Int64),
        )
    )
    attempts = (
        retries.join(nodes, on=["tenant", "prompt_id"])
        .filter(
            (pl.col("node") != pl.col("retry"))
            & (
                (pl.col("node_us") < pl.col("retry_us"))
                | ((pl.col("node_us") == pl.col("retry_us")) & (pl.col("node") < pl.col("retry")))
            )
            & (pl.col("retry_us") - pl.col("node_us") <= data.window_us)
        )
        .sort(["retry", "node_us", "node"], descending=[False, True, True])
        .unique("retry", keep="first", maintain_order=True)
        .filter(pl.col("free"))
    )
    linked = parent.copy()
    linked[attempts["retry"].to_numpy()] = attempts["node"].to_numpy()
    return linked


def chain_ends(link: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pointer jumping along `link` (per node the next one, NO_PARENT at an end): each node's
    chain end and its distance from it, in O(log length) vectorized rounds."""
    up = np.where(link == NO_PARENT, np.arange(len(link)), link)
    dist = (link != NO_PARENT).astype(np.int64)
    while True:
        nxt = up[up]
        if np.array_equal(nxt, up):
            return up, dist
        dist = dist + dist[up]
        up = nxt


def stitch(data: StitchInput) -> pl.DataFrame:
    """Per call, in input order: `trajectory_uid`, `step_index`, `continues` (the key of the
    step it continues, or null), `sequence_hash` (of its prompt + response, for later runs'
    anchors), and its chain's head: `head_anchor` (index into anchors) or `head_call` (index
    into calls), the other being -1."""
    calls, anchors = data.calls, data.anchors
    n_anchor = anchors.height
    parent, full = _parents(data)
    received = np.concatenate(
        [anchors["received_us"].to_numpy(), calls["received_us"].to_numpy()]
    ).astype(np.int64)
    taken = np.concatenate(
        [anchors["has_successor"].to_numpy().astype(bool), np.zeros(calls.height, dtype=bool)]
    )
    parent = _retries_follow_their_attempt(data, parent, received, taken)
    parent = _one_continuation(parent, received, taken)
    head, dist = chain_ends(parent)
    on_anchor = head < n_anchor
    node_step = np.concatenate(
        [anchors["step_index"].to_numpy().astype(np.int64), np.zeros(calls.height, np.int64)]
    )
    step_index = np.where(on_anchor, node_step[head] + dist, dist).astype(np.int64)
    node_uid = pl.concat([anchors["trajectory_uid"], calls["trajectory_uid"]])
    trajectory = node_uid.gather(head)
    keys = trajectory + ":" + pl.Series(step_index).cast(pl.String)
    own = slice(n_anchor, None)
    has_parent = parent[own] != NO_PARENT
    continues = keys.gather(np.where(has_parent, parent[own], 0))
    continues = pl.select(pl.when(pl.Series(has_parent)).then(continues)).to_series()
    return pl.DataFrame(
        {
            "trajectory_uid": trajectory[own],
            "step_index": step_index[own],
            "continues": continues,
            "sequence_hash": _as_int64(full),
            "head_anchor": np.where(on_anchor[own], head[own], -1),
            "head_call": np.where(on_anchor[own], -1, head[own] - n_anchor),
        }
    )

"""Stitch unscoped black-box calls into trajectories by their token prefixes.

An agent that knows nothing about us resends the whole conversation on each turn, so the
prompt of turn t+1 starts with the prompt + response of turn t. A call whose prompt ids start
with an earlier call's full sequence (same tenant, within the window) continues that call's
trajectory; the longest such match is its parent. Matching joins each call's prompt-prefix
hashes against every earlier call's full-sequence hash (hash join, vectorized, verified on
the tokens), then pointer jumping turns parent links into (trajectory, step index).

A parent keeps one continuation: the earliest. A later call with the same parent (a retry, a
fork) starts a trajectory of its own, as does a call whose parent already has a successor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from claw_pipelines.transforms.hashing import list_parts, prefix_hashes

NO_PARENT = -1


@dataclass(frozen=True)
class StitchInput:
    """Calls to place and the earlier steps they may continue.

    `calls`: tenant, received_us (int), prompt_ids, response_ids, trajectory_uid (the call's
    own). `anchors`: already placed steps: tenant, received_us, prompt_ids, response_ids,
    trajectory_uid, step_index, has_successor.
    """

    calls: pl.DataFrame
    anchors: pl.DataFrame
    window_us: int


def _sequences(frame: pl.DataFrame) -> pl.Series:
    return frame.select(pl.concat_list("prompt_ids", "response_ids").alias("seq")).to_series()


def _parents(nodes: pl.DataFrame, is_call: np.ndarray, window_us: int) -> np.ndarray:
    """For each node, the node index of its verified longest earlier match (or NO_PARENT)."""
    offsets, values, _ = list_parts(nodes["seq"].to_arrow())
    hashes = prefix_hashes(values, offsets)
    seq_len = np.diff(offsets)
    prompt_len = nodes["prompt_len"].to_numpy()
    full = pl.DataFrame(
        {
            "parent": np.arange(len(nodes), dtype=np.int64),
            "tenant": nodes["tenant"],
            "length": seq_len,
            "hash": hashes[offsets[1:] - offsets[0] - 1],
            "parent_us": nodes["received_us"],
        }
    )
    # Probe only the prompt positions of calls whose prefix length some sequence has.
    row = np.repeat(np.arange(len(nodes)), seq_len)
    length = np.arange(len(values), dtype=np.int64) - np.repeat(offsets[:-1], seq_len) + 1
    keep = is_call[row] & (length <= prompt_len[row]) & np.isin(length, np.unique(seq_len))
    probes = pl.DataFrame(
        {
            "child": row[keep].astype(np.int64),
            "tenant": nodes["tenant"].gather(row[keep]),
            "length": length[keep],
            "hash": hashes[keep],
            "child_us": nodes["received_us"].to_numpy()[row[keep]],
        }
    )
    matches = (
        probes.join(full, on=["tenant", "length", "hash"])
        .filter(
            (pl.col("parent") != pl.col("child"))
            & (pl.col("parent_us") <= pl.col("child_us"))
            & (pl.col("child_us") - pl.col("parent_us") <= window_us)
            & ((pl.col("parent_us") < pl.col("child_us")) | (pl.col("parent") < pl.col("child")))
        )
        .sort(["child", "length", "parent_us", "parent"], descending=[False, True, True, True])
    )
    best = matches.unique("child", keep="first", maintain_order=True)
    parent = np.full(len(nodes), NO_PARENT, dtype=np.int64)
    for child, candidate, size in best.select("child", "parent", "length").iter_rows():
        start, other = offsets[child], values[offsets[candidate] : offsets[candidate + 1]]
        if np.array_equal(values[start : start + size], other):  # a hash collision fails here
            parent[child] = candidate
    return parent


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


def _heads(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pointer jumping: each node's chain head and its distance from it."""
    up = np.where(parent == NO_PARENT, np.arange(len(parent)), parent)
    dist = (parent != NO_PARENT).astype(np.int64)
    while True:
        nxt = up[up]
        if np.array_equal(nxt, up):
            return up, dist
        dist = dist + dist[up]
        up = nxt


def stitch(data: StitchInput) -> pl.DataFrame:
    """Per call, in input order: `trajectory_uid`, `step_index`, `continues` (the key of the
    step it continues, or null), and its chain's head: `head_anchor` (index into anchors) or
    `head_call` (index into calls), the other being -1."""
    calls, anchors = data.calls, data.anchors
    n_anchor = anchors.height
    columns = ["tenant", "received_us", "prompt_ids", "response_ids", "trajectory_uid"]
    nodes = pl.concat(
        [
            anchors.select(*columns, "step_index", "has_successor"),
            calls.select(*columns).with_columns(
                step_index=pl.lit(0, pl.Int64), has_successor=pl.lit(False)
            ),
        ],
        how="vertical_relaxed",
    )
    nodes = nodes.with_columns(
        seq=_sequences(nodes), prompt_len=pl.col("prompt_ids").list.len().cast(pl.Int64)
    )
    is_call = np.arange(nodes.height) >= n_anchor
    parent = _parents(nodes, is_call, data.window_us)
    taken = nodes["has_successor"].to_numpy().astype(bool)
    parent = _one_continuation(parent, nodes["received_us"].to_numpy(), taken)
    head, dist = _heads(parent)
    on_anchor = head < n_anchor
    anchor_step = nodes["step_index"].to_numpy()[head]
    step_index = np.where(on_anchor, anchor_step + dist, dist).astype(np.int64)
    trajectory = nodes["trajectory_uid"].gather(head)
    keys = trajectory + ":" + pl.Series(step_index).cast(pl.String)
    keys = pl.concat(
        [anchors["trajectory_uid"] + ":" + anchors["step_index"].cast(pl.String), keys[n_anchor:]]
    )
    own = slice(n_anchor, None)
    has_parent = parent[own] != NO_PARENT
    continues = keys.gather(np.where(has_parent, parent[own], 0))
    continues = pl.select(pl.when(pl.Series(has_parent)).then(continues)).to_series()
    return pl.DataFrame(
        {
            "trajectory_uid": trajectory[own],
            "step_index": step_index[own],
            "continues": continues,
            "head_anchor": np.where(on_anchor[own], head[own], -1),
            "head_call": np.where(on_anchor[own], -1, head[own] - n_anchor),
        }
    )

"""Drawing a prefix tree and its attention mask at a readable size (Optimization and
Consumption pages)."""

from __future__ import annotations

import altair as alt
import numpy as np
import polars as pl

MASK_CELLS = 64


def tree_dot(nodes: pl.DataFrame) -> str:
    """Graphviz source of one tree's segments (`segment`, `parent`, `step_key`, `own`,
    `start_depth`, `end_depth`), each labelled with its step and tokens."""
    lines = ["digraph tree {", "rankdir=LR;", "node [shape=box, fontsize=10];"]
    for row in nodes.sort("segment").iter_rows(named=True):
        step = row["step_key"] or "shared prefix"
        depths = f"depth {row['start_depth']}-{row['end_depth']}"
        lines.append(f's{row["segment"]} [label="{step}\\n+{row["own"]} tokens ({depths})"];')
        if row["parent"] is not None and row["parent"] >= 0:
            lines.append(
                f's{row["parent"]} -> s{row["segment"]} [label="at {row["start_depth"]}"];'
            )
    lines.append("}")
    return "\n".join(lines)


def mask_cells(mask: np.ndarray, cells: int = MASK_CELLS) -> pl.DataFrame:
    """A T×T boolean mask pooled into at most `cells`×`cells` blocks: each block's token
    range and the share of its query/key pairs that may attend."""
    size = mask.shape[0]
    edges = np.unique(np.linspace(0, size, min(cells, size) + 1).astype(np.int64))
    sums = np.add.reduceat(np.add.reduceat(mask.astype(np.int64), edges[:-1], 0), edges[:-1], 1)
    spans = np.diff(edges)
    share = sums / np.outer(spans, spans)
    q, k = np.meshgrid(np.arange(len(spans)), np.arange(len(spans)), indexing="ij")
    return pl.DataFrame(
        {
            "query_from": edges[q.ravel()],
            "query_to": edges[q.ravel() + 1],
            "key_from": edges[k.ravel()],
            "key_to": edges[k.ravel() + 1],
            "may_attend": share.ravel(),
        }
    ).filter(pl.col("may_attend") > 0)


def mask_chart(mask: np.ndarray) -> alt.Chart:
    """The mask as a heatmap with token positions on both axes (darker: more pairs attend)."""
    cells = mask_cells(mask).to_pandas()
    size = int(mask.shape[0])
    scale = alt.Scale(domain=[0, size])
    return (
        alt.Chart(cells)
        .mark_rect()
        .encode(
            alt.X("key_from:Q", title="key token (attended to)", scale=scale),
            alt.X2("key_to:Q"),
            alt.Y("query_from:Q", title="query token", scale=alt.Scale(domain=[size, 0])),
            alt.Y2("query_to:Q"),
            alt.Color(
                "may_attend:Q", title="share that may attend", scale=alt.Scale(scheme="blues")
            ),
            tooltip=["query_from", "query_to", "key_from", "key_to", "may_attend"],
        )
        .properties(height=420)
    )

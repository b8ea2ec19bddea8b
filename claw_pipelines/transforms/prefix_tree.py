"""Prefix-tree merge (docs/DESIGN.md §7): steps that share token prefixes store those tokens once.

Within each tree (a trajectory, a prompt group, or a single step), sequences are sorted
lexicographically; each one then shares with its sorted predecessor exactly the longest
prefix it shares with any earlier sequence (its LCP). Each sequence contributes one segment:
its tokens after that LCP, attached to the segment of the nearest earlier sequence with a
smaller LCP (the one that first stored the shared prefix), at depth = the LCP. So a tree
holds sum(len - lcp) tokens = U, the number of distinct non-empty prefixes: the optimum.

Work is per sequence (sort keys, neighbour comparisons done by memcmp or numpy, one slice
copy), never per token in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from claw_pipelines.transforms.hashing import list_parts
from claw_pipelines.transforms.ranges import copy_ranges

NO_PARENT = -1
BATCH_TOKENS = 1 << 21  # ~8 MiB of sort keys alive at a time


@dataclass(frozen=True)
class PrefixForest:
    """The merged trees of many sequences. Segment k (in sorted order) belongs to input row
    `row[k]` and tree `tree[k]`; it holds `tokens[offsets[k]:offsets[k+1]]`, the depths
    `start[k]` .. `length[k]` of that row's sequence, and hangs off segment `parent[k]`."""

    row: np.ndarray
    tree: np.ndarray
    parent: np.ndarray
    start: np.ndarray
    length: np.ndarray
    offsets: np.ndarray
    tokens: np.ndarray

    @property
    def raw_tokens(self) -> int:
        """Tokens of all sequences, unmerged."""
        return int(self.length.sum())

    @property
    def tree_tokens(self) -> int:
        """Tokens stored in the trees (U)."""
        return len(self.tokens)

    def segment_of_row(self) -> np.ndarray:
        """For each input row, its segment index."""
        inverse = np.empty(len(self.row), dtype=np.int64)
        inverse[self.row] = np.arange(len(self.row))
        return inverse

    def tree_first(self) -> np.ndarray:
        """For each segment, the index of its tree's first segment (a tree's segments are
        contiguous): subtracting it numbers segments within their tree."""
        count = len(self.row)
        if count == 0:
            return np.zeros(0, dtype=np.int64)
        starts = np.flatnonzero(np.r_[True, self.tree[1:] != self.tree[:-1]])
        return np.repeat(starts, np.diff(np.r_[starts, count])).astype(np.int64)

    def path_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every segment's path (the segments from its root down to itself) as (offsets,
        flat segments), numpy only: a pass per level of the deepest tree."""
        count = len(self.parent)
        depth = np.ones(count, dtype=np.int64)
        above = _parent_of(np.arange(count, dtype=np.int64), self.parent)
        while (climbing := above != NO_PARENT).any():
            depth += climbing
            above = _parent_of(above, self.parent)
        offsets = np.r_[0, np.cumsum(depth)]
        flat = np.empty(offsets[-1], dtype=np.int64)
        at, here = offsets[1:] - 1, np.arange(count, dtype=np.int64)  # filled leaf to root
        while (left := here != NO_PARENT).any():
            flat[at[left]] = here[left]
            at, here = at - 1, _parent_of(here, self.parent)
        return offsets, flat

    def pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every segment's whole sequence as pieces of `tokens`, root first: (the segment
        each piece rebuilds, the piece's depth in that sequence, where it starts in
        `tokens`, its length), numpy only. A piece that would run past the segment it is
        taken from (no tree is built so) has length -1."""
        offsets, flat = self.path_arrays()
        owner = np.repeat(np.arange(len(self.parent), dtype=np.int64), np.diff(offsets))
        last = np.zeros(len(flat), dtype=bool)
        last[offsets[1:] - 1] = True
        below = np.where(last, 0, np.r_[flat[1:], 0])
        held = np.diff(self.offsets)[flat]
        take = np.where(last, held, self.start[below] - self.start[flat])
        take = np.where((take < 0) | (take > held), -1, take)
        return owner, self.start[flat], self.offsets[flat], take

    def sequences(self) -> tuple[np.ndarray, np.ndarray]:
        """Every input row's whole sequence rebuilt from the trees alone, in row order, as
        (offsets, flat tokens): range copies, no Python per row."""
        owner, depth, source, take = self.pieces()
        if (take < 0).any():
            raise ValueError("a tree piece runs past its segment")
        lengths = np.zeros(len(self.row), dtype=np.int64)
        lengths[self.row] = self.start + np.diff(self.offsets)
        offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
        out = np.empty(offsets[-1], dtype=self.tokens.dtype)
        copy_ranges(out, offsets[self.row[owner]] + depth, self.tokens, source, take)
        return offsets, out


def _parent_of(segments: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """Each segment's parent (NO_PARENT stays NO_PARENT)."""
    return np.where(segments == NO_PARENT, NO_PARENT, parent[np.maximum(segments, 0)])


def _mismatch(a: bytes, b: bytes, m: int) -> int:
    """Index of the first differing token of two id byte strings within their first m ids."""
    x, y = np.frombuffer(a, dtype=np.int32, count=m), np.frombuffer(b, dtype=np.int32, count=m)
    return int(np.argmax(x != y))  # a mismatch exists within m


def _tree_batches(tree: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """Rows grouped by tree, trees packed into batches of about BATCH_TOKENS tokens: sort keys
    live one batch at a time, so their memory is reused rather than faulted in anew."""
    by_tree = np.argsort(tree, kind="stable")
    if len(by_tree) == 0:
        return []
    sorted_trees = tree[by_tree]
    firsts = np.flatnonzero(np.r_[True, sorted_trees[1:] != sorted_trees[:-1]])
    tokens_before = np.r_[0, np.cumsum(lengths[by_tree])]
    batches, begin = [], 0
    bounds = [*firsts.tolist()[1:], len(by_tree)]
    for end in bounds:
        if tokens_before[end] - tokens_before[begin] >= BATCH_TOKENS or end == len(by_tree):
            batches.append(by_tree[begin:end])
            begin = end
    return batches


def build_forest(tree: np.ndarray, sequences: pa.Array | pa.ChunkedArray) -> PrefixForest:
    """Merge the sequences (one per row) into prefix trees, one per distinct `tree` value."""
    return build_forest_from_parts(tree, [sequences])


def build_forest_from_parts(
    tree: np.ndarray, parts: list[pa.Array | pa.ChunkedArray]
) -> PrefixForest:
    """Like `build_forest`, for sequences given as several list columns concatenated row by
    row (e.g. prompt ids then response ids): no merged copy of the columns is made."""
    split = [list_parts(p) for p in parts]
    arrays = [
        (o[:-1].tolist(), o[1:].tolist(), memoryview(np.ascontiguousarray(v, dtype=np.int32)))
        for o, v, _ in split
    ]  # a memoryview's slice is a view: a row's key is copied once, by the join
    lengths = sum(np.diff(o) for o, _, _ in split)
    tree_list = tree.tolist()
    order: list[int] = []
    lcp: list[int] = []
    parent: list[int] = []
    pieces: list[np.ndarray] = []
    for batch in _tree_batches(tree, lengths):
        rows = batch.tolist()
        # a row's ids as bytes: byte order of fixed-width ids is a lexicographic order
        keys = {i: b"".join([v[s[i] : e[i]] for s, e, v in arrays]) for i in rows}
        rows.sort(key=lambda i: (tree_list[i], keys[i]))
        stack: list[int] = []  # segments of this tree with increasing lcp: parent candidates
        previous = -1
        for i in rows:
            k = len(order)
            key = keys[i]
            if previous < 0 or tree_list[previous] != tree_list[i]:
                stack.clear()
                depth = 0
            else:
                before = keys[previous]
                if key.startswith(before):  # memcmp: the common case of nested turns
                    depth = len(before) >> 2
                elif before.startswith(key):
                    depth = len(key) >> 2
                else:
                    depth = _mismatch(before, key, min(len(before), len(key)) >> 2)
            while stack and lcp[stack[-1]] >= depth:
                stack.pop()
            order.append(i)
            lcp.append(depth)
            parent.append(stack[-1] if stack and depth > 0 else NO_PARENT)
            stack.append(k)
            pieces.append(np.frombuffer(key, dtype=np.int32)[depth:].copy())
            previous = i
        keys.clear()  # free this batch's keys before the next one is built
    rows = np.asarray(order, dtype=np.int64)
    sizes = np.array([len(p) for p in pieces], dtype=np.int64)
    return PrefixForest(
        row=rows,
        tree=tree[rows] if len(rows) else tree[:0],
        parent=np.asarray(parent, dtype=np.int64),
        start=np.asarray(lcp, dtype=np.int64),
        length=lengths[rows] if len(rows) else np.zeros(0, np.int64),
        offsets=np.r_[0, np.cumsum(sizes)].astype(np.int64),
        tokens=np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32),
    )

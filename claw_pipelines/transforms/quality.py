"""Data-quality findings over silver (pure: frames in, findings out; Dagster reports them).

Each function returns a `Finding`: whether the promise holds, how many rows break it and a
few of their keys, so a failure names the steps to look at.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from claw_pipelines.contracts.specs import EXACT_TOKEN_SOURCES, CurationSpec
from claw_pipelines.transforms.feedback import unresolved_targets
from claw_pipelines.transforms.fragments import REPLY_RETOKENIZED
from claw_pipelines.transforms.hashing import list_parts
from claw_pipelines.transforms.prefix_tree import PrefixForest
from claw_pipelines.transforms.ranges import equal_ranges

SAMPLE = 20


@dataclass(frozen=True)
class Finding:
    """The outcome of one check: passed, the offending count and a sample of keys."""

    passed: bool
    failures: int = 0
    sample: list[str] = field(default_factory=list)
    checked: int = 0

    @classmethod
    def of(cls, offending: pl.Series, checked: int) -> Finding:
        """A finding from the keys of the offending rows."""
        return cls(offending.len() == 0, offending.len(), offending.head(SAMPLE).to_list(), checked)


def step_keys_are_unique(step_keys: pl.Series) -> Finding:
    """Every step_key appears once."""
    counts = step_keys.value_counts()
    repeated = counts.filter(pl.col("count") > 1).get_column(step_keys.name)
    return Finding.of(repeated.cast(pl.String), step_keys.len())


def inconsistent_lengths() -> pl.Expr:
    """Steps whose log-probs or mask have another length than the response, or no prompt."""
    n = pl.col("response_ids").list.len()
    return (
        (pl.col("rollout_log_probs").is_not_null() & (pl.col("rollout_log_probs").list.len() != n))
        | (pl.col("response_mask").is_not_null() & (pl.col("response_mask").list.len() != n))
        | (pl.col("prompt_len") == 0)  # stored prompts may refer to earlier steps (§18)
    )


def lengths_are_consistent(steps: pl.DataFrame) -> Finding:
    """Log-probs and masks, when present, have one entry per response token."""
    return Finding.of(steps.filter(inconsistent_lengths())["step_key"], steps.height)


def token_ids_are_exact(steps: pl.DataFrame) -> Finding:
    """Every step's token ids are exactly what the model saw and sampled: the server's, the
    client's, or computed by the gateway and confirmed by the server's counts (not
    `local_unverified`)."""
    inexact = ~pl.col("token_source").is_in(EXACT_TOKEN_SOURCES).fill_null(False)
    return Finding.of(steps.filter(inexact)["step_key"], steps.height)


def retokenized_replies(steps: pl.DataFrame) -> Finding:
    """Each turn extends its trajectory's previous turn token for token, unless it starts a
    fragment because the agent rewrote or truncated its history: the turns that keep the
    previous prompt but not the reply's ids (`fragment_reason` reply_retokenized: the reply
    was sent back as text and encoded again) are retokenization drift."""
    drifted = steps.filter(pl.col("fragment_reason") == REPLY_RETOKENIZED)
    return Finding.of(drifted["step_key"], steps.height)


def rewards_are_finite(facts: pl.DataFrame) -> Finding:
    """Reward and rating values are finite numbers."""
    numeric = facts.filter(pl.col("kind").is_in(["reward", "rating"]))
    bad = numeric.filter(~pl.col("value_number").is_finite().fill_null(False))
    return Finding.of(bad["feedback_id"], numeric.height)


def feedback_targets_exist(steps: pl.DataFrame, facts: pl.DataFrame) -> Finding:
    """Every fact addresses a step or trajectory of its tenant that silver holds."""
    addressed = facts.filter(
        pl.col("step_key").is_not_null() | pl.col("trajectory_uid").is_not_null()
    )
    return Finding.of(unresolved_targets(steps, addressed)["feedback_id"], addressed.height)


def steps_have_no_conflicts(conflicts: pl.DataFrame) -> Finding:
    """No step arrived under a taken step_key with different tokens."""
    return Finding.of(
        conflicts["step_key"] if conflicts.height else pl.Series([], dtype=pl.String),
        conflicts.height,
    )


def trees_rebuild_steps(forest: PrefixForest, steps: pl.DataFrame) -> Finding:
    """Every step's `prompt_ids + response_ids` is rebuilt exactly from its tree: each piece
    of its path compared in place with the prompt and response tokens it stands for."""
    if steps.is_empty():
        return Finding(True)
    p_off, p_val, _ = list_parts(steps["prompt_ids"].to_arrow())
    r_off, r_val, _ = list_parts(steps["response_ids"].to_arrow())
    p_len, r_len = np.diff(p_off), np.diff(r_off)
    rebuilt = np.full(steps.height, -1, dtype=np.int64)  # -1: the row has no segment
    rebuilt[forest.row] = forest.start + np.diff(forest.offsets)
    broken = rebuilt != p_len + r_len
    owner, depth, source, take = forest.pieces()
    row = forest.row[owner]
    broken[row[take < 0]] = True
    keep = ~broken[row]  # a row's pieces stay inside its tokens only when its length holds
    row, depth, source, take = row[keep], depth[keep], source[keep], take[keep]
    in_prompt = np.clip(p_len[row] - depth, 0, take)
    in_response = take - in_prompt
    prompt_equal = equal_ranges(forest.tokens, source, p_val, p_off[row] + depth, in_prompt)
    response_at = r_off[row] + np.maximum(depth + in_prompt - p_len[row], 0)
    response_equal = equal_ranges(
        forest.tokens, source + in_prompt, r_val, response_at, in_response
    )
    broken[row[~(prompt_equal & response_equal)]] = True
    return Finding.of(steps["step_key"].filter(pl.Series(broken)), steps.height)


def trees_are_minimal(forest: PrefixForest) -> Finding:
    """Every stored token is a distinct trie node, so trees hold exactly U tokens: no two
    segments start with the same token at the same place, and none starts with the token its
    parent continues with there."""
    nonempty = np.flatnonzero(np.diff(forest.offsets) > 0)
    if len(nonempty) == 0:
        return Finding(True)
    parent = forest.parent[nonempty]
    start = forest.start[nonempty]
    first = forest.tokens[forest.offsets[nonempty]]
    has_parent = parent >= 0
    safe_parent = np.where(has_parent, parent, 0)
    along = start - forest.start[safe_parent]  # index of the parent's token at that depth
    continues = has_parent & (start < forest.length[safe_parent])
    position = np.where(continues, forest.offsets[safe_parent] + along, 0)
    parent_token = np.where(continues, forest.tokens[position], -1)
    frame = pl.DataFrame(
        {
            "segment": nonempty,
            "tree": forest.tree[nonempty],
            "parent": parent,
            "start": start,
            "first": first,
            "parent_token": parent_token,
        }
    )
    repeated = frame.filter(
        (pl.len().over("tree", "parent", "start", "first") > 1)
        | (pl.col("first") == pl.col("parent_token"))
    )
    return Finding.of(repeated["segment"].cast(pl.String), len(nonempty))


def steps_in_one_partition(dataset_keys: pl.Series, partition_keys: pl.Series) -> Finding:
    """No step of a partition appears twice in its dataset (in another partition, or twice in
    its own): the dataset's keys probed for the partition's, not counted whole."""
    held = dataset_keys.filter(dataset_keys.is_in(partition_keys.implode()))
    return dataclasses.replace(step_keys_are_unique(held), checked=partition_keys.len())


def groups_are_complete(spec: CurationSpec, steps: pl.DataFrame) -> Finding:
    """With `complete_groups_only`, every kept step's prompt group is complete."""
    if not spec.complete_groups_only or steps.is_empty():
        return Finding(True, checked=steps.height)
    return Finding.of(steps.filter(~pl.col("group_complete"))["step_key"], steps.height)


def partition_within_staleness(spec: CurationSpec, version: int, newest: int, rows: int) -> Finding:
    """A partition outside `max_policy_staleness` of the newest version holds no steps."""
    stale = spec.max_policy_staleness is not None and version < newest - spec.max_policy_staleness
    return Finding(not (stale and rows > 0), failures=rows if stale else 0, checked=rows)

"""Partial rollouts: aborted generations joined with their continuation into one step.

When weights change mid-generation, rollout engines abort the requests in flight (vLLM answers
them with finish_reason `abort`; a stream the upstream or the client cut ends
`upstream_error`, `client_disconnected` or `upstream_ended`) and resume each under the new
policy: the same prompt plus the partial reply, sent again. The join rule: a new step
continues an aborted step (with tokens) when both belong to one trajectory, tenant and
tokenizer, the aborted one has a lower step index, and the new step's prompt is exactly the
aborted step's prompt + response (checked on the content ids of the prompt's two slices). An
aborted step keeps its earliest continuation; a step continues its nearest such predecessor.
Chains (a continuation aborted in turn, then continued) join whole.

The continuation becomes the one step holding them all: its step key, event id, finish
reason and `policy_version` (the version that finished it: its partition) stay; its prompt is
the first partial's prompt, its response every partial's response then its own (all read off
its own prompt ids: exact by the rule), `rollout_log_probs` and `response_mask` are
concatenated (log-probs null if any part has none; a part without a mask counts as all ones),
and `policy_version_runs` / `policy_run_lengths` say which policy version generated which
response tokens (run-length: adjacent parts of one version merge; a single run is stored as
nulls). `partial_step_keys` / `partial_event_ids` list what it absorbed, oldest first; the
absorbed steps leave silver. A step stored already joined joins again as one part, so joining
across silver runs gives what one run over everything gives.

Pure polars/numpy on small key frames; only the joined rows' token columns are touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.tables import ABORTED_FINISH_REASONS
from claw_pipelines.transforms.hashing import content_hashes, slice_content_hashes
from claw_pipelines.transforms.stitching import NO_PARENT as _NONE
from claw_pipelines.transforms.stitching import chain_ends

# the columns a step takes part in a join with (stored steps: the silver view's)
JOIN_COLUMNS = [
    "step_key",
    "trajectory_uid",
    "step_index",
    "tenant",
    "tokenizer",
    "finish_reason",
    "prompt_len",
    "response_len",
    "prompt_id",
    "response_id",
    "policy_version",
    "event_id",
    "token_source",
    "policy_version_runs",
    "policy_run_lengths",
    "partial_step_keys",
    "partial_event_ids",
]
_LISTS = {
    "policy_version_runs": pl.List(pl.Int64),
    "policy_run_lengths": pl.List(pl.Int64),
    "partial_step_keys": pl.List(pl.String),
    "partial_event_ids": pl.List(pl.String),
}
_MEMBERS = {"tail": pl.Int64, "order": pl.Int64, "stored": pl.Boolean, "row": pl.Int64}


def is_aborted(column: str = "finish_reason") -> pl.Expr:
    """Whether a step's generation was aborted or cut (ABORTED_FINISH_REASONS)."""
    return pl.col(column).is_in(list(ABORTED_FINISH_REASONS)).fill_null(False)


def oldest_version() -> pl.Expr:
    """The policy version of a step's oldest token: its first run's, else `policy_version`
    (null: 0)."""
    version = pl.col("policy_version").fill_null(0)
    return pl.min_horizontal(version, pl.col("policy_version_runs").list.min())


def with_runs(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame` with the run columns, typed (nulls where a frame from elsewhere lacks them)."""
    runs = pl.List(pl.Int64)
    return frame.with_columns(
        pl.col(c).cast(runs) if c in frame.columns else pl.lit(None, runs).alias(c)
        for c in ("policy_version_runs", "policy_run_lengths")
    )


def join_columns(frame: pl.DataFrame) -> pl.DataFrame:
    """`frame`'s JOIN_COLUMNS (those a new step lacks as nulls), typed as silver types them."""
    missing = [pl.lit(None, dtype).alias(c) for c, dtype in _LISTS.items() if c not in frame]
    return (
        frame.with_columns(missing)
        .select(JOIN_COLUMNS)
        .cast({"step_index": pl.Int64, "prompt_len": pl.Int64, "response_len": pl.Int64, **_LISTS})
    )


@dataclass(frozen=True)
class Chains:
    """Continuation chains found among new and stored steps: one row per member, `tail` (the
    new row of the chain's continuation, which holds the joined step), `order` (0: the
    chain's first partial) and where the member is (`stored`, `row`: its index in the new
    or the stored frame)."""

    members: pl.DataFrame

    @property
    def empty(self) -> bool:
        """Whether nothing joins."""
        return self.members.is_empty()

    def absorbed_new(self, height: int) -> np.ndarray:
        """Row mask over the new frame: the partials absorbed into a continuation."""
        mask = np.zeros(height, dtype=bool)
        gone = self.members.filter(~pl.col("stored") & (pl.col("row") != pl.col("tail")))
        mask[gone["row"].to_numpy()] = True
        return mask

    def absorbed_stored(self) -> np.ndarray:
        """Rows of the stored frame absorbed into a continuation."""
        return self.members.filter(pl.col("stored"))["row"].to_numpy()


def find_chains(new: pl.DataFrame, stored: pl.DataFrame) -> Chains:
    """The continuation chains of `new` steps (JOIN_COLUMNS, with `prompt_ids`) over the new
    steps and `stored` ones (JOIN_COLUMNS: silver's aborted steps of the same
    trajectories), by the join rule (module doc)."""
    none = Chains(pl.DataFrame(schema=_MEMBERS))
    nodes = pl.concat(
        [
            join_columns(stored).with_columns(stored=pl.lit(True), row=pl.int_range(pl.len())),
            join_columns(new).with_columns(stored=pl.lit(False), row=pl.int_range(pl.len())),
        ]
    ).with_columns(node=pl.int_range(pl.len(), dtype=pl.Int64), row=pl.col("row").cast(pl.Int64))
    parents = nodes.filter(is_aborted() & (pl.col("response_len") > 0)).select(
        "trajectory_uid",
        "tenant",
        parent="node",
        parent_index="step_index",
        parent_tokenizer="tokenizer",
        seq_len=pl.col("prompt_len") + pl.col("response_len"),
        parent_prompt_len="prompt_len",
        parent_prompt_id="prompt_id",
        parent_response_id="response_id",
    )
    if parents.is_empty():
        return none
    children = nodes.filter(~pl.col("stored") & (pl.col("response_len") > 0)).select(
        "trajectory_uid", "tenant", "tokenizer", "row", "step_index", "prompt_len", child="node"
    )
    pairs = children.join(
        parents,
        left_on=["trajectory_uid", "tenant", "prompt_len"],
        right_on=["trajectory_uid", "tenant", "seq_len"],
    ).filter(
        (pl.col("parent_index") < pl.col("step_index"))
        & pl.col("tokenizer").eq_missing(pl.col("parent_tokenizer"))
    )
    if pairs.is_empty():
        return none
    rows = pairs["row"].to_numpy()
    prompts = new["prompt_ids"].gather(rows).to_arrow()
    middle = pairs["parent_prompt_len"].to_numpy().astype(np.int64)
    stop = pairs["prompt_len"].to_numpy().astype(np.int64)
    head = pl.Series(slice_content_hashes(prompts, np.zeros(len(rows), np.int64), middle))
    tail = pl.Series(slice_content_hashes(prompts, middle, stop))
    same = (head == pairs["parent_prompt_id"]) & (tail == pairs["parent_response_id"])
    links = (
        pairs.filter(same.fill_null(False).to_numpy())
        .sort(["child", "parent_index"], descending=[False, True])
        .unique("child", keep="first", maintain_order=True)  # the nearest aborted predecessor
        .sort(["parent", "step_index", "child"])
        .unique("parent", keep="first", maintain_order=True)  # its earliest continuation
    )
    if links.is_empty():
        return none
    count = nodes.height
    parent = np.full(count, _NONE, dtype=np.int64)
    parent[links["child"].to_numpy()] = links["parent"].to_numpy()
    child = np.full(count, _NONE, dtype=np.int64)
    child[links["parent"].to_numpy()] = links["child"].to_numpy()
    in_chain = (parent != _NONE) | (child != _NONE)
    tail_of, _ = chain_ends(child)  # the chain's last step: the continuation that holds it
    _, depth = chain_ends(parent)  # members before it
    members = nodes.select("stored", "row").with_columns(
        tail=pl.Series(nodes["row"].to_numpy()[tail_of], dtype=pl.Int64),
        order=pl.Series(depth, dtype=pl.Int64),
    )
    return Chains(members.filter(pl.Series(in_chain)).select("tail", "order", "stored", "row"))


def join_chains(
    new: pl.DataFrame, stored: pl.DataFrame, stored_tokens: pl.DataFrame, chains: Chains
) -> pl.DataFrame:
    """`new` (silver step rows) with each chain's continuation replaced by the joined step
    and its absorbed new partials left out. `stored`: JOIN_COLUMNS of the stored steps the
    chains index; `stored_tokens`: step_key, rollout_log_probs, response_mask of the absorbed
    stored ones."""
    if chains.empty:
        return new
    new = new.with_columns(pl.lit(None, t).alias(c) for c, t in _LISTS.items() if c not in new)
    tails = chains.members["tail"].unique().sort().to_numpy()
    at = new[tails].with_columns(tail=pl.Series(tails, dtype=pl.Int64))
    joined = _joined(at, _parts(new, stored, stored_tokens, chains))
    absorbed = chains.absorbed_new(new.height)
    absorbed[tails] = True
    rest = new.filter(pl.Series(~absorbed))
    return pl.concat([rest, joined.select(rest.columns)], how="vertical_relaxed")


def _parts(
    new: pl.DataFrame, stored: pl.DataFrame, stored_tokens: pl.DataFrame, chains: Chains
) -> pl.DataFrame:
    """Every chain member in order, with what it adds to the joined step."""
    columns = ["tail", "order", "is_tail", *JOIN_COLUMNS, "rollout_log_probs", "response_mask"]
    members = chains.members.with_columns(
        is_tail=~pl.col("stored") & (pl.col("row") == pl.col("tail"))
    )
    own = join_columns(new).with_columns(
        new.select("rollout_log_probs", "response_mask"),
        row=pl.int_range(pl.len(), dtype=pl.Int64),
    )
    kept = join_columns(stored).with_columns(row=pl.int_range(pl.len(), dtype=pl.Int64))
    kept = kept.join(
        stored_tokens.select("step_key", "rollout_log_probs", "response_mask"),
        on="step_key",
        how="left",
    )
    return pl.concat(
        [
            members.filter(~pl.col("stored")).join(own, on="row").select(columns),
            members.filter(pl.col("stored")).join(kept, on="row").select(columns),
        ],
        how="vertical_relaxed",
    ).sort("tail", "order")


# token sources from the most exact: a joined step is as exact as its least exact part
EXACTNESS = ("upstream", "client", "local", "local_unverified")


def _joined(tails: pl.DataFrame, parts: pl.DataFrame) -> pl.DataFrame:
    """The continuations `tails` (silver rows with their `tail` index) as the joined steps
    of their chains' `parts`."""
    version = pl.col("policy_version").fill_null(0)
    ones = pl.lit(1, pl.Int8).repeat_by(pl.col("response_len"))
    mask = pl.when(pl.col("response_mask").is_null()).then(ones).otherwise("response_mask")
    earlier = ~pl.col("is_tail")
    parts = parts.with_columns(
        runs=pl.coalesce("policy_version_runs", pl.concat_list(version)),
        lengths=pl.coalesce("policy_run_lengths", pl.concat_list("response_len")),
        mask=mask.cast(pl.List(pl.Int8)),
        keys=pl.when(earlier).then(pl.concat_list(_or_none("partial_step_keys"), "step_key")),
        events=pl.when(earlier).then(pl.concat_list(_or_none("partial_event_ids"), "event_id")),
        rank=pl.col("token_source").replace_strict(
            {s: n for n, s in enumerate(EXACTNESS)}, default=None, return_dtype=pl.Int64
        ),
    )
    per_tail = parts.group_by("tail", maintain_order=True).agg(
        j_prompt_len=pl.col("prompt_len").first(),
        j_prompt_id=pl.col("prompt_id").first(),
        j_log_probs=pl.col("rollout_log_probs").list.explode(keep_nulls=False, empty_as_null=False),
        j_log_probs_missing=pl.col("rollout_log_probs").is_null().any(),
        j_masked=pl.col("response_mask").is_not_null().any(),
        j_mask=pl.col("mask").list.explode(keep_nulls=False, empty_as_null=False),
        j_keys=pl.col("keys").drop_nulls().list.explode(keep_nulls=False, empty_as_null=False),
        j_events=pl.col("events").drop_nulls().list.explode(keep_nulls=False, empty_as_null=False),
        j_rank=pl.col("rank").max(),
    )
    per_tail = per_tail.join(_merged_runs(parts), on="tail", maintain_order="left")
    at = tails.join(per_tail, on="tail", how="left", maintain_order="left")
    start = pl.col("j_prompt_len")
    several = pl.col("j_runs").list.len() > 1
    at = at.with_columns(
        prompt_ids=pl.col("prompt_ids").list.head(start),
        response_ids=pl.concat_list(pl.col("prompt_ids").list.slice(start), "response_ids"),
        prompt_len=start,
        response_len=pl.col("prompt_len") - start + pl.col("response_len"),
        prompt_id=pl.col("j_prompt_id"),
        rollout_log_probs=pl.when(~pl.col("j_log_probs_missing")).then("j_log_probs"),
        response_mask=pl.when(pl.col("j_masked")).then("j_mask"),
        token_source=pl.coalesce(
            pl.col("j_rank").replace_strict(dict(enumerate(EXACTNESS)), default=None),
            "token_source",
        ),
        policy_version_runs=pl.when(several).then("j_runs"),
        policy_run_lengths=pl.when(several).then("j_lengths"),
        partial_step_keys="j_keys",
        partial_event_ids="j_events",
    )
    at = at.with_columns(
        response_id=pl.Series(content_hashes(at["response_ids"].to_arrow()), dtype=pl.String),
        has_log_probs=pl.col("rollout_log_probs").is_not_null(),
    )
    return at.drop("tail", *(c for c in at.columns if c.startswith("j_")))


def _or_none(column: str) -> pl.Expr:
    """A list column of strings, an empty list where null."""
    return pl.coalesce(pl.col(column), pl.lit([], pl.List(pl.String)))


def _merged_runs(parts: pl.DataFrame) -> pl.DataFrame:
    """Per tail: its parts' (version, length) runs in order, adjacent equal versions merged
    (`j_runs`, `j_lengths`)."""
    flat = parts.select("tail", "runs", "lengths").explode("runs", "lengths")
    flat = flat.with_columns(
        run=pl.col("runs").ne_missing(pl.col("runs").shift(1)).cum_sum().over("tail")
    )
    merged = flat.group_by("tail", "run", maintain_order=True).agg(
        pl.col("runs").first(), pl.col("lengths").sum()
    )
    return merged.group_by("tail", maintain_order=True).agg(j_runs="runs", j_lengths="lengths")


def _response_lengths(steps: pl.DataFrame) -> np.ndarray:
    lengths = (
        steps["response_len"]
        if "response_len" in steps.columns
        else steps["response_ids"].list.len()
    )
    return lengths.fill_null(0).to_numpy().astype(np.int64)


def response_versions(steps: pl.DataFrame) -> np.ndarray:
    """The policy version of every response token of `steps` (`policy_version`,
    `response_len` or `response_ids`, and the runs when present), row after row: a joined
    step's runs, any other step's `policy_version` (null: 0) for all its tokens. Vectorized:
    the few joined steps' runs are expanded with one repeat and scattered into place."""
    lengths = _response_lengths(steps)
    version = steps["policy_version"].fill_null(0).to_numpy().astype(np.int32)
    runs = "policy_version_runs" in steps.columns
    joined = np.flatnonzero(steps["policy_version_runs"].is_not_null().to_numpy()) if runs else []
    if not len(joined):
        if len(version) and version.min() == version.max():  # one version: no repeat
            return np.full(int(lengths.sum()), version[0], dtype=np.int32)
        return np.repeat(version, lengths)
    out = np.repeat(version, lengths)
    runs = steps[joined].select(v="policy_version_runs", n="policy_run_lengths").explode("v", "n")
    values = np.repeat(runs["v"].to_numpy().astype(np.int32), runs["n"].to_numpy())
    sizes = lengths[joined]
    starts = (np.cumsum(lengths) - lengths)[joined]
    within = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    out[np.repeat(starts, sizes) + within] = values
    return out


def response_version_lists(steps: pl.DataFrame) -> pl.Series:
    """`response_versions` as one list per step (`token_policy_versions`, list<int64>)."""
    lengths = _response_lengths(steps)
    offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))
    lists = pa.ListArray.from_arrays(offsets, pa.array(response_versions(steps), pa.int64()))
    return pl.Series("token_policy_versions", lists)

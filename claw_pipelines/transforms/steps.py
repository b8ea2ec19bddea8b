"""Bronze step records → silver steps: normalize, drop duplicates, keep conflicts out.

Step records come from four sources, told apart by `source_kind`: white-box submissions
(`kind = step`), proxied completions (`chat_completion`, `completion`), the Claw-R1 proxy
routes (proxied, `metadata.scope_via = claw_r1`) and model calls read from traced spans
(`traced_call`, source `otel`). Unscoped proxied calls are placed by
`stitching` before their step keys are final. A white-box step's key is its client's; a
scoped proxied step's is the gateway's, so two records under it are two calls the gateway
numbered alike (`renumber_clashes`), never one step sent twice.

The token columns are the bulk of the data, so they are never sorted, joined or copied here:
decisions are made on small key frames and applied as row masks (usually keeping every row)
and column replacements.
"""

from __future__ import annotations

import hashlib

import numpy as np
import polars as pl

from claw_pipelines.transforms.contexts import prompt_content_ids
from claw_pipelines.transforms.hashing import content_hashes
from claw_pipelines.transforms.stitching import StitchInput, stitch

BRONZE_COLUMNS_OF_STEPS = [
    "event_id",
    "kind",
    "tenant",
    "received_at",
    "payload",
    "trajectory_uid",
    "prompt_uid",
    "step_index",
    "policy_version",
    "token_source",
    "prompt_ids",
    "response_ids",
    "rollout_log_probs",
    "response_mask",
    "reward",
    "is_last",
    "finish_reason",
    "model",
]
FACT_COLUMNS = ["event_id", "kind", "tenant", "received_at", "payload"]
KEY_COLUMNS = ["event_id", "step_key", "prompt_id", "response_id", "tenant", "created_at"]


def _meta(path: str) -> pl.Expr:
    return pl.col("payload").str.json_path_match(f"$.metadata.{path}")


def step_candidates(steps: pl.DataFrame) -> pl.DataFrame:
    """Step records (rows of step kinds) with the derived silver columns; rows stay in place."""
    via = _meta("scope_via")
    return steps.with_columns(
        metadata=pl.col("payload").str.json_path_match("$.metadata").fill_null("{}"),
        unscoped=((pl.col("kind") != "step") & (_meta("scoped") == "false")).fill_null(False),
        group_from_client=_meta("prompt_group_via") == "client",
        client_retry=_meta("client_retry").cast(pl.Int64, strict=False).fill_null(0),
        source_kind=pl.when(pl.col("kind") == "step")
        .then(pl.lit("white_box"))
        .when(via == "claw_r1")
        .then(pl.lit("claw_r1"))
        .when(pl.col("kind") == "traced_call")
        .then(pl.lit("otel"))
        .otherwise(pl.lit("proxy")),
        created_at=pl.col("received_at"),
        received_us=pl.col("received_at").dt.epoch("us"),
        origin_step_key=pl.lit(None, pl.String),
        prompt_len=pl.col("prompt_ids").list.len().cast(pl.Int64),
        response_len=pl.col("response_ids").list.len().cast(pl.Int64),
        sequence_hash=pl.lit(None, pl.Int64),
        has_log_probs=pl.col("rollout_log_probs").is_not_null(),
        tokenizer=_meta("tokenizer.fingerprint"),
    ).drop("payload")


def first_arrivals(frame: pl.DataFrame, known_event_ids: pl.Series) -> np.ndarray:
    """Row mask: the first-received row of each event_id not already stored."""
    order = frame.select("event_id", "received_at").with_row_index("row")
    first = (
        order.sort("received_at", "event_id")
        .unique("event_id", keep="first")
        .filter(~pl.col("event_id").is_in(known_event_ids.implode()))
    )
    keep = np.zeros(frame.height, dtype=bool)
    keep[first["row"].to_numpy()] = True
    return keep


def keep_rows(frame: pl.DataFrame, mask: np.ndarray) -> pl.DataFrame:
    """`frame` restricted to `mask` (no copy when every row is kept)."""
    return frame if mask.all() else frame.filter(pl.Series(mask))


def with_content_ids(frame: pl.DataFrame) -> pl.DataFrame:
    """Add `prompt_id` / `response_id`: BLAKE2b-128 of the token ids (a prompt that goes on
    from the step before it in its trajectory is hashed on from that step's: its new tokens
    only, `contexts.prompt_content_ids`)."""
    by_turn = {"trajectory_uid", "step_index"} <= set(frame.columns)
    prompts = (
        prompt_content_ids(frame) if by_turn else content_hashes(frame["prompt_ids"].to_arrow())
    )
    return frame.with_columns(
        prompt_id=pl.Series(prompts, dtype=pl.String),
        response_id=pl.Series(content_hashes(frame["response_ids"].to_arrow()), dtype=pl.String),
    )


def _prompt_groups(tenant: pl.Series, prompt_id: pl.Series) -> pl.Series:
    """Content-derived group of an unscoped first call: same tenant + same prompt ids."""
    return pl.Series(
        [
            "pg-" + hashlib.blake2b(f"{t}\x00{p}".encode(), digest_size=12).hexdigest()
            for t, p in zip(tenant.to_list(), prompt_id.to_list(), strict=True)
        ],
        dtype=pl.String,
    )


def place_unscoped(candidates: pl.DataFrame, anchors: pl.DataFrame, window_us: int) -> pl.DataFrame:
    """Give unscoped calls their stitched trajectory, step index and prompt group.

    `anchors` are earlier unscoped steps already in silver (see `stitching.StitchInput`) with
    their `prompt_uid`. The key the gateway gave a call is kept as `origin_step_key`.
    """
    rows = np.flatnonzero(candidates["unscoped"].to_numpy())
    if len(rows) == 0:
        return candidates
    calls = candidates[rows]  # only the unscoped rows are copied
    placed = stitch(StitchInput(calls, anchors, window_us))
    own_group = calls.select(
        pl.when(pl.col("group_from_client"))
        .then(pl.col("prompt_uid"))
        .otherwise(_prompt_groups(calls["tenant"], calls["prompt_id"]))
    ).to_series()
    head_anchor, head_call = placed["head_anchor"], placed["head_call"]
    group = own_group.gather(head_call.clip(0))
    if anchors.height:
        from_anchor = anchors["prompt_uid"].gather(head_anchor.clip(0))
        group = pl.select(pl.when(head_anchor >= 0).then(from_anchor).otherwise(group)).to_series()
    updates = {
        "origin_step_key": calls["trajectory_uid"] + ":" + calls["step_index"].cast(pl.String),
        "trajectory_uid": placed["trajectory_uid"],
        "step_index": placed["step_index"],
        "prompt_uid": group,
        "sequence_hash": placed["sequence_hash"],
    }
    return candidates.with_columns(
        candidates[name].cast(values.dtype).clone().scatter(rows, values).alias(name)
        for name, values in updates.items()
    )


def with_step_keys(frame: pl.DataFrame) -> pl.DataFrame:
    """Add `step_key` = "{trajectory_uid}:{step_index}"."""
    return frame.with_columns(
        step_key=pl.col("trajectory_uid") + ":" + pl.col("step_index").cast(pl.String)
    )


def renumber_clashes(candidates: pl.DataFrame, stored: pl.DataFrame) -> tuple[pl.DataFrame, int]:
    """(candidates where each scoped proxied step whose key another call holds has a key of
    its own, how many moved).

    The gateway numbers a scoped trajectory's proxied steps, so two records under one key
    with different event ids are two calls, never one call sent twice (a retry of one call
    keeps its event ids): it numbered them alike without knowing of the other (gateways
    serving one trajectory at once, the calls not showing each other's turns; docs/DESIGN.md
    §4). The holder keeps the key (the stored step, else the first received); each other
    takes `step_index` = the microsecond it was received, beyond any index a gateway or a
    white-box client gives (so it moves no other step, and a rebuild decides as an increment
    does), with `metadata.renumbered_from` the key its client was given. White-box steps
    (their client's keys) are left to `split_duplicates`.

    `candidates` needs `event_id, step_key, trajectory_uid, step_index, received_at,
    received_us, source_kind, unscoped, metadata`; `stored` silver's `step_key, event_id`
    of their keys.
    """
    if stored.is_empty() and candidates["step_key"].n_unique() == candidates.height:
        return candidates, 0  # no key taken twice (the common case: one hash pass)
    keys = candidates.select("step_key", "event_id", "received_at").with_row_index("row")
    first = keys.sort("received_at", "event_id").unique("step_key", keep="first")
    holders = pl.concat(
        [stored.select("step_key", "event_id"), first.select("step_key", "event_id")]
    ).unique("step_key", keep="first", maintain_order=True)
    numbered = (pl.col("source_kind") != "white_box") & ~pl.col("unscoped").fill_null(False)
    rows = (
        keys.join(holders.rename({"event_id": "holder"}), on="step_key")
        .filter(pl.col("holder") != pl.col("event_id"))
        .join(candidates.select(numbered.alias("numbered")).with_row_index("row"), on="row")
        .filter("numbered")["row"]
        .sort()
    )
    if rows.is_empty():
        return candidates, 0
    moved = candidates.select("trajectory_uid", "step_key", "event_id", "received_us", "metadata")[
        rows
    ]
    moved = moved.with_row_index("at").sort("event_id")
    moved = moved.with_columns(
        step_index=pl.col("received_us")
        + pl.int_range(pl.len(), dtype=pl.Int64).over("trajectory_uid", "received_us")
    ).sort("at")
    marker = pl.struct(renumbered_from="step_key").struct.json_encode()
    rest = pl.col("metadata").str.slice(1)  # the metadata's members and closing brace
    updates = moved.select(
        "step_index",
        step_key=pl.col("trajectory_uid") + ":" + pl.col("step_index").cast(pl.String),
        metadata=pl.when(pl.col("metadata") == "{}")
        .then(marker)
        .otherwise(pl.concat_str(marker.str.head(-1), pl.lit(","), rest)),
    )
    return candidates.with_columns(
        candidates[name].cast(updates[name].dtype).clone().scatter(rows, updates[name])
        for name in updates.columns
    ), len(rows)


def split_duplicates(
    candidates: pl.DataFrame, stored: pl.DataFrame
) -> tuple[np.ndarray, pl.DataFrame, int]:
    """(row mask of new steps, conflicts, exact duplicates dropped), decided on key columns.

    `candidates` needs `event_id, step_key, prompt_id, response_id, received_at`; `stored`
    holds silver's `step_key, event_id, prompt_id, response_id`. A candidate whose step_key
    is already taken (in silver, or by an earlier candidate) with the same tokens is an exact
    duplicate and dropped; with different tokens it is a conflict, kept out of silver with
    the kept step's ids beside it. First received wins.
    """
    kept_cols = {
        "event_id": "kept_event_id",
        "prompt_id": "kept_prompt_id",
        "response_id": "kept_response_id",
    }
    keys = candidates.select(
        *[c for c in KEY_COLUMNS if c in candidates.columns], "received_at"
    ).with_row_index("row")
    arrival = keys.sort("received_at", "event_id")
    earlier = (
        pl.concat(
            [
                stored.select("step_key", *kept_cols),
                arrival.unique("step_key", keep="first", maintain_order=True).select(
                    "step_key", *kept_cols
                ),
            ],
            how="vertical_relaxed",
        )
        .unique("step_key", keep="first", maintain_order=True)
        .rename(kept_cols)
    )
    judged = keys.join(earlier, on="step_key", how="left")
    is_self = pl.col("event_id") == pl.col("kept_event_id")
    same = (pl.col("prompt_id") == pl.col("kept_prompt_id")) & (
        pl.col("response_id") == pl.col("kept_response_id")
    )
    new_rows = judged.filter(is_self)["row"].to_numpy()
    rest = judged.filter(~is_self)
    conflicts = rest.filter(~same).drop("row", "received_at")
    keep = np.zeros(candidates.height, dtype=bool)
    keep[new_rows] = True
    return keep, conflicts, rest.height - conflicts.height

"""`claw export`: a gold partition as verl-style Parquet or JSON lines, SFT messages or
preference pairs.

verl (`verl-parquet`, `jsonl`), one row per step:

| export column | from the gold dataset |
|---|---|
| `uid` | `prompt_uid` (the GRPO group), else `trajectory_uid`: verl groups rollouts by `uid` |
| `prompts` | `prompt_ids` (list<int32>) |
| `responses` | `response_ids` (list<int32>) |
| `response_mask` | `response_mask`, all ones when absent (list<int8>) |
| `old_log_probs` | `rollout_log_probs` (list<float32>; null when not captured) |
| `token_level_rewards` | `reward` on the last response token, zeros elsewhere (list<float32>) |
| `reward`, `reward_status`, `advantage` | resolved reward, its status, GRPO advantage |
| `step_key`, `trajectory_uid`, `step_index`, `policy_version` | provenance |

`sft-messages` (JSON lines, one per step; e.g. of the built-in `sft-successes` dataset):
`messages` (the prompt's turns, then the sampled reply as the assistant's, decoded with the
step's own tokenizer: claw_pipelines.lake.decoding), `prompt_ids`, `response_ids`,
`response_mask` (loss on the reply alone), `reward`, `trajectory_return`, the provenance
columns and `decoded_with` (the tokenizer's name and fingerprint, and `via`: `template` or
`recorded`).

`preference-pairs` (JSON lines, one per prompt group whose returns differ; e.g. of the
built-in `preference-pairs` dataset): the best and the worst trajectory by return (ties: the
smallest uid), each as its last step, the whole conversation: `prompt` (the first turn's
prompt messages), `chosen` / `rejected` (the messages after it), `prompt_ids`, `chosen_ids`,
`rejected_ids` (token ids after the prompt), `chosen_return`, `rejected_return`, the
group and trajectory ids and `decoded_with`: TRL's DPO layout, with the exact tokens beside
it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import polars as pl
import pyarrow.parquet as pq
from tqdm import tqdm

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.lake.decoding import decode_steps, recorded_requests, resolver
from claw_pipelines.transforms.shapes import verl_frame

Format = Literal["verl-parquet", "jsonl", "sft-messages", "preference-pairs"]
FORMATS = ("verl-parquet", "jsonl", "sft-messages", "preference-pairs")
CHUNK_ROWS = 1024


def sft_frame(
    steps: pl.DataFrame, resolve: Callable[[str | None], Any], recorded: dict[str, dict]
) -> pl.DataFrame:
    """Gold steps as SFT records: messages and token ids (see the module doc)."""
    decoded = decode_steps(steps, resolve, recorded)
    joined = steps.join(decoded, on="step_key", how="left", maintain_order="left")
    return joined.select(
        *sft_record(pl.concat_list("prompt_messages", "reply")), decoded_with="decoded_with"
    )


def sft_record(messages: pl.Expr) -> list[pl.Expr]:
    """An SFT record's columns beside its `messages` (see the module doc)."""
    ones = pl.col("response_ids").list.eval(pl.element() * 0 + 1).cast(pl.List(pl.Int8))
    return [
        messages.alias("messages"),
        pl.col("prompt_ids"),
        pl.col("response_ids"),
        pl.coalesce(pl.col("response_mask"), ones).alias("response_mask"),
        pl.col("reward"),
        pl.col("trajectory_return"),
        pl.col("step_key"),
        pl.col("trajectory_uid"),
        pl.col("step_index"),
        pl.col("policy_version"),
    ]


def preference_frame(
    steps: pl.DataFrame, resolve: Callable[[str | None], Any], recorded: dict[str, dict]
) -> pl.DataFrame:
    """Per prompt group whose returns differ, its best and worst trajectory (module doc)."""
    group = pl.coalesce("prompt_uid", "trajectory_uid")
    ends = (
        steps.filter(pl.col("trajectory_return").is_not_null())
        .sort("step_index")
        .group_by("trajectory_uid", maintain_order=True)
        .agg(
            group=group.first(),
            ret=pl.col("trajectory_return").first(),
            first_key=pl.col("step_key").first(),
            last_key=pl.col("step_key").last(),
            prompt_ids=pl.col("prompt_ids").first(),
            sequence=pl.concat_list("prompt_ids", "response_ids").last(),
        )
    )
    ranked = ends.sort("ret", "trajectory_uid", descending=[True, False])
    best = ranked.group_by("group", maintain_order=True).first()
    worst = ends.sort("ret", "trajectory_uid").group_by("group", maintain_order=True).first()
    pairs = best.join(worst, on="group", suffix="_worst").filter(
        pl.col("ret") > pl.col("ret_worst")
    )
    cut = pl.col("prompt_ids").list.len()
    pairs = pairs.with_columns(
        chosen_ids=pl.col("sequence").list.slice(cut),
        rejected_ids=pl.col("sequence_worst").list.slice(pl.col("prompt_ids_worst").list.len()),
    ).sort("group")
    wanted = pl.concat(
        [pairs[c] for c in ("first_key", "last_key", "first_key_worst", "last_key_worst")]
    ).unique()
    decoded = decode_steps(
        steps.filter(pl.col("step_key").is_in(wanted.implode())), resolve, recorded
    )
    whole = decoded.select(
        "step_key",
        "prompt_messages",
        "decoded_with",
        conversation=pl.concat_list("prompt_messages", "reply"),
    )

    def joined(frame: pl.DataFrame, key: str, suffix: str) -> pl.DataFrame:
        renamed = whole.rename({c: f"{c}{suffix}" for c in whole.columns if c != "step_key"})
        return frame.join(renamed, left_on=key, right_on="step_key", how="left")

    pairs = joined(pairs, "first_key", "_first")
    pairs = joined(pairs, "last_key", "_last")
    pairs = joined(pairs, "first_key_worst", "_first_worst")
    pairs = joined(pairs, "last_key_worst", "_last_worst")
    first = pl.col("prompt_messages_first")
    first_worst = pl.col("prompt_messages_first_worst")
    return pairs.select(
        prompt_uid="group",
        prompt=first,
        chosen=pl.col("conversation_last").list.slice(first.list.len()),
        rejected=pl.col("conversation_last_worst").list.slice(first_worst.list.len()),
        prompt_ids="prompt_ids",
        chosen_ids="chosen_ids",
        rejected_ids="rejected_ids",
        chosen_return="ret",
        rejected_return="ret_worst",
        chosen_trajectory="trajectory_uid",
        rejected_trajectory="trajectory_uid_worst",
        decoded_with="decoded_with_last",
    )


def export(
    dataset: Dataset,
    policy_version: int,
    fmt: Format,
    out: Path,
    tokenizer: str | None = None,
) -> int:
    """Write one partition of `dataset` to `out`; return the number of records written
    (steps, or pairs). Messages are decoded with each step's own tokenizer (the lake keeps
    it); `tokenizer`: the folder for steps that name none. Undecodable names a step that
    cannot be decoded."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    steps = dataset.steps(policy_version)
    if steps.is_empty():
        raise LookupError(f"{dataset.name} has no steps for policy version {policy_version}")
    if fmt in ("sft-messages", "preference-pairs"):
        resolve = resolver(dataset.lake, tokenizer)
        recorded = recorded_requests(dataset.lake, steps)
    if fmt == "sft-messages":
        frame = sft_frame(steps, resolve, recorded)
    elif fmt == "preference-pairs":
        frame = preference_frame(steps, resolve, recorded)
        if frame.is_empty():
            raise LookupError(
                f"{dataset.name} v{policy_version} has no prompt group whose returns differ"
            )
    else:
        frame = verl_frame(steps)
    out.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(
        total=frame.height,
        unit="step",
        desc=f"export {dataset.name} v{policy_version}",
        file=sys.stderr,
    )
    with bar:
        if fmt == "verl-parquet":
            schema = frame.head(0).to_arrow().schema
            with pq.ParquetWriter(out, schema) as writer:
                for chunk in frame.iter_slices(CHUNK_ROWS):
                    writer.write_table(chunk.to_arrow().cast(schema))
                    bar.update(chunk.height)
        else:
            with out.open("w", encoding="utf-8") as handle:
                for chunk in frame.iter_slices(CHUNK_ROWS):
                    for row in chunk.iter_rows(named=True):
                        handle.write(json.dumps(row) + "\n")
                    bar.update(chunk.height)
    return frame.height

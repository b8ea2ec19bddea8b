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
`messages` (the prompt's ChatML turns, then the sampled reply as the assistant's, decoded
with the lake's tokenizer), `prompt_ids`, `response_ids`, `response_mask` (loss on the
reply alone), `reward`, `trajectory_return` and the provenance columns.

`preference-pairs` (JSON lines, one per prompt group whose returns differ; e.g. of the
built-in `preference-pairs` dataset): the best and the worst trajectory by return (ties: the
smallest uid), each as its last step, the whole conversation: `prompt` (the first turn's
prompt messages), `chosen` / `rejected` (the messages after it), `prompt_ids`, `chosen_ids`,
`rejected_ids` (token ids after the prompt), `chosen_return`, `rejected_return`, and the
group and trajectory ids: TRL's DPO layout, with the exact tokens beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import polars as pl
import pyarrow.parquet as pq
from tqdm import tqdm

from claw_pipelines.consume import Dataset
from claw_pipelines.tokenization import IM_END, decode_lists

Format = Literal["verl-parquet", "jsonl", "sft-messages", "preference-pairs"]
FORMATS = ("verl-parquet", "jsonl", "sft-messages", "preference-pairs")
TURN = r"<\|im_start\|>(?s:.*?)<\|im_end\|>"
OPEN_TURN = r"<\|im_start\|>(?s:.*?)(?:<\|im_end\|>|$)"  # a last turn may be unterminated
CHUNK_ROWS = 1024


def verl_frame(steps: pl.DataFrame) -> pl.DataFrame:
    """Gold steps in verl's column names and shapes (see the module doc)."""
    ones = pl.col("response_ids").list.eval(pl.element() * 0 + 1).cast(pl.List(pl.Int8))
    zeros = pl.col("response_ids").list.eval(pl.element() * 0.0).cast(pl.List(pl.Float32))
    last_reward = pl.col("reward").fill_null(0.0).cast(pl.Float32)
    return steps.select(
        uid=pl.coalesce("prompt_uid", "trajectory_uid"),
        prompts="prompt_ids",
        responses="response_ids",
        response_mask=pl.coalesce(pl.col("response_mask"), ones),
        old_log_probs="rollout_log_probs",
        token_level_rewards=pl.when(pl.col("response_ids").list.len() > 0)
        .then(
            pl.concat_list(
                zeros.list.head(pl.col("response_ids").list.len() - 1),
                last_reward,
            )
        )
        .otherwise(zeros),
        reward="reward",
        reward_status="reward_status",
        advantage="advantage",
        step_key="step_key",
        trajectory_uid="trajectory_uid",
        step_index="step_index",
        policy_version="policy_version",
    )


def chat_messages(texts: pl.Series, last_open: bool = False) -> pl.Series:
    """The ChatML turns of decoded token ids as message lists ({role, content}). A prompt's
    trailing generation prompt (an open turn) is left out; with `last_open` (a whole
    sequence, its reply last) an unterminated last turn is a message too."""
    turn = pl.element().str.strip_suffix(IM_END)
    turns = pl.DataFrame({"text": texts}).select(
        pl.col("text")
        .str.extract_all(OPEN_TURN if last_open else TURN)
        .list.eval(
            pl.struct(
                role=turn.str.extract(r"^<\|im_start\|>([^\n]*)\n"),
                content=turn.str.extract(r"^<\|im_start\|>[^\n]*\n((?s:.*))$"),
            )
        )
    )
    return turns.to_series().alias("messages")


def _reply(texts: pl.Series) -> pl.Expr:
    """The assistant message of decoded replies (its end-of-turn token dropped)."""
    content = pl.lit(texts).str.strip_suffix(IM_END)
    return pl.concat_list(pl.struct(role=pl.lit("assistant"), content=content))


def sft_frame(steps: pl.DataFrame, tokenizer: str | None = None) -> pl.DataFrame:
    """Gold steps as SFT records: messages and token ids (see the module doc)."""
    prompts = chat_messages(decode_lists(steps["prompt_ids"].to_arrow(), tokenizer))
    replies = decode_lists(steps["response_ids"].to_arrow(), tokenizer)
    ones = pl.col("response_ids").list.eval(pl.element() * 0 + 1).cast(pl.List(pl.Int8))
    return steps.with_columns(prompt_messages=prompts).select(
        messages=pl.concat_list("prompt_messages", _reply(replies)),
        prompt_ids="prompt_ids",
        response_ids="response_ids",
        response_mask=pl.coalesce(pl.col("response_mask"), ones),
        reward="reward",
        trajectory_return="trajectory_return",
        step_key="step_key",
        trajectory_uid="trajectory_uid",
        step_index="step_index",
        policy_version="policy_version",
    )


def preference_frame(steps: pl.DataFrame, tokenizer: str | None = None) -> pl.DataFrame:
    """Per prompt group whose returns differ, its best and worst trajectory (module doc)."""
    group = pl.coalesce("prompt_uid", "trajectory_uid")
    ends = (
        steps.filter(pl.col("trajectory_return").is_not_null())
        .sort("step_index")
        .group_by("trajectory_uid", maintain_order=True)
        .agg(
            group=group.first(),
            ret=pl.col("trajectory_return").first(),
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

    def messages(column: str, last_open: bool = False) -> pl.Series:
        return chat_messages(decode_lists(pairs[column].to_arrow(), tokenizer), last_open)

    pairs = pairs.with_columns(
        prompt=messages("prompt_ids"),
        prompt_worst=messages("prompt_ids_worst"),
        whole=messages("sequence", last_open=True),
        whole_worst=messages("sequence_worst", last_open=True),
    )
    return pairs.select(
        prompt_uid="group",
        prompt="prompt",
        chosen=pl.col("whole").list.slice(pl.col("prompt").list.len()),
        rejected=pl.col("whole_worst").list.slice(pl.col("prompt_worst").list.len()),
        prompt_ids="prompt_ids",
        chosen_ids="chosen_ids",
        rejected_ids="rejected_ids",
        chosen_return="ret",
        rejected_return="ret_worst",
        chosen_trajectory="trajectory_uid",
        rejected_trajectory="trajectory_uid_worst",
    )


def export(
    dataset: Dataset,
    policy_version: int,
    fmt: Format,
    out: Path,
    tokenizer: str | None = None,
) -> int:
    """Write one partition of `dataset` to `out` (`tokenizer`: decodes messages; default the
    bundled one); return the number of records written (steps, or pairs)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {', '.join(FORMATS)}")
    steps = dataset.steps(policy_version)
    if steps.is_empty():
        raise LookupError(f"{dataset.name} has no steps for policy version {policy_version}")
    if fmt == "sft-messages":
        frame = sft_frame(steps, tokenizer)
    elif fmt == "preference-pairs":
        frame = preference_frame(steps, tokenizer)
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

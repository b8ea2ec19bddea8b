"""`claw export`: a gold partition as verl-style Parquet or JSON lines.

Column mapping (one row per step):

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

Format = Literal["verl-parquet", "jsonl"]
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


def export(dataset: Dataset, policy_version: int, fmt: Format, out: Path) -> int:
    """Write one partition of `dataset` to `out`; return the number of steps written."""
    steps = dataset.steps(policy_version)
    if steps.is_empty():
        raise LookupError(f"{dataset.name} has no steps for policy version {policy_version}")
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
        elif fmt == "jsonl":
            with out.open("w", encoding="utf-8") as handle:
                for chunk in frame.iter_slices(CHUNK_ROWS):
                    for row in chunk.iter_rows(named=True):
                        handle.write(json.dumps(row) + "\n")
                    bar.update(chunk.height)
        else:
            raise ValueError(f"unknown format {fmt!r}: use verl-parquet or jsonl")
    return frame.height

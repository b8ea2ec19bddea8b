"""A large simulated lake written straight to bronze, in gateway micro-batches: GRPO groups of
multi-turn white-box rollouts with rewards, built column-wise (for scale tests and benchmarks
of what reads the lake, where going through the gateway would only measure the gateway). A
share of the rollouts may compact their context (`BulkShape.compacting`): every
`compact_every` turns they replace their history with the prompt and a summary. `AGENTIC` is
the long-trajectory shape: 30 turns of an agent resending its whole history (2-4 k-token
prompts, 100-400-token replies, 200-1,500-token tool results: ~19,000 tokens a step)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from claw_pipelines.contracts.tables import BRONZE_EVENTS, LOGPROB_LIST, TOKEN_LIST, UTC_MICROS
from claw_pipelines.lake.delta import Lake

T0 = datetime(2026, 11, 30, tzinfo=UTC)
VOCAB = 8_000


@dataclass(frozen=True)
class BulkShape:
    """How the simulated traffic looks: groups of rollouts, turns, token lengths, versions."""

    rollouts: int = 8
    turns: int = 3
    prompt_tokens: tuple[int, int] = (40, 120)
    response_tokens: tuple[int, int] = (16, 64)
    tool_tokens: tuple[int, int] = (8, 24)
    groups_per_policy_version: int = 1_000
    tenants: tuple[str, ...] = ("math", "support", "coding")
    compacting: float = 0.0  # the share of each group's rollouts that compact their history
    compact_every: int = 2  # turns between two compactions of such a rollout


# long agentic trajectories: 8 rollouts x 30 turns a group, each turn's prompt the whole
# history so far (the prompt, every reply and every tool result); 6 groups are 1,440 steps,
# ~27 M tokens sent and ~1.5 M distinct (`token_counts`)
AGENTIC = BulkShape(
    turns=30,
    prompt_tokens=(2_000, 4_000),
    response_tokens=(100, 400),
    tool_tokens=(200, 1_500),
)


def _lists(arrays: list[np.ndarray], kind: pa.DataType) -> pa.Array:
    """A list array from numpy pieces, built with one concatenation."""
    offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
    values = np.concatenate(arrays) if arrays else np.empty(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, kind.value_type))


def group_rows(group: int, shape: BulkShape, rng: np.random.Generator) -> list[dict]:
    """One GRPO group: `rollouts` trajectories of `turns` nested steps sharing one prompt,
    then a trajectory_complete record with each trajectory's return."""
    prompt = rng.integers(0, VOCAB, int(rng.integers(*shape.prompt_tokens)), dtype=np.int32)
    start = T0 + timedelta(seconds=group * 0.5)
    tenant = shape.tenants[group % len(shape.tenants)]
    version = group // shape.groups_per_policy_version
    rows = []
    compacting = round(shape.rollouts * shape.compacting)  # the first ones of each group
    for rollout in range(shape.rollouts):
        trajectory, history = f"bulk-{group}-r{rollout}", prompt
        for turn in range(shape.turns):
            if rollout < compacting and turn and turn % shape.compact_every == 0:
                summary = rng.integers(0, VOCAB, int(rng.integers(*shape.tool_tokens)), np.int32)
                history = np.concatenate([prompt, summary])  # earlier turns summarized
            response = rng.integers(0, VOCAB, int(rng.integers(*shape.response_tokens)), np.int32)
            rows.append(
                {
                    "kind": "step",
                    "tenant": tenant,
                    "received_at": start + timedelta(seconds=turn * 2.0 + rollout * 0.01),
                    "trajectory_uid": trajectory,
                    "prompt_uid": f"bulk-g{group}",
                    "step_index": turn,
                    "policy_version": version,
                    "prompt_ids": history,
                    "response_ids": response,
                }
            )
            tool = rng.integers(0, VOCAB, int(rng.integers(*shape.tool_tokens)), dtype=np.int32)
            history = np.concatenate([history, response, tool])
        rows.append(
            {
                "kind": "trajectory_complete",
                "tenant": tenant,
                "received_at": start + timedelta(seconds=shape.turns * 2.0 + rollout * 0.01),
                "trajectory_uid": trajectory,
                "reward": float(rng.random() < 0.5),
            }
        )
    return rows


def _payload(row: dict, event_id: str) -> str:
    """The record's canonical JSON payload, as the gateway stores it."""
    if row["kind"] == "trajectory_complete":
        body = {"trajectory_uid": row["trajectory_uid"], "reward": row["reward"]}
        return json.dumps(body | {"status": "complete", "metadata": {}, "event_id": event_id})
    body = {key: row[key] for key in ("trajectory_uid", "prompt_uid", "step_index")}
    extra = {"policy_version": row["policy_version"], "is_last": False, "metadata": {}}
    return json.dumps(body | extra | {"event_id": event_id})


def bronze_batch(rows: list[dict], batch_seq: int, rng: np.random.Generator) -> pa.Table:
    """Records as one gateway micro-batch in the bronze schema."""
    empty = np.empty(0, np.int32)
    event_ids = [uuid.uuid4().hex for _ in rows]
    received = [r["received_at"] for r in rows]
    responses = [r.get("response_ids", empty) for r in rows]
    steps = [r["kind"] == "step" for r in rows]
    n = len(rows)
    return pa.table(
        {
            "event_id": event_ids,
            "kind": [r["kind"] for r in rows],
            "tenant": [r["tenant"] for r in rows],
            "received_at": pa.array(received, UTC_MICROS),
            "ingest_date": pa.array([t.date() for t in received], pa.date32()),
            "gateway_id": ["gw-bulk"] * n,
            "batch_seq": [batch_seq] * n,
            "schema_version": pa.array([1] * n, pa.int32()),
            "payload": [_payload(r, e) for r, e in zip(rows, event_ids, strict=True)],
            "trajectory_uid": [r["trajectory_uid"] for r in rows],
            "prompt_uid": [r.get("prompt_uid") for r in rows],
            "step_index": [r.get("step_index") for r in rows],
            "policy_version": [r.get("policy_version") for r in rows],
            "token_source": ["client" if s else None for s in steps],
            "prompt_ids": _lists([r.get("prompt_ids", empty) for r in rows], TOKEN_LIST),
            "response_ids": _lists(responses, TOKEN_LIST),
            "rollout_log_probs": _lists(
                [-rng.random(len(r), dtype=np.float32) * 4 for r in responses], LOGPROB_LIST
            ),
        }
    )


def bulk_batches(steps: int, shape: BulkShape, batch: int, seed: int) -> Iterator[pa.Table]:
    """Bronze micro-batches holding at least `steps` steps, in arrival order."""
    rng = np.random.default_rng(seed)
    per_group = shape.rollouts * shape.turns
    pending: list[dict] = []
    seq = 0
    for group in range(-(-steps // per_group)):
        pending += group_rows(group, shape, rng)
        if len(pending) >= batch:
            yield bronze_batch(pending, seq, rng)
            pending, seq = [], seq + 1
    if pending:
        yield bronze_batch(pending, seq, rng)


def write_bulk_bronze(
    lake: Lake, steps: int, shape: BulkShape = BulkShape(), batch: int = 5_000, seed: int = 7
) -> int:
    """Append a simulated bronze of at least `steps` steps; return the records written."""
    written = 0
    for table in bulk_batches(steps, shape, batch, seed):
        lake.append(BRONZE_EVENTS, table)
        written += table.num_rows
    return written


def token_counts(table: pa.Table) -> tuple[int, int]:
    """(sent, distinct) tokens of the steps in bronze records of whole groups without
    compaction: sent is every step's prompt and reply; distinct counts each group's prompt
    once and each trajectory's replies and tool results once (its last prompt and reply
    beyond the group's prompt): the tokens no earlier context of the group held."""
    steps = pl.from_arrow(table.select(["kind", "trajectory_uid", "prompt_uid", "step_index"]))
    assert isinstance(steps, pl.DataFrame)
    prompts = pc.list_value_length(table["prompt_ids"]).fill_null(0).to_numpy()
    replies = pc.list_value_length(table["response_ids"]).fill_null(0).to_numpy()
    steps = steps.with_columns(prompt=pl.Series(prompts), reply=pl.Series(replies)).filter(
        pl.col("kind") == "step"
    )
    first = steps.filter(pl.col("step_index") == 0)
    last = steps.sort("step_index").group_by("trajectory_uid").last()
    group_prompts = first.group_by("prompt_uid").agg(pl.col("prompt").first())["prompt"].sum()
    grown = last.join(first.select("trajectory_uid", start="prompt"), on="trajectory_uid")
    added = (grown["prompt"] + grown["reply"] - grown["start"]).sum()
    return int(steps["prompt"].sum() + steps["reply"].sum()), int(group_prompts + added)

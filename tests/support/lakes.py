"""Build small lakes for tests through the lake module: bronze records as the gateway writes
them (envelope, canonical JSON payload, typed token columns), then real silver runs."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pyarrow as pa

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.lake.delta import Lake

T0 = datetime(2026, 11, 30, tzinfo=UTC)
# the spec a live trainer pulls GRPO groups from: complete groups, merged, GRPO advantages
LIVE = CurationSpec(
    name="live",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    complete_groups_only=True,
    merge="prompt_group",
    advantage="grpo",
)
_clock = iter(range(10**9))


def _envelope(kind: str, payload: dict, tenant: str) -> dict:
    event_id = payload.setdefault("event_id", uuid.uuid4().hex)
    received = T0 + timedelta(milliseconds=next(_clock))
    return {
        "event_id": event_id,
        "kind": kind,
        "tenant": tenant,
        "received_at": received,
        "ingest_date": received.date(),
        "gateway_id": "gw-test",
        "batch_seq": 0,
        "schema_version": 1,
        "payload": json.dumps(payload),
    }


def step(
    trajectory: str,
    index: int,
    prompt: list[int],
    response: list[int],
    *,
    group: str | None = None,
    version: int | None = 1,
    reward: float | None = None,
    is_last: bool = False,
    tenant: str = "t",
    tokenizer: str | None = None,
    **extra,
) -> dict:
    """One white-box step record (`tokenizer`: the fingerprint its metadata names)."""
    metadata = {} if tokenizer is None else {"tokenizer": {"fingerprint": tokenizer}}
    payload = {
        "trajectory_uid": trajectory,
        "prompt_uid": group,
        "step_index": index,
        "policy_version": version,
        "reward": reward,
        "is_last": is_last,
        "metadata": metadata,
        **extra,
    }
    row = _envelope("step", payload, tenant)
    return row | {
        "trajectory_uid": trajectory,
        "prompt_uid": group,
        "step_index": index,
        "policy_version": version,
        "token_source": "client",
        "prompt_ids": prompt,
        "response_ids": response,
        "rollout_log_probs": [-0.5] * len(response),
        "reward": reward,
        "is_last": is_last,
        "finish_reason": extra.get("finish_reason"),
    }


def completion(trajectory: str, reward: float | None = None, tenant: str = "t") -> dict:
    """A trajectory_complete record."""
    payload = {"trajectory_uid": trajectory, "reward": reward, "status": "complete", "metadata": {}}
    return _envelope("trajectory_complete", payload, tenant)


def feedback(target: dict, kind: str, value, tenant: str = "t", source: str = "human") -> dict:
    """A feedback record."""
    payload = {"target": target, "kind": kind, "value": value, "source": source, "metadata": {}}
    return _envelope("feedback", payload, tenant)


def land(lake: Lake, rows: list[dict]) -> int:
    """Append records to bronze in one commit; return its version."""
    return lake.append(BRONZE_EVENTS, pa.Table.from_pylist(rows))


def group_of(
    group: str, prompt: list[int], returns: list[float], version: int = 1, turns: int = 1
) -> list[dict]:
    """A GRPO group: one trajectory per return, `turns` nested steps each, then completions."""
    rows = []
    for n, value in enumerate(returns):
        trajectory = f"{group}-r{n}"
        history = list(prompt)
        for turn in range(turns):
            response = [1000 + n, 2000 + turn]
            rows.append(step(trajectory, turn, history, response, group=group, version=version))
            history = [*history, *response, 3000 + turn]
        rows.append(completion(trajectory, value))
    return rows


def rebuilt_sequences(rows: list[dict]) -> list[list[int]]:
    """Each gold/trees row's token sequence, rebuilt from the stored rows alone (of one
    policy version): the segments along its path, each cut where the next one starts."""
    by_segment = {(r["tree_id"], r["segment"]): r for r in rows}
    rebuilt = []
    for row in rows:
        sequence: list[int] = []
        for here, below in zip(row["path"], [*row["path"][1:], None], strict=True):
            seg = by_segment[row["tree_id"], here]
            cut = (
                None
                if below is None
                else by_segment[row["tree_id"], below]["start_depth"] - seg["start_depth"]
            )
            sequence += seg["tokens"][:cut]
        rebuilt.append(sequence)
    return rebuilt

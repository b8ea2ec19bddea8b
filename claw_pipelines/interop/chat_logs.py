"""`claw import`: trajectories logged elsewhere, as OpenAI-style chat logs with token ids, into
bronze with their provenance.

One JSON object per line: one chat completion call, as an OpenAI-compatible server that
returns token ids (vLLM's `return_token_ids`) logged it.

| field | meaning |
|---|---|
| `trajectory_uid` | the trajectory the call belongs to (required) |
| `step_index` | its turn; default: its order among the file's lines of that trajectory |
| `prompt_uid` | GRPO prompt group (default: none; several choices share the trajectory's) |
| `policy_version`, `reward`, `is_last` | as in `POST /v1/steps` |
| `request` | the request (kept in metadata with `--keep-request`, the reply as `metadata.reply`) |
| `response.prompt_token_ids` | the prompt's token ids (required) |
| `response.choices[i].token_ids` | the sampled ids of choice i (required) |
| `response.choices[i].logprobs.content[*].logprob` | per-token log-probs (optional) |
| `response.choices[i].finish_reason`, `response.model` | as returned |
| `metadata` | anything else to keep (a JSON object) |

With `--tokenizer FOLDER` (the model's tokenizer folder, as the gateway's `CLAW_TOKENIZER`),
the folder is kept in the lake (claw_pipelines.lake.tokenizers) and every step names it in
`metadata.tokenizer`, so exports and judges decode its ids with it.

Choice 0 is the trajectory's step; choice i > 0 becomes trajectory `<uid>.c<i>` (the rollouts
of one prompt, sharing its prompt group). Every step is validated as `POST /v1/steps` would
validate it, and the whole file lands in one bronze commit or not at all (an error names the
line and field). Provenance goes in each step's `metadata.imported` (format, file name,
its SHA-256, line); event ids are derived from the file's hash and the line, so importing
the same file again lands nothing new.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import ValidationError

from claw_pipelines.contracts.errors import ChatLogError
from claw_pipelines.contracts.tables import BRONZE_EVENTS, BRONZE_EVENTS_SPEC, SCHEMA_VERSION
from claw_pipelines.contracts.wire import Step
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.tokenizers import save_tokenizer
from claw_pipelines.tokenization import ChatTokenizer

IMPORT_FORMATS = ("openai-chat",)
IMPORT_WRITER = "claw-import"
TOKEN_FIELDS = ("prompt_ids", "response_ids", "rollout_log_probs", "response_mask")


@dataclass(frozen=True)
class Imported:
    """What an import landed."""

    steps: int
    already: int  # steps of this file a previous import landed
    trajectories: int
    bronze_version: int | None


def _field_error(line: int, exc: ValidationError, prefix: str = "") -> ChatLogError:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return ChatLogError(f"line {line}: {prefix}{where}: {first['msg']}")


def _choice_steps(
    line: int,
    record: dict[str, Any],
    digest: str,
    name: str,
    keep_request: bool,
    tokenizer: dict[str, str] | None = None,
) -> list[Step]:
    """The steps of one logged call (one per choice), validated."""
    if not isinstance(record, dict):
        raise ChatLogError(f"line {line}: not a JSON object")
    response = record.get("response")
    if not isinstance(response, dict):
        raise ChatLogError(f"line {line}: response: required (the logged chat completion)")
    prompt = response.get("prompt_token_ids")
    if prompt is None:
        raise ChatLogError(
            f"line {line}: response.prompt_token_ids: required (ask the server for token ids)"
        )
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise ChatLogError(f"line {line}: response.choices: required, at least one")
    uid = record.get("trajectory_uid")
    steps = []
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict) or choice.get("token_ids") is None:
            raise ChatLogError(f"line {line}: response.choices[{i}].token_ids: required")
        content = ((choice.get("logprobs") or {}).get("content")) or None
        log_probs = None if content is None else [c.get("logprob") for c in content]
        provenance = {"format": "openai-chat", "file": name, "sha256": digest, "line": line}
        metadata = dict(record.get("metadata") or {}) | {"imported": provenance}
        if tokenizer is not None:
            metadata["tokenizer"] = tokenizer
        if keep_request and record.get("request") is not None:
            metadata["request"] = record["request"]
            if isinstance(choice.get("message"), dict):
                metadata["reply"] = choice["message"]
        fields = {
            "trajectory_uid": uid if i == 0 or uid is None else f"{uid}.c{i}",
            "prompt_uid": record.get("prompt_uid") or (uid if len(choices) > 1 else None),
            "step_index": record.get("step_index"),
            "prompt_ids": prompt,
            "response_ids": choice["token_ids"],
            "rollout_log_probs": log_probs,
            "reward": record.get("reward"),
            "policy_version": record.get("policy_version"),
            "is_last": bool(record.get("is_last", False)),
            "finish_reason": choice.get("finish_reason"),
            "model": response.get("model"),
            "metadata": metadata,
            "event_id": f"import-{digest}-{line}-{i}",
        }
        try:
            steps.append(Step.model_validate(fields))
        except ValidationError as exc:
            raise _field_error(line, exc, f"choices[{i}] -> ") from None
    return steps


def read_chat_log(
    path: Path, keep_request: bool = False, tokenizer: dict[str, str] | None = None
) -> list[Step]:
    """Every step of a chat log file (see the module doc), validated; turns numbered per
    trajectory in file order where a line gives no `step_index`; `tokenizer`: what each
    step's `metadata.tokenizer` names (`name`, `fingerprint`)."""
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:16]
    steps: list[Step] = []
    turns: dict[str, int] = {}
    for number, text in enumerate(raw.decode("utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ChatLogError(f"line {number}: not JSON ({exc.msg})") from None
        if isinstance(record, dict):
            uid = record.get("trajectory_uid")
            if isinstance(uid, str) and record.get("step_index") is None:
                record["step_index"] = turns.get(uid, 0)
            if isinstance(uid, str) and isinstance(record.get("step_index"), int):
                turns[uid] = max(turns.get(uid, 0), record["step_index"] + 1)
        steps += _choice_steps(number, record, digest, path.name, keep_request, tokenizer)
    if not steps:
        raise ChatLogError(f"{path}: no calls in the file")
    return steps


def bronze_rows(steps: list[Step], tenant: str, now: datetime) -> pa.Table:
    """White-box step records as `bronze/events` rows (payload as `POST /v1/steps` stores it,
    token arrays typed)."""
    rows = []
    for step in steps:
        payload = step.model_dump_json(exclude=set(TOKEN_FIELDS))
        rows.append(
            {
                "event_id": step.event_id,
                "kind": "step",
                "tenant": tenant,
                "received_at": now,
                "ingest_date": now.date(),
                "gateway_id": IMPORT_WRITER,
                "batch_seq": 0,
                "schema_version": SCHEMA_VERSION,
                "payload": payload,
                "trajectory_uid": step.trajectory_uid,
                "prompt_uid": step.prompt_uid,
                "step_index": step.step_index,
                "policy_version": step.policy_version,
                "token_source": "client",
                "prompt_ids": step.prompt_ids,
                "response_ids": step.response_ids,
                "rollout_log_probs": step.rollout_log_probs,
                "response_mask": step.response_mask,
                "reward": step.reward,
                "is_last": step.is_last,
                "finish_reason": step.finish_reason,
                "model": step.model,
            }
        )
    return pa.Table.from_pylist(rows, schema=BRONZE_EVENTS_SPEC.schema)


def import_chat_log(
    lake: Lake,
    path: Path,
    tenant: str = "default",
    keep_request: bool = False,
    tokenizer: ChatTokenizer | None = None,
) -> Imported:
    """Land a chat log's steps in bronze in one commit (nothing when a line is bad, or when
    a previous import already landed them); `tokenizer`: the model's, kept in the lake and
    named on every step."""
    named = None
    if tokenizer is not None:
        named = {"name": tokenizer.name, "fingerprint": save_tokenizer(lake, tokenizer)}
    steps = read_chat_log(path, keep_request, named)
    wanted = [s.event_id for s in steps]
    landed: set[str] = set()
    if lake.exists(BRONZE_EVENTS):
        prefix = wanted[0].rsplit("-", 2)[0]
        found = lake.read(BRONZE_EVENTS, columns=["event_id"])["event_id"]
        landed = set(found.filter(found.str.starts_with(prefix)).to_list())
    fresh = [s for s in steps if s.event_id not in landed]
    trajectories = len({s.trajectory_uid for s in steps})
    if not fresh:
        return Imported(0, len(steps), trajectories, None)
    table = bronze_rows(fresh, tenant, datetime.now(UTC))
    metadata = {"import": path.name, "steps": len(fresh)}
    version = lake.append(BRONZE_EVENTS_SPEC, table, metadata=metadata)
    return Imported(len(fresh), len(steps) - len(fresh), trajectories, version)

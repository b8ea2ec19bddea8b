"""Build small lakes for tests through the lake module: bronze records as the gateway writes
them (envelope, canonical JSON payload, typed token columns), then real silver runs."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

from claw_pipelines.consume.dataset import Dataset, open_dataset
from claw_pipelines.contracts.access import create_key
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.tokenizers import bundled_fingerprint
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.increments import update_dataset
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.ops.integrity import SILVER_KEYS as KEYS
from claw_pipelines.tokenization import IM_END, encode, encode_chat

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


def partial_rollout(
    trajectory: str,
    prompt: list[int],
    parts: list[list[int]],
    versions: list[int],
    *,
    first_index: int = 0,
    group: str | None = None,
    **extra,
) -> list[dict]:
    """Steps of one generation aborted `len(parts) - 1` times and resumed each time: part k
    is generated under `versions[k]` (log-probs -(k + 1) / 10 - position / 1000, so every
    token's is distinct), every part but the last ends `abort`, and each resumption's prompt is
    the prompt plus the parts before it."""
    rows, history = [], list(prompt)
    for k, (part, version) in enumerate(zip(parts, versions, strict=True)):
        last = k == len(parts) - 1
        row = step(
            trajectory,
            first_index + k,
            history,
            part,
            group=group,
            version=version,
            finish_reason="stop" if last else "abort",
            **extra,
        )
        row["rollout_log_probs"] = [-(k + 1) / 10 - n / 1000 for n in range(len(part))]
        rows.append(row)
        history = [*history, *part]
    return rows


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
    group: str,
    prompt: list[int],
    returns: list[float],
    version: int = 1,
    turns: int = 1,
    tenant: str = "t",
) -> list[dict]:
    """A GRPO group: one trajectory per return, `turns` nested steps each, then completions."""
    rows = []
    for n, value in enumerate(returns):
        trajectory = f"{group}-r{n}"
        history = list(prompt)
        for turn in range(turns):
            response = [1000 + n, 2000 + turn]
            rows.append(
                step(
                    trajectory, turn, history, response, group=group, version=version, tenant=tenant
                )
            )
            history = [*history, *response, 3000 + turn]
        rows.append(completion(trajectory, value, tenant=tenant))
    return rows


def drifted() -> list[dict]:
    """Prompt group `d`: a two-turn trajectory whose second prompt re-renders the first turn
    (token 7 split: `turns_nest` fails on it), and a steady one-turn rollout."""
    return [
        step("drift", 0, [1, 2], [7, 8], group="d"),
        step("drift", 1, [1, 2, 70, 71, 8, 9], [10], group="d"),
        completion("drift", 1.0),
        step("steady", 0, [1, 2], [5], group="d"),
        completion("steady", 0.0),
    ]


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


# -- lakes and checks several test folders share ----------------------------------------


def grown_lake(root: Path) -> Lake:
    """Twelve GRPO groups of three rollouts (g00..g11) over policy versions 1-3, landed and
    curated into dataset `live` by one increment: the lake of the live delivery tests."""
    lake = Lake(str(root))
    for i in range(12):
        land(lake, group_of(f"g{i:02d}", [i, 5], [1.0, 0.0, 0.5], version=1 + i % 3))
    build_silver(lake)
    update_dataset(lake, LIVE)
    return lake


TRAIN_SPEC = CurationSpec(
    name="train", reward_status=["final", "missing"], merge="prompt_group", advantage="grpo"
)


def train_lake(root: Path) -> Lake:
    """Six GRPO groups of 3-turn trajectories over two policy versions, curated and merged
    (dataset `train`): the lake of the consumption tests, the adapters and tree attention."""
    lake = Lake(str(root))
    rows = []
    for g in range(6):
        rows += group_of(f"g{g}", [7, g, 7, g], [1.0, 0.0, 0.5], version=1 + g % 2, turns=3)
    land(lake, rows)
    build_silver(lake)
    for version in (1, 2):
        build_partition(lake, TRAIN_SPEC, version)
    return lake


def tenant_spec(name: str, tenant: str | None) -> CurationSpec:
    """A GRPO spec over complete groups of one tenant (None: every tenant's)."""
    return TRAIN_SPEC.model_copy(update={"name": name, "tenant": tenant})


# keys of tenants_lake's two tenants and of an admin, and the keys file that holds them (hashes)
ACME_KEY, ACME_LINE = create_key("acme")
GLOBEX_KEY, GLOBEX_LINE = create_key("globex")
ADMIN_KEY, ADMIN_LINE = create_key("ops", admin=True)
TENANTS_KEYS_FILE = "\n".join([ACME_LINE, GLOBEX_LINE, ADMIN_LINE]) + "\n"


def tenants_lake(root: Path) -> Lake:
    """Two tenants on one lake: `acme` (groups acme-g0, acme-g1; rewards 0.25/0.75) and
    `globex` (globex-g0, globex-g1; rewards 0.1/0.9), both over policy versions 1 and 2 and
    with the same prompts (their trees would merge if curated together); datasets
    `acme-train` (tenant acme), `globex-train` (tenant globex) and `everyone` (no tenant)."""
    lake = Lake(str(root))
    rows = []
    for tenant, returns in (("acme", [0.25, 0.75]), ("globex", [0.1, 0.9])):
        for g in range(2):
            group = f"{tenant}-g{g}"
            rows += group_of(group, [9, g, 9], returns, version=1 + g, turns=2, tenant=tenant)
    land(lake, rows)
    build_silver(lake)
    for spec in (
        tenant_spec("acme-train", "acme"),
        tenant_spec("globex-train", "globex"),
        tenant_spec("everyone", None),
    ):
        for version in (1, 2):
            build_partition(lake, spec, version)
    return lake


BEHAVIOUR_SPEC = CurationSpec(
    name="behaviour", reward_status=["final", "missing"], merge="prompt_group", advantage="grpo"
)


def behaviour_lake(root: Path) -> Lake:
    """Four GRPO groups of three two-turn trajectories over policy versions 1 and 2 (dataset
    `behaviour`, merged per prompt group), each response token with a behaviour log-prob of
    its own: rollouts r0 and r1 of a group open their first reply with the same two tokens
    (one tree position each, holding two steps' different values), and rollout r2's first
    step captured none."""
    lake = Lake(str(root))
    rng = np.random.default_rng(5)
    rows = []
    for g in range(4):
        for r in range(3):
            trajectory, history = f"b{g}-r{r}", [7, g, 7, g]
            for turn in range(2):
                opening = [100 + g, 101 + g] if r < 2 and turn == 0 else []
                response = [*opening, 1000 + r, 2000 + turn]
                row = step(trajectory, turn, history, response, group=f"b{g}", version=1 + g % 2)
                captured = -rng.uniform(0.01, 3.0, len(response)).round(3)
                row["rollout_log_probs"] = None if r == 2 and turn == 0 else captured.tolist()
                rows.append(row)
                history = [*history, *response, 3000 + turn]
            rows.append(completion(trajectory, float(r)))
    land(lake, rows)
    build_silver(lake)
    for version in (1, 2):
        build_partition(lake, BEHAVIOUR_SPEC, version)
    return lake


EQUIVALENCE_VOCAB = 512


def equivalence_dataset(root: Path) -> Dataset:
    """Two GRPO groups of two-turn trajectories; some rollouts share their first response
    tokens, so a shared token is a trained response token of several steps."""
    lake = Lake(str(root))
    rng = np.random.default_rng(0)
    rows = []
    for g in range(2):
        prompt = rng.integers(1, EQUIVALENCE_VOCAB, 40).tolist()
        opening = rng.integers(1, EQUIVALENCE_VOCAB, 3).tolist()
        for r, value in enumerate([1.0, 0.0, 0.5, 0.25]):
            trajectory = f"g{g}-r{r}"
            response = (opening if r < 2 else []) + rng.integers(
                1, EQUIVALENCE_VOCAB, 6 + r
            ).tolist()
            rows.append(step(trajectory, 0, prompt, response, group=f"g{g}"))
            follow = [*prompt, *response, *rng.integers(1, EQUIVALENCE_VOCAB, 5).tolist()]
            rows.append(
                step(
                    trajectory,
                    1,
                    follow,
                    rng.integers(1, EQUIVALENCE_VOCAB, 4).tolist(),
                    group=f"g{g}",
                )
            )
            rows.append(completion(trajectory, value))
    land(lake, rows)
    build_silver(lake)
    spec = CurationSpec(
        name="eq", reward_status=["final", "missing"], merge="prompt_group", advantage="grpo"
    )
    build_partition(lake, spec, 1)
    return open_dataset("eq", lake.uri)


# (a, b, what the model said): right, wrong, right
ARITHMETIC_TASKS = [(12, 7, 19), (3, 4, 8), (40, 2, 42)]


def arithmetic_steps(offset: int = 0) -> list[dict]:
    """One two-turn trajectory per task: a tool call, then the final answer (the bundled
    tokenizer's ids)."""
    bundled, rows = bundled_fingerprint(), []
    for number, (a, b, said) in enumerate(ARITHMETIC_TASKS):
        trajectory = f"math-{offset + number}"
        question = [{"role": "user", "content": f"What is {a} + {b}?"}]
        first = encode_chat(question)
        call = encode(
            f'<tool_call>\n{{"name": "calc", "arguments": {{"x": "{a}+{b}"}}}}\n</tool_call>'
        )
        rows.append(step(trajectory, 0, first, [*call, *encode(IM_END)], tokenizer=bundled))
        history = [
            *question,
            {"role": "assistant", "content": ""},
            {"role": "tool", "content": str(a + b)},
        ]
        answer = encode(f"The answer is {said}.") + encode(IM_END)
        rows.append(step(trajectory, 1, encode_chat(history), answer, tokenizer=bundled))
        rows.append(completion(trajectory))
    return rows


def fill_bronze(lake: Lake, commits: int = 3, tag: str = "") -> None:
    """Bronze of several commits holding steps (some with inline rewards), completions,
    feedback, retried duplicates and a conflicting step."""
    for c in range(commits):
        rows = []
        for g in range(4):
            rows += group_of(f"{tag}c{c}g{g}", [c, g, 7, 7], [1.0, 0.0, 0.5], turns=2)
        rows.append(step(f"{tag}solo{c}", 0, [c, 1], [2, 3], reward=0.5, is_last=True))
        rows.append(step(f"{tag}solo{c}", 0, [c, 1], [2, 3], reward=0.5, is_last=True))  # retry
        rows.append(step(f"{tag}solo{c}", 0, [c, 1], [9, 9], is_last=True))  # a conflict
        rows.append(feedback({"step_key": f"{tag}c{c}g0-r0:1"}, "rating", 4))
        rows.append(completion(f"{tag}solo{c}", 1.0))
        land(lake, rows)


def assert_each_once(lake: Lake) -> None:
    for table, key in KEYS.items():
        column = lake.read(table, columns=[key])[key]
        assert column.n_unique() == column.len(), f"{table}: a {key} twice"
    events = lake.read(SILVER_STEPS, columns=["event_id"])["event_id"]
    assert events.n_unique() == events.len()

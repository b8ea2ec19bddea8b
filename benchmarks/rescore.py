"""Benchmark: re-scoring stored steps with a vectorized verifier (`claw rescore`).

Writes 100k arithmetic steps (an agent's system prompt of ~1k tokens, as tool-using agents
carry, and a `What is a op b?` question in ChatML; a short answer, right or wrong) to bronze
as gateway micro-batches and builds silver. `--system-repeats` sizes the system prompt (42
tokens each): the full run's cost grows with the tokens read, an incremental run's floor (a
Delta commit to bronze, the change feed read: ~30 ms) does not.
Then times, in one process:
  (a) the floor: reading the columns a judge needs (step_key, trajectory_uid, step_index,
      tenant, prompt_ids, response_ids) of every silver step (best of 2);
  (b) a full re-score with the built-in `exact-match` judge: find the steps not scored,
      verify them, append one reward fact each to bronze;
  (c) after 1 % more steps reach silver, the incremental re-score (only those are scored;
      `--rounds` times, the median).
Prints one JSON line. Targets: full <= 3x the floor; incremental <= 5 % of the full run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEPS  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.lake.prompts import read_steps  # noqa: E402
from claw_pipelines.lake.tokenizers import bundled_fingerprint  # noqa: E402
from claw_pipelines.materialize.rescore import JUDGE_INPUT_COLUMNS, load_judge, rescore  # noqa: E402
from claw_pipelines.materialize.silver import build_silver  # noqa: E402
from claw_pipelines.tokenization import IM_END, encode, encode_chat  # noqa: E402

FULL_TARGET = 3.0
INCREMENTAL_TARGET = 0.05
T0 = datetime(2026, 11, 30, tzinfo=UTC)
SYSTEM = (
    "You are a careful assistant for arithmetic. Read the question, compute the value, and "
    "state it at the end of your answer. Use the calculator tool for long products. "
)


def steps(count: int, seed: int, first: int, repeats: int = 24) -> list[dict]:
    """Single-turn arithmetic trajectories (ids encoded once per distinct question)."""
    rng = random.Random(seed)
    questions: dict[tuple[int, str, int], np.ndarray] = {}
    rows = []
    for n in range(count):
        a, b, op = rng.randint(2, 40), rng.randint(2, 40), rng.choice("+-*")
        if (a, op, b) not in questions:
            chat = [
                {"role": "system", "content": SYSTEM * repeats},
                {"role": "user", "content": f"What is {a} {op} {b}?"},
            ]
            questions[(a, op, b)] = np.asarray(encode_chat(chat), np.int32)
        value = {"+": a + b, "-": a - b, "*": a * b}[op] + (0 if rng.random() < 0.8 else 1)
        answer = np.asarray(encode(f"The answer is {value}.") + encode(IM_END), np.int32)
        rows.append(
            {
                "trajectory_uid": f"math-{first + n}",
                "prompt_ids": questions[(a, op, b)],
                "response_ids": answer,
                "received_at": T0 + timedelta(milliseconds=first + n),
            }
        )
    return rows


def bronze_batch(rows: list[dict], batch_seq: int) -> pa.Table:
    """Rows as one gateway micro-batch of white-box steps in the bronze schema."""
    event_ids = [uuid.uuid4().hex for _ in rows]
    payloads = [
        json.dumps(
            {
                "trajectory_uid": r["trajectory_uid"],
                "step_index": 0,
                "policy_version": 1,
                "is_last": True,
                "metadata": {"tokenizer": {"name": "bundled", "fingerprint": BUNDLED}},
                "event_id": e,
            }
        )
        for r, e in zip(rows, event_ids, strict=True)
    ]

    def lists(arrays: list[np.ndarray]) -> pa.Array:
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays)))

    received = [r["received_at"] for r in rows]
    n = len(rows)
    return pa.table(
        {
            "event_id": event_ids,
            "kind": ["step"] * n,
            "tenant": ["bench"] * n,
            "received_at": pa.array(received, pa.timestamp("us", tz="UTC")),
            "ingest_date": pa.array([t.date() for t in received], pa.date32()),
            "gateway_id": ["gw-bench"] * n,
            "batch_seq": [batch_seq] * n,
            "schema_version": pa.array([1] * n, pa.int32()),
            "payload": payloads,
            "trajectory_uid": [r["trajectory_uid"] for r in rows],
            "step_index": [0] * n,
            "policy_version": [1] * n,
            "is_last": [True] * n,
            "token_source": ["client"] * n,
            "prompt_ids": lists([r["prompt_ids"] for r in rows]),
            "response_ids": lists([r["response_ids"] for r in rows]),
        }
    )


BUNDLED = bundled_fingerprint()  # the steps' ids are the bundled tokenizer's (ChatML)


def land(lake: Lake, rows: list[dict], batch: int, first_seq: int) -> int:
    """Append rows to bronze in micro-batches; return the next batch_seq."""
    seq = first_seq
    for start in range(0, len(rows), batch):
        lake.append(BRONZE_EVENTS, bronze_batch(rows[start : start + batch], seq))
        seq += 1
    return seq


def floor_seconds(lake: Lake) -> float:
    """Read what a judge needs of every silver step, prompts whole (silver stores a prompt
    relative to its trajectory's earlier steps: a plain read of `prompt_ids` finds most of
    them null, docs/DESIGN.md §18)."""
    started = time.perf_counter()
    read_steps(lake, SILVER_STEPS, columns=JUDGE_INPUT_COLUMNS)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=5_000, help="records per bronze commit")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--system-repeats", type=int, default=24, help="system prompt size")
    parser.add_argument("--rounds", type=int, default=5, help="incremental runs (median)")
    args = parser.parse_args()

    judge = load_judge("exact-match")
    with tempfile.TemporaryDirectory(prefix="claw-rescore-") as tmp:
        lake = Lake(str(Path(tmp) / "lake"))
        stored = steps(args.steps, args.seed, 0, args.system_repeats)
        prompt_tokens = sum(len(r["prompt_ids"]) for r in stored) / len(stored)
        seq = land(lake, stored, args.batch, 0)
        del stored
        build_silver(lake)
        floor = min(floor_seconds(lake) for _ in range(2))
        full = rescore(lake, judge)
        extra = max(1, args.steps // 100)
        rounds = []
        for number in range(args.rounds):
            first = args.steps + number * extra
            more = steps(extra, args.seed + 1 + number, first, args.system_repeats)
            seq = land(lake, more, args.batch, seq)
            build_silver(lake)
            rounds.append(rescore(lake, judge))
        incremental = sorted(rounds, key=lambda run: run.seconds)[len(rounds) // 2]
    emit(
        "rescore",
        target=f"a full run <= {FULL_TARGET} x the floor; an incremental run <= "
        f"{INCREMENTAL_TARGET} x the full one, scoring exactly the new steps",
        targets={"full_vs_floor": FULL_TARGET, "incremental_vs_full": INCREMENTAL_TARGET},
        target_met=full.seconds <= FULL_TARGET * floor
        and incremental.seconds <= INCREMENTAL_TARGET * full.seconds
        and all(run.scored == extra and run.incremental for run in rounds),
        baseline="floor_s",
        ratio={
            "full_vs_floor": round(full.seconds / floor, 3),
            "incremental_vs_full": round(incremental.seconds / full.seconds, 4),
        },
        steps=args.steps,
        prompt_tokens_mean=round(prompt_tokens, 1),
        judge=f"{judge.name} v{judge.version}",
        floor_s=round(floor, 3),
        full_s=full.seconds,
        full_scored=full.scored,
        incremental_steps=extra,
        incremental_s=incremental.seconds,
        incremental_runs_s=[run.seconds for run in rounds],
        incremental_scored=incremental.scored,
        incremental_already_scored=incremental.already_scored,
        full_vs_floor=round(full.seconds / floor, 3),
        incremental_vs_full=round(incremental.seconds / full.seconds, 4),
    )


if __name__ == "__main__":
    main()

"""Benchmark: silver builds against the floor of reading and rewriting bronze's token data.

Writes a bronze of multi-turn trajectories (500 to 8,000-token prompts; white-box steps with
log-probs and a share of unscoped proxied calls that must be stitched) through the lake
module, as gateway micro-batches. Then, in one process, times:
  (a) the floor: read bronze's token columns and write them unchanged to a scratch table;
  (b) a full silver build (what the Dagster asset does: build + quality findings);
  (c) after bronze gains 1 % more, the incremental run.
Prints one JSON line. Targets: full <= 3x the floor; incremental <= 5 % of the full build.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import write_deltalake

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEPS  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.materialize.silver import SilverOptions, build_silver, silver_findings  # noqa: E402

FULL_TARGET = 3.0
INCREMENTAL_TARGET = 0.05
TOKEN_COLUMNS = ["event_id", "prompt_ids", "response_ids", "rollout_log_probs", "response_mask"]
VOCAB = 150_000
T0 = datetime(2026, 11, 30, tzinfo=UTC)


def _tokens(rng: np.random.Generator, low: int, high: int) -> np.ndarray:
    return rng.integers(0, VOCAB, int(rng.integers(low, high)), dtype=np.int32)


def trajectories(steps: int, unscoped_share: float, seed: int) -> list[dict]:
    """Steps of multi-turn conversations; each turn's prompt = the last prompt + its response
    + a new message, up to 8,000 tokens. Conversations overlap in time."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []
    conversation = 0
    while len(rows) < steps:
        unscoped = rng.random() < unscoped_share
        trajectory, group = f"t-{conversation}", f"g-{conversation // 4}"
        start = T0 + timedelta(seconds=conversation * 3.0)
        prompt = _tokens(rng, 500, 1500)
        for turn in range(20):
            response = _tokens(rng, 64, 512)
            rows.append(
                {
                    "unscoped": unscoped,
                    "trajectory_uid": f"call-{uuid.uuid4().hex}" if unscoped else trajectory,
                    "prompt_uid": group,
                    "step_index": 0 if unscoped else turn,
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "received_at": start + timedelta(seconds=turn * 40.0),
                    "policy_version": conversation // 500,
                }
            )
            prompt = np.concatenate([prompt, response, _tokens(rng, 100, 600)])
            if len(prompt) > 8_000 or len(rows) >= steps:
                break
        conversation += 1
    rows.sort(key=lambda r: r["received_at"])
    return rows


def bronze_batch(rows: list[dict], batch_seq: int, rng: np.random.Generator) -> pa.Table:
    """Rows as one gateway micro-batch in the bronze schema."""
    event_ids = [uuid.uuid4().hex for _ in rows]
    payloads, kinds = [], []
    for row, event_id in zip(rows, event_ids, strict=True):
        metadata = {"scoped": False, "prompt_group_via": "gateway"} if row["unscoped"] else {}
        kinds.append("chat_completion" if row["unscoped"] else "step")
        payloads.append(
            json.dumps(
                {
                    "trajectory_uid": row["trajectory_uid"],
                    "prompt_uid": row["prompt_uid"],
                    "step_index": row["step_index"],
                    "policy_version": row["policy_version"],
                    "is_last": False,
                    "metadata": metadata,
                    "event_id": event_id,
                }
            )
        )

    def lists(arrays: list[np.ndarray], kind: pa.DataType) -> pa.Array:
        offsets = np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays), kind))

    responses = [r["response_ids"] for r in rows]
    logprobs = [-rng.random(len(r), dtype=np.float32) * 4 for r in responses]
    received = [r["received_at"] for r in rows]
    return pa.table(
        {
            "event_id": event_ids,
            "kind": kinds,
            "tenant": ["bench"] * len(rows),
            "received_at": pa.array(received, pa.timestamp("us", tz="UTC")),
            "ingest_date": pa.array([t.date() for t in received], pa.date32()),
            "gateway_id": ["gw-bench"] * len(rows),
            "batch_seq": [batch_seq] * len(rows),
            "schema_version": pa.array([1] * len(rows), pa.int32()),
            "payload": payloads,
            "trajectory_uid": [r["trajectory_uid"] for r in rows],
            "prompt_uid": [r["prompt_uid"] for r in rows],
            "step_index": [r["step_index"] for r in rows],
            "policy_version": [r["policy_version"] for r in rows],
            "token_source": ["upstream" if r["unscoped"] else "client" for r in rows],
            "prompt_ids": lists([r["prompt_ids"] for r in rows], pa.int32()),
            "response_ids": lists(responses, pa.int32()),
            "rollout_log_probs": lists(logprobs, pa.float32()),
        }
    )


def land(lake: Lake, rows: list[dict], batch: int, first_seq: int, seed: int) -> int:
    """Append rows to bronze in gateway-sized micro-batches; return the next batch_seq."""
    rng = np.random.default_rng(seed)
    seq = first_seq
    for start in range(0, len(rows), batch):
        lake.append(BRONZE_EVENTS, bronze_batch(rows[start : start + batch], seq, rng))
        seq += 1
    return seq


def floor_seconds(lake: Lake, scratch: Path) -> float:
    """Read bronze's token data and write it unchanged to a new Delta table."""
    started = time.perf_counter()
    data = lake.read(BRONZE_EVENTS, columns=TOKEN_COLUMNS).to_arrow()
    write_deltalake(str(scratch), data, mode="overwrite")
    return time.perf_counter() - started


def silver_seconds(lake: Lake, options: SilverOptions) -> tuple[float, dict]:
    """One silver run as the asset does it: build, then the quality findings."""
    started = time.perf_counter()
    run = build_silver(lake, options)
    findings = silver_findings(lake, run)
    elapsed = time.perf_counter() - started
    failed = [name for name, f in findings.items() if not f.passed]
    return elapsed, run.summary() | {"failed_checks": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50_000)
    parser.add_argument("--unscoped-share", type=float, default=0.1)
    parser.add_argument("--batch", type=int, default=2_000, help="records per bronze commit")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()

    extra = max(1, args.steps // 100)
    rows = trajectories(args.steps + extra, args.unscoped_share, args.seed)
    initial, increment = rows[: args.steps], rows[args.steps :]
    options = SilverOptions(stitch_window_s=3600.0, idle_timeout_s=3600.0)
    with tempfile.TemporaryDirectory(prefix="claw-bench-silver-") as tmp:
        lake = Lake(str(Path(tmp) / "lake"))
        seq = land(lake, initial, args.batch, 0, args.seed)
        tokens = int(sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in initial))
        floors = [floor_seconds(lake, Path(tmp) / "scratch-a")]
        full, full_run = silver_seconds(lake, options)
        floors.append(floor_seconds(lake, Path(tmp) / "scratch-b"))
        floor = min(floors)
        land(lake, increment, args.batch, seq, args.seed + 1)
        incremental, inc_run = silver_seconds(lake, options)
        silver_steps = lake.read(SILVER_STEPS, columns=["step_key"]).height
    emit(
        "silver_incremental",
        target=f"a full silver run <= {FULL_TARGET} x the floor; an incremental one <= "
        f"{INCREMENTAL_TARGET} x the full one",
        targets={"full_vs_floor": FULL_TARGET, "incremental_vs_full": INCREMENTAL_TARGET},
        target_met=full / floor <= FULL_TARGET and incremental / full <= INCREMENTAL_TARGET,
        baseline="floor_s",
        ratio={
            "full_vs_floor": round(full / floor, 3),
            "incremental_vs_full": round(incremental / full, 4),
        },
        steps=len(initial),
        tokens=tokens,
        unscoped_share=args.unscoped_share,
        floor_s=round(floor, 3),
        floor_runs_s=[round(f, 3) for f in floors],
        full_s=round(full, 3),
        incremental_s=round(incremental, 3),
        incremental_steps=len(increment),
        full_steps_per_s=round(len(initial) / full),
        full_tokens_per_s=round(tokens / full),
        floor_tokens_per_s=round(tokens / floor),
        full_vs_floor=round(full / floor, 3),
        incremental_vs_full=round(incremental / full, 4),
        silver_steps=silver_steps,
        full_run=full_run,
        incremental_run=inc_run,
    )


if __name__ == "__main__":
    main()

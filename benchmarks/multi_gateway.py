"""Benchmark: 1 vs 3 gateway replicas appending to one bronze table on S3, same client load.

A local S3 server that enforces conditional writes (SeaweedFS, as in the soak) holds a lake
per arm (so both arms start from an empty log). The same closed-loop load (white-box steps:
2,000 prompt ids, 200 response ids with log-probs; `--connections` in all) goes to one replica,
or is split evenly over three with distinct CLAW_GATEWAY_IDs, for `--seconds` per run, arms
alternating over `--rounds` (ABBA...). The default load, 96 agents in flight, is the kind that
makes one scale out: at 24 (8 per replica) each replica's event loop and WAL group commit cover
a third of the requests per wake-up, the three spend ~25 % more CPU per step than one, and on
two cores the arms tie (ratios 0.98-1.04); at 96 one replica is saturated and three are
not. Then every replica is stopped (its WAL drained) and bronze is counted against the
acknowledged steps.

Prints one JSON line: acknowledged steps/s per arm and run, the median ratio 3/1, failed
calls, steps acknowledged but missing from bronze (lost), bronze commits and the appends whose
first version another replica had taken (the store refused that conditional put and delta-rs
committed at a later version: retried, counted). Targets: ratio >= 1.0, 0 failed, 0 lost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gateway_ingest import step_body  # noqa: E402
from benchmarks.harness import emit  # noqa: E402
from benchmarks.loadgen import LoadResult, encode_post, run_load  # noqa: E402
from claw_pipelines.contracts.tables import BRONZE_EVENTS  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from gateway.wal.layout import STATUS_FILE  # noqa: E402
from tests.support.s3 import s3_options, seaweed_server  # noqa: E402
from tests.support.servers import GatewayProcess  # noqa: E402

TARGET_RATIO = 1.0


async def drive(gateways: list[GatewayProcess], body: bytes, connections: int, seconds: float):
    """The load, split evenly over the replicas; one merged result."""
    count = len(gateways)
    per = [connections // count + (i < connections % count) for i in range(count)]
    runs = [
        run_load(
            "127.0.0.1",
            g.port,
            encode_post("127.0.0.1", g.port, "/v1/steps", body),
            connections=n,
            seconds=seconds,
            warmup=1.0,
            stagger=0.5,
        )
        for g, n in zip(gateways, per, strict=True)
        if n
    ]
    merged = LoadResult()
    for result in await asyncio.gather(*runs):
        merged.merge(result)
    merged.seconds /= len(runs)  # the runs were concurrent
    return merged


def flusher_counters(wal_root: Path, names: list[str]) -> dict[str, int]:
    """Bronze commits and conflicted appends, summed over the replicas' flushers."""
    totals = {"commits": 0, "commit_conflicts": 0, "failures": 0}
    for name in names:
        path = wal_root / name / STATUS_FILE
        status = json.loads(path.read_text()) if path.exists() else {}
        for key in totals:
            totals[key] += int(status.get(key) or 0)
    return totals


def run_arm(s3: str, workdir: Path, replicas: int, tag: str, body: bytes, args) -> dict:
    """One run: `replicas` gateways on a fresh lake, the load, a drain, the bronze count."""
    uri = f"s3://claw-lake/{tag}"
    options = s3_options(s3)
    names = [f"gw-{tag}-{i}" for i in range(replicas)]
    env = {
        "CLAW_LAKE_URI": uri,
        "CLAW_STORAGE_OPTIONS": json.dumps(options),
        "CLAW_WAL_DIR": str(workdir / "wal"),
        "CLAW_FLUSH_INTERVAL_MS": str(args.flush_ms),
    }
    gateways = [GatewayProcess(workdir / n, CLAW_GATEWAY_ID=n, **env).start() for n in names]
    try:
        result = asyncio.run(drive(gateways, body, args.connections, args.seconds))
    finally:
        for gateway in gateways:
            gateway.stop()  # drains its WAL into bronze before it exits
    counters = flusher_counters(workdir / "wal", names)
    landed = Lake(uri, options).read(BRONZE_EVENTS, columns=["event_id"]).height
    failed = sum(n for status, n in result.statuses.items() if status != 200)
    return {
        "replicas": replicas,
        "steps_per_s": round(result.requests / result.seconds, 1),
        "acknowledged": result.acknowledged_all,  # warm-up included: all must be in bronze
        "failed": failed,
        "bronze_rows": landed,
        "lost": result.acknowledged_all - landed,
        "unacknowledged_in_bronze": max(0, landed - result.acknowledged_all),
        **counters,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connections", type=int, default=96)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=4, help="runs per arm")
    parser.add_argument("--flush-ms", type=int, default=1000)
    args = parser.parse_args()

    body = step_body()
    runs: dict[int, list[dict]] = {1: [], 3: []}
    with tempfile.TemporaryDirectory(prefix="claw-multi-gw-") as tmp:
        workdir = Path(tmp)
        with seaweed_server(workdir / "s3") as s3:
            order = [1, 3, 3, 1] * ((args.rounds + 1) // 2)
            for number, replicas in enumerate(order[: 2 * args.rounds]):
                tag = f"r{number}-x{replicas}"
                runs[replicas].append(run_arm(s3, workdir / tag, replicas, tag, body, args))
    one = [r["steps_per_s"] for r in runs[1]]
    three = [r["steps_per_s"] for r in runs[3]]
    ratios = [round(b / a, 3) for a, b in zip(one, three, strict=True) if a]
    ratio = round(statistics.median(ratios), 3)
    every = runs[1] + runs[3]
    failed = sum(r["failed"] + r["failures"] for r in every)
    lost = sum(max(0, r["lost"]) for r in every)
    extra = sum(r["unacknowledged_in_bronze"] for r in every)
    emit(
        "multi_gateway",
        target=f"three replicas' steps/s >= {TARGET_RATIO} x one replica's (median of the rounds); "
        "0 failed, 0 lost, nothing unacknowledged in bronze",
        targets={"ratio": TARGET_RATIO, "failed": 0, "lost": 0},
        target_met=ratio >= TARGET_RATIO and failed == 0 and lost == 0 and extra == 0,
        baseline="one_replica_steps_per_s",
        ratio=ratio,
        store="SeaweedFS (enforces If-None-Match)",
        connections=args.connections,
        seconds_per_run=args.seconds,
        one_replica_steps_per_s=one,
        three_replicas_steps_per_s=three,
        ratio_by_round=ratios,
        failed=failed,
        lost=lost,
        unacknowledged_in_bronze=extra,
        bronze_commits={k: sum(r["commits"] for r in runs[k]) for k in runs},
        commit_conflicts_retried={k: sum(r["commit_conflicts"] for r in runs[k]) for k in runs},
        runs=every,
    )


if __name__ == "__main__":
    main()

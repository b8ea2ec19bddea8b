"""Benchmark: the durable gateway vs a validate-and-drop FastAPI ceiling, same load, one run.

5 runs (rounds), ABBA order; each run's ratio is the gateway's throughput over the baseline's
in that run. Prints one JSON line: both throughputs, p50/p99 latencies, the median of the runs'
ratios (target 0.85) and every run's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from benchmarks.loadgen import LoadResult, encode_post, run_load  # noqa: E402
from tests.support.servers import free_port, wait_until  # noqa: E402

TARGET_RATIO = 0.85  # median of the runs


def step_body(seed: int = 0) -> bytes:
    """One step: 2,000 prompt ids, 200 response ids with log-probs."""
    rng = random.Random(seed)
    step = {
        "trajectory_uid": "bench-traj",
        "prompt_uid": "bench-group",
        "step_index": 0,
        "prompt_ids": [rng.randrange(150_000) for _ in range(2000)],
        "response_ids": [rng.randrange(150_000) for _ in range(200)],
        "rollout_log_probs": [round(-rng.random() * 5, 6) for _ in range(200)],
        "policy_version": 1,
    }
    return json.dumps({"steps": [step]}).encode()


def start(command: list[str], port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        command, env=env, cwd=REPO, stdout=log.open("ab"), stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-2000:])
        try:
            httpx.get(url + "/openapi.json", timeout=1)
            return True
        except httpx.HTTPError:
            return False

    wait_until(up, 60, what=" ".join(command[:4]))
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    body = step_body()
    workdir = Path(tempfile.mkdtemp(prefix="claw-bench-"))
    lake = workdir / "lake"
    env = {**os.environ, "CLAW_LAKE_URI": str(lake), "CLAW_GATEWAY_ID": "gw-bench"}
    ports = {"baseline": free_port(), "gateway": free_port()}
    commands = {
        "baseline": [
            sys.executable,
            "-m",
            "uvicorn",
            "benchmarks.baseline_app:create_baseline_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["baseline"]),
            "--log-level",
            "warning",
        ],
        "gateway": [
            sys.executable,
            "-m",
            "claw_pipelines.app.cli",
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["gateway"]),
        ],
    }
    procs = {
        name: start(cmd, ports[name], env, workdir / f"{name}.log")
        for name, cmd in commands.items()
    }
    results = {name: LoadResult() for name in commands}
    by_round: list[float] = []
    try:
        for round_index in range(args.rounds):
            order = list(commands) if round_index % 2 == 0 else list(reversed(commands))
            rps = {}
            for name in order:
                request = encode_post("127.0.0.1", ports[name], "/v1/steps", body)
                run = asyncio.run(
                    run_load(
                        "127.0.0.1",
                        ports[name],
                        request,
                        connections=args.connections,
                        seconds=args.seconds,
                    )
                )
                results[name].merge(run)
                rps[name] = run.summary()["rps"]
            by_round.append(round(rps["gateway"] / rps["baseline"], 3) if rps["baseline"] else 0)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)
    landed = pl.scan_delta(str(lake / "bronze" / "events")).select(pl.len()).collect().item()
    base, gw = results["baseline"].summary(), results["gateway"].summary()
    ratio = round(statistics.median(by_round), 3)
    acked_total = sum(r for s, r in results["gateway"].statuses.items() if s == 200)
    emit(
        "gateway_ingest",
        target=f"the durable gateway's rps >= {TARGET_RATIO} x the validate-and-drop baseline's "
        "(median of the rounds)",
        targets={"ratio": TARGET_RATIO},
        target_met=ratio >= TARGET_RATIO,
        baseline="baseline_validate_and_drop",
        ratio=ratio,
        payload="1 step: 2000 prompt ids, 200 response ids + log-probs",
        body_bytes=len(body),
        connections=args.connections,
        seconds_per_round=args.seconds,
        rounds=args.rounds,
        baseline_validate_and_drop=base,
        gateway_durable=gw,
        ratio_by_round=by_round,
        ratio_pooled=round(gw["rps"] / base["rps"], 3) if base["rps"] else 0.0,
        bronze_rows_landed=landed,
        bronze_rows_at_least_acked=landed >= acked_total,
    )


if __name__ == "__main__":
    main()

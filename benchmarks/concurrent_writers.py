"""Benchmark: 1, 2 and 4 silver writers racing on one bronze stream fed by a real gateway.

For each N: a fresh lake, a `claw gateway` process, a load generator posting white-box steps
to it at a steady (clock-paced) rate, and N writer processes each looping `build_silver`.
After the window the load and the writers stop, silver catches up, the gateway stops
gracefully and silver catches up again; then every acknowledged step must be in silver
exactly once. Prints one JSON line. Targets: 0 duplicated and 0 lost steps for every N;
silver throughput (bronze rows per second brought into silver) with 4 writers >= 0.8 x one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import queue
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.app.processes import ServiceProcess, free_port  # noqa: E402
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEPS  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.materialize.silver import build_silver, watermark  # noqa: E402

TARGET_RATIO = 0.8
TARGET = "0 duplicated and 0 lost for every N; throughput(4) >= 0.8 x throughput(1)"
VOCAB = 150_000
IDLE_SLEEP_S = 0.05


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the JSON line)."""
    print(f"[concurrent_writers] {message}", file=sys.stderr, flush=True)


# -- load ---------------------------------------------------------------------------------


@dataclass
class Load:
    """What the load generator sent and which steps the gateway acknowledged (200)."""

    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    acknowledged: set[str] = field(default_factory=set)
    seconds: float = 0.0


def request_body(rng: np.random.Generator, trajectory: int, steps: int) -> bytes:
    """One trajectory of `steps` white-box steps: 150-350 prompt, 50-150 response tokens."""
    trajectory_uid = f"cw-{trajectory}-{uuid.uuid4().hex[:8]}"
    batch = []
    for index in range(steps):
        response = rng.integers(0, VOCAB, int(rng.integers(50, 150)))
        batch.append(
            {
                "trajectory_uid": trajectory_uid,
                "prompt_uid": f"cw-group-{trajectory // 4}",
                "step_index": index,
                "prompt_ids": rng.integers(0, VOCAB, int(rng.integers(150, 350))).tolist(),
                "response_ids": response.tolist(),
                "rollout_log_probs": np.round(-rng.random(len(response)) * 4, 4).tolist(),
                "reward": float(index == steps - 1),
                "policy_version": trajectory // 100,
                "is_last": index == steps - 1,
                "event_id": uuid.uuid4().hex,
            }
        )
    return json.dumps({"steps": batch}).encode()


async def _post(client: httpx.AsyncClient, url: str, body: bytes, load: Load) -> None:
    """Send one request; keep the event ids of a 200 answer."""
    try:
        answer = await client.post(url, content=body, headers={"content-type": "application/json"})
    except httpx.HTTPError as exc:
        load.errors[type(exc).__name__] += 1
        return
    load.statuses[answer.status_code] += 1
    if answer.status_code == 200:
        load.acknowledged.update(answer.json()["event_ids"])


async def _paced_load(url: str, rate: float, steps: int, stop: threading.Event, load: Load) -> None:
    """Post a request every steps/rate seconds by the clock until `stop`; await the last."""
    interval = steps / rate
    rng = np.random.default_rng(11)
    pending: set[asyncio.Task] = set()
    async with httpx.AsyncClient(timeout=60.0) as client:
        started = time.monotonic()
        while not stop.is_set():
            body = request_body(rng, load.requests, steps)
            due = started + load.requests * interval
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(_post(client, url + "/v1/steps", body, load))
            pending.add(task)
            task.add_done_callback(pending.discard)
            load.requests += 1
        load.seconds = time.monotonic() - started
        await asyncio.gather(*pending)


def start_load(url: str, rate: float, steps: int) -> tuple[threading.Thread, threading.Event, Load]:
    """The paced load generator on its own thread (with its own event loop)."""
    stop, load = threading.Event(), Load()
    thread = threading.Thread(
        target=asyncio.run, args=(_paced_load(url, rate, steps, stop, load),), daemon=True
    )
    thread.start()
    return thread, stop, load


# -- writers ------------------------------------------------------------------------------


def writer(uri: str, number: int, stop, results) -> None:
    """Loop `build_silver` until `stop`; send back this writer's counts."""
    counts = {"runs": 0, "noop_runs": 0, "write_conflicts": 0, "errors": 0, "build_s": 0.0}
    samples: Counter = Counter()
    results.put(("ready", number))
    while not stop.is_set():
        started = time.perf_counter()
        try:
            run = build_silver(Lake(uri))
        except Exception as exc:  # every exception is reported, none hidden
            counts["build_s"] += time.perf_counter() - started
            counts["errors"] += 1
            samples[f"{type(exc).__name__}: {exc}"[:300]] += 1
            time.sleep(IDLE_SLEEP_S)
            continue
        counts["build_s"] += time.perf_counter() - started
        counts["write_conflicts"] += run.write_conflicts
        if run.bronze_version is not None and run.bronze_version != run.previous_bronze_version:
            counts["runs"] += 1
        else:
            counts["noop_runs"] += 1
            time.sleep(IDLE_SLEEP_S)
    results.put(("done", number, counts, dict(samples.most_common(5))))


def start_writers(uri: str, count: int) -> tuple[list, object, object]:
    """`count` spawned writer processes (fork after delta-rs' runtime started would panic),
    returned once each has imported everything and is about to run."""
    context = mp.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    procs = [
        context.Process(target=writer, args=(uri, i, stop, results), daemon=True)
        for i in range(count)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        kind, _number = results.get(timeout=120)
        assert kind == "ready"
    return procs, stop, results


def stop_writers(procs: list, stop, results) -> dict:
    """Tell the writers to stop, collect and sum their counts, join them."""
    stop.set()
    total = {"runs": 0, "noop_runs": 0, "write_conflicts": 0, "errors": 0, "build_s": 0.0}
    per_writer, samples = [], Counter()
    for _ in procs:
        try:
            _kind, number, counts, errors = results.get(timeout=300)
        except queue.Empty:  # a writer died without reporting: an error, not a silence
            total["errors"] += 1
            samples["a writer exited without reporting its counts"] += 1
            continue
        per_writer.append({"writer": number, **counts, "build_s": round(counts["build_s"], 2)})
        samples.update(errors)
        for key in total:
            total[key] += counts[key]
    for proc in procs:
        proc.join(60)
    total["build_s"] = round(total["build_s"], 2)
    exit_codes = [proc.exitcode for proc in procs]
    per_writer.sort(key=lambda w: w["writer"])
    return total | {
        "error_samples": dict(samples),
        "writer_exit_codes": exit_codes,
        "per_writer": per_writer,
    }


# -- measurement --------------------------------------------------------------------------


def bronze_rows(lake: Lake, version: int | None) -> int:
    """Rows bronze had at `version` (0 when there is none)."""
    if version is None:
        return 0
    return lake.read(BRONZE_EVENTS, version=version, columns=["event_id"]).height


def verify(lake: Lake, acknowledged: set[str]) -> dict:
    """Duplicated and lost steps: every acknowledged event once in silver/steps."""
    steps = lake.read(SILVER_STEPS, columns=["step_key", "event_id"])
    in_silver = set(steps["event_id"].to_list())
    in_bronze = set(lake.read(BRONZE_EVENTS, columns=["event_id"])["event_id"].to_list())
    return {
        "silver_steps": steps.height,
        "duplicated": steps.height - steps["step_key"].n_unique(),
        "duplicated_event_ids": steps.height - steps["event_id"].n_unique(),
        "lost": len(acknowledged - in_silver),
        "lost_in_bronze": len(acknowledged - in_bronze),
        "silver_not_acknowledged": len(in_silver - acknowledged),
    }


def gateway(lake_dir: Path, workdir: Path) -> ServiceProcess:
    """A real `claw gateway` on a free loopback port, flushing to bronze every 200 ms."""
    env = {
        "CLAW_LAKE_URI": str(lake_dir),
        "CLAW_GATEWAY_ID": "gw-bench",
        "CLAW_FLUSH_INTERVAL_MS": "200",
    }
    port = free_port()
    log_path = workdir / f"gateway-{port}.log"
    return ServiceProcess("gateway", log_path, port=port, health="/readyz", env=env, cwd=REPO)


def race(writers: int, seconds: float, rate: float, steps: int) -> dict:
    """One N: gateway + paced load + `writers` racing writers for `seconds`; the figures."""
    with tempfile.TemporaryDirectory(prefix="claw-bench-writers-") as tmp:
        workdir = Path(tmp)
        uri = str(workdir / "lake")
        lake = Lake(uri)
        service = gateway(workdir / "lake", workdir).start()
        try:
            procs, stop_event, results = start_writers(uri, writers)
            thread, stop_load, load = start_load(service.url, rate, steps)
            started = time.monotonic()
            first = bronze_rows(lake, watermark(lake))
            time.sleep(max(0.0, started + seconds - time.monotonic()))
            window = time.monotonic() - started
            reached = bronze_rows(lake, watermark(lake))
            landed = bronze_rows(lake, lake.version(BRONZE_EVENTS))
            stop_load.set()
            thread.join(120)
            counts = stop_writers(procs, stop_event, results)
            catch_up = build_silver(lake).summary()
        finally:
            code = service.stop()
        after_stop = build_silver(lake).summary()
        checked = verify(lake, load.acknowledged)
    throughput = (reached - first) / window
    log(
        f"N={writers}: {throughput:.1f} rows/s, conflicts {counts['write_conflicts']}, "
        f"errors {counts['errors']}, duplicated {checked['duplicated']}, lost {checked['lost']}"
    )
    return {
        "throughput_rows_per_s": round(throughput, 1),
        "window_s": round(window, 2),
        "runs": counts.pop("runs"),
        "noop_runs": counts.pop("noop_runs"),
        "write_conflicts": counts.pop("write_conflicts"),
        "errors": counts.pop("errors"),
        "acknowledged": len(load.acknowledged),
        "duplicated": checked.pop("duplicated"),
        "lost": checked.pop("lost"),
        "lag_rows_at_end": landed - reached,
        "bronze_rows_landed_in_window": landed - first,
        "load": {
            "requests": load.requests,
            "statuses": {str(k): v for k, v in sorted(load.statuses.items())},
            "client_errors": dict(load.errors),
            "achieved_steps_per_s": round(len(load.acknowledged) / load.seconds, 1),
        },
        **checked,
        **counts,
        "catch_up_bronze_rows": catch_up["bronze_rows"],
        "after_stop_bronze_rows": after_stop["bronze_rows"],
        "gateway_exit_code": code,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="load window per N")
    parser.add_argument("--rate", type=float, default=200.0, help="steps per second posted")
    parser.add_argument("--steps-per-request", type=int, default=10)
    parser.add_argument("--writers", default="1,2,4", help="comma-separated N to race")
    args = parser.parse_args()

    started = time.monotonic()
    counts = [int(n) for n in args.writers.split(",")]
    runs = {str(n): race(n, args.seconds, args.rate, args.steps_per_request) for n in counts}
    baseline = runs.get("1", {}).get("throughput_rows_per_s")
    ratio = {
        n: round(r["throughput_rows_per_s"] / baseline, 3) if baseline else None
        for n, r in runs.items()
        if n != "1"
    }
    exact = all(r["duplicated"] == 0 and r["lost"] == 0 for r in runs.values())
    fast = ratio.get("4") is not None and ratio["4"] >= TARGET_RATIO
    emit(
        "concurrent_writers",
        target=TARGET,
        target_met=exact and fast,
        baseline=baseline,
        ratio=ratio,
        seconds=args.seconds,
        rate_steps_per_s=args.rate,
        steps_per_request=args.steps_per_request,
        writers=runs,
        total_s=round(time.monotonic() - started, 1),
    )


if __name__ == "__main__":
    main()

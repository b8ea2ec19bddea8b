"""Benchmark: an increment costs what changed, not what the lake holds.

For each lake size (default 50,000 and 2,000,000 steps), a lake of simulated GRPO traffic
written to bronze column-wise (`simulation/bulk.py`: 8 rollouts x 3 turns per group, 1,000
groups per policy version), taken in by the live materializer (bounded rounds, a child
process), then maintained once (compaction, checkpoints: what the maintenance schedule
does). Then, each in a fresh child process:
  - a restarted follower: its first round (loading what it keeps between rounds), then the
    median of 5 increments of 20 new groups (480 steps) landed in bronze, each timed from the
    bronze commit to the round that brought silver and gold up to date, and its peak memory;
  - `benchmarks/freshness.py`'s live load run against the pre-filled lake (its own policy
    version and dataset, so the trainer measures fresh groups, not the backlog; the bulk's
    dataset follows in the background, as any dataset no trainer pulls from);
  - a new trainer process's `next_batch` on the bulk's dataset (a new consumer, data
    ready): its first call (which also loads the dataset's rows and units once) and the
    next one (a running trainer's pull: the target);
  - every dashboard page in headless Chromium (`benchmarks/dashboard.py`'s timing): its
    first load after the dashboard starts (cold) and the median of 5 more (warm).
Same run, same machine: the 2 M increment is compared with the 50 k one (a ratio).
Targets: increment at 2 M <= 1.5 x at 50 k; freshness at 2 M p50 <= 1.5 s and p99 <= 3 s;
the materializer's memory at 2 M <= 4 GiB; next_batch <= 0.5 s; every dashboard page at
2 M <= 2 s warm, <= 5 s cold (the dashboard's memory is reported). Prints one JSON line
(progress on stderr).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks import dashboard, freshness  # noqa: E402
from benchmarks.harness import emit, in_child  # noqa: E402
from claw_pipelines.contracts.tables import BRONZE_EVENTS  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.simulation.bulk import (  # noqa: E402
    BulkShape,
    bronze_batch,
    bulk_batches,
    group_rows,
)

TARGET_RATIO = 1.5
TARGET_P50_S = 1.5
TARGET_P99_S = 3.0
TARGET_RSS_GIB = 4.0
TARGET_NEXT_BATCH_S = 0.5
TARGET = (
    "increment at the largest lake <= 1.5 x at the smallest; there: freshness p50 <= 1.5 s, "
    "p99 <= 3 s, materializer memory <= 4 GiB, next_batch <= 0.5 s, every dashboard page "
    "<= 2 s warm and <= 5 s cold"
)
SPEC = freshness.SPEC.model_copy(update={"name": "scale"})
LOAD_VERSION = 1_000_000  # the freshness load's policy version: above every bulk one
SHAPE = BulkShape()


def log(message: str) -> None:
    print(f"[scale] {message}", file=sys.stderr, flush=True)


def _peak_gib() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)


def take_in(uri: str, out) -> None:
    """Child: the live materializer until silver and gold hold all of bronze, then the
    maintenance a deployment runs on its schedule (compaction, checkpoints)."""
    from claw_pipelines.defs.maintenance import maintained_tables
    from claw_pipelines.materialize.live import LiveMaterializer

    lake = Lake(uri)
    started, rounds = time.perf_counter(), 0
    follower = LiveMaterializer(lake)
    while follower.step().changed:
        rounds += 1
    taken = time.perf_counter() - started
    started = time.perf_counter()
    for table in maintained_tables(lake):
        lake.maintain(table)
    out.put(
        {"seconds": round(taken, 1), "rounds": rounds, "peak_rss_gib": _peak_gib()}
        | {"maintenance_s": round(time.perf_counter() - started, 1)}
    )


def maintain(uri: str, out) -> None:
    """Child: what the maintenance schedule does to every table; its seconds."""
    from claw_pipelines.defs.maintenance import maintained_tables

    lake, started = Lake(uri), time.perf_counter()
    for table in maintained_tables(lake):
        lake.maintain(table)
    out.put(round(time.perf_counter() - started, 1))


def increments(uri: str, count: int, groups: int, out) -> None:
    """Child: a restarted follower's first round, then `count` increments of `groups`."""
    import numpy as np
    import polars as pl

    from claw_pipelines.materialize import live
    from claw_pipelines.materialize.live import LiveMaterializer

    live.PULLING_S = 0.0  # every dataset each round (a kept lake's old pulls aside)
    lake = Lake(uri)
    started = time.perf_counter()
    follower = LiveMaterializer(lake)
    follower.step()
    first_round = time.perf_counter() - started
    rng = np.random.default_rng(99)
    trajectories = lake.scan("silver/trajectories").select(pl.len()).collect().item()
    group = trajectories // SHAPE.rollouts
    times, silver_s = [], []
    for n in range(count):
        rows = [row for g in range(group, group + groups) for row in group_rows(g, SHAPE, rng)]
        group += groups
        lake.append(BRONZE_EVENTS, bronze_batch(rows, 10_000_000 + n, rng))
        started = time.perf_counter()
        done = follower.step()
        times.append(time.perf_counter() - started)
        assert done.silver is not None and done.silver.steps_added == groups * 24
        added = {g.dataset: len(g.added) for g in done.gold}
        assert added.get(SPEC.name) == groups, added  # every new group, once
        silver_s.append(done.silver_seconds)
    out.put(
        {
            "first_round_s": round(first_round, 3),
            "increment_s": [round(t, 3) for t in times],
            "increment_median_s": round(statistics.median(times), 3),
            "silver_median_s": round(statistics.median(silver_s), 3),
            "peak_rss_gib": _peak_gib(),
        }
    )


def next_batch(uri: str, out) -> None:
    """Child: a new consumer's first `next_batch` (and a second one) on the dataset."""
    from claw_pipelines.consume.dataset import Dataset

    started = time.perf_counter()
    dataset = Dataset(Lake(uri), SPEC.name)
    opened = time.perf_counter() - started
    calls = []
    for _ in range(2):
        started = time.perf_counter()
        batch = dataset.next_batch(1, consumer="scale-probe", timeout=5.0)
        calls.append(time.perf_counter() - started)
        assert batch is not None and len(batch.groups) == 1
    out.put(
        {"open_s": round(opened, 3), "first_s": round(calls[0], 3)}
        | {"second_s": round(calls[1], 3)}
    )


def build(uri: str, steps: int) -> dict:
    """Write the bulk bronze and let the live materializer take it in."""
    from claw_pipelines.lake.specs import save_spec

    lake = Lake(uri)
    started, records = time.perf_counter(), 0
    for table in bulk_batches(steps, SHAPE, 5_000, seed=7):
        lake.append(BRONZE_EVENTS, table)
        records += table.num_rows
    written = time.perf_counter() - started
    save_spec(lake, SPEC)
    log(f"{steps:,} steps: bronze written ({records:,} records, {written:.0f} s); taking in")
    taken = in_child(take_in, uri)
    log(f"{steps:,} steps: taken in: {taken}")
    return {"bronze_s": round(written, 1), "records": records, "take_in": taken}


def freshness_args(seconds: float) -> argparse.Namespace:
    """freshness.py's defaults for its live run."""
    return argparse.Namespace(
        rate=200.0,
        turn_gap=1.0,
        warmup_timeout=600.0,
        flush_ms=1000,
        poll_s=0.2,
        trainer_groups=1,
        trainer_max_tokens=262_144,
        trainer_poll_s=0.05,
        seconds=seconds,
    )


def measure(steps: int, workdir: Path, args: argparse.Namespace) -> dict:
    """Every figure of one lake size."""
    uri = str(workdir / f"lake-{steps}")
    result: dict = {"steps": steps}
    if not Path(uri, "bronze").exists():
        result["build"] = build(uri, steps)
    else:  # a kept lake: maintained, as the schedule would have since its last use
        result["maintenance_s"] = in_child(maintain, uri)
    result |= in_child(increments, uri, args.increments, args.groups)
    first = result["first_round_s"]
    log(f"{steps:,} steps: increments {result['increment_s']} (first round {first} s)")
    if args.freshness_seconds > 0 and steps == max(args.sizes):
        freshness.POLICY_VERSION = LOAD_VERSION
        spec = freshness.SPEC.model_copy(update={"policy_versions": [LOAD_VERSION]})
        live = freshness.measure(
            "live",
            args.freshness_seconds,
            30.0,
            freshness_args(args.freshness_seconds),
            lake_uri=uri,
            spec=spec,
        )
        result["freshness"] = {
            k: live[k]
            for k in (
                "p50_s",
                "p90_s",
                "p99_s",
                "delivered",
                "acknowledged_groups",
                "missing",
                "duplicates",
                "steady_steps_per_s",
                "materializer_cores",
                "builder_peak_rss_gib",
                "warmup_s",
                "statuses",
                "client_errors",
                "breakdown",
                "materializer_rounds",
            )
            if k in live
        }
        log(f"{steps:,} steps: freshness {result['freshness']}")
    # after the load run: a pull marks the bulk dataset as one a trainer waits on, and the
    # materializer would then curate it every round beside the load's own dataset
    result["next_batch"] = in_child(next_batch, uri)
    log(f"{steps:,} steps: next_batch {result['next_batch']}")
    if args.dashboard_loads > 0 and steps == max(args.sizes):
        pages = dashboard.time_pages(Path(uri), args.dashboard_loads, workdir / "dashboard.log")
        result["dashboard"] = pages | {"peak_rss_gib": round(pages["peak_rss_bytes"] / 2**30, 3)}
        log(f"{steps:,} steps: dashboard {result['dashboard']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="50000,2000000", help="lake sizes, in steps")
    parser.add_argument("--increments", type=int, default=5)
    parser.add_argument("--groups", type=int, default=20, help="groups per increment")
    parser.add_argument("--freshness-seconds", type=float, default=60.0, help="0 skips it")
    parser.add_argument(
        "--dashboard-loads", type=int, default=5, help="warm loads per page (0 skips pages)"
    )
    parser.add_argument("--workdir", help="keep the lakes here (and reuse them when present)")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]

    with tempfile.TemporaryDirectory(prefix="claw-bench-scale-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        lakes = {str(steps): measure(steps, workdir, args) for steps in args.sizes}
    small, large = lakes[str(min(args.sizes))], lakes[str(max(args.sizes))]
    ratio = large["increment_median_s"] / small["increment_median_s"]
    fresh = large.get("freshness") or {}
    rss = max(large["peak_rss_gib"], fresh.get("builder_peak_rss_gib") or 0.0)
    met = {
        "increment_ratio": ratio <= TARGET_RATIO,
        # a running trainer's pull; a new process's first call also loads the dataset's index
        "next_batch": large["next_batch"]["second_s"] <= TARGET_NEXT_BATCH_S,
        "memory": rss <= TARGET_RSS_GIB,
    }
    if args.freshness_seconds > 0:
        met["freshness"] = (
            fresh.get("p50_s") is not None
            and fresh["p50_s"] <= TARGET_P50_S
            and fresh["p99_s"] <= TARGET_P99_S
            and fresh.get("missing") == 0
            and fresh.get("duplicates") == 0
        )
    pages = large.get("dashboard")
    if pages is not None:
        met["dashboard"] = (
            max(pages["warm_p50_s"].values()) <= dashboard.WARM_TARGET_S
            and max(pages["cold_s"].values()) <= dashboard.COLD_TARGET_S
            and pages["exceptions"] == 0
        )
    emit(
        "scale",
        target=TARGET,
        target_met=all(met.values()),
        baseline=f"lakes.{min(args.sizes)}.increment_median_s",
        ratio=round(ratio, 3),
        lakes=lakes,
        increment_ratio=round(ratio, 3),
        materializer_peak_rss_gib=rss,
        targets_met=met,
    )


if __name__ == "__main__":
    main()

"""Benchmark (issue 57): materialization split across shards, on this machine's 2 cores.

1. Take-in of pre-landed bronze, one follower vs two shard followers, in the same run and on
   copies of the same bronze: the long agentic shape (`simulation.bulk.AGENTIC`,
   `--agentic-groups` groups, a bronze commit each, the `agentic` dataset) and a bulk lake of
   short steps (`BulkShape()`, `--bulk-steps`, 5,000-record commits, the `long` dataset).
   Each follower is a process of its own pinned to its own core (`claw materialize --follow`
   as `LiveMaterializer.from_settings` builds it: the one follower with its history, each
   shard with `--shard i/2`), running before the bronze lands: started on the lake without
   its bronze, its first round done there (imports, lease, tables, view), then the bronze
   lands whole (its files and log copied in) and the clock starts; it stops when the last
   follower's round changes nothing (as `long_runs.py` times a running follower: what a
   process pays once at its start is not take-in).
   Steps/s = steps / that wall time. Target: 2 shards >= 1.7 x the steps/s of one.
2. Live freshness with 2 shards: `benchmarks/freshness.py`'s live path (a real gateway, a
   trainer on `next_batch`, paced GRPO load) with two `claw materialize --follow --shard
   i/2` services. Targets: p50 <= 1.5 s, p99 <= 3 s, every acknowledged group delivered
   exactly once.
3. A full rebuild of one spec's dataset over the bulk lake (its silver built by the take-in
   above) as one Dagster run of `gold_rebuild_job` (`claw materialize --select group:gold
   --dataset long --parallel N`: its policy-version partitions in N shares of about equal
   steps, the multiprocess executor running the shares as processes): one share vs two.
   Wall time of the command. Target: two >= 1.6 x one.
4. Chaos (`simulation.chaos`, as `tests/system/test_shard_chaos.py` runs it): two shard
   followers under GRPO groups landing every 0.25 s, four SIGKILLs, a resharding 2 -> 3,
   two trainer ranks pulling: acknowledged groups, delivered once, lost, twice, kills,
   reshardings. Target: every acknowledged group delivered exactly once.

Prints one JSON line (progress on stderr).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402

TARGET_SPEEDUP = 1.7
TARGET_REBUILD_SPEEDUP = 1.6
TARGET_P50_S, TARGET_P99_S = 1.5, 3.0
TARGET = (
    "take-in of pre-landed bronze (bulk and agentic): 2 shards >= 1.7 x one follower's "
    "steps/s; a full rebuild as 2 parallel Dagster runs >= 1.6 x one; live freshness with 2 "
    "shards p50 <= 1.5 s, p99 <= 3 s; chaos: acknowledged groups delivered once, none lost"
)


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[shards] {message}", file=sys.stderr, flush=True)


def follower_child(uri: str, dataset: str, shard: str | None, cpu: int, ready, go, out) -> None:
    """One follower on `uri` (shard `shard`, or the whole lake), pinned to core `cpu`: ready
    once started, then rounds until one changes nothing; (start, end, cpu seconds, rounds)."""
    os.sched_setaffinity(0, {cpu})
    import resource

    import pandas  # noqa: F401  (what a follower that has run a while has loaded)

    from claw_pipelines.contracts.shards import Slot
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.materialize.live import LiveMaterializer
    from claw_pipelines.settings import ClawSettings

    lake = Lake(uri)
    slot = None if shard is None else Slot.parse(shard)
    follower = LiveMaterializer.from_settings(lake, ClawSettings(lake_uri=uri), [dataset], slot)
    follower.step()  # running before its bronze lands: lease, tables, view, a first round
    ready.set()
    go.wait()
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_before = used.ru_utime + used.ru_stime
    started, rounds = time.time(), 0
    while follower.step().changed:
        rounds += 1
    ended = time.time()
    used = resource.getrusage(resource.RUSAGE_SELF)
    failing = dict(follower.failing)
    follower.close()
    out.put((started, ended, used.ru_utime + used.ru_stime - cpu_before, rounds, failing))


def take_in(base: Path, workdir: Path, dataset: str, shards: int, steps: int) -> dict:
    """Followers (one, or `shards` shard followers) take a copy of `base`'s bronze in."""
    uri = str(workdir / f"{base.name}-{shards}")
    shutil.rmtree(uri, ignore_errors=True)
    shutil.copytree(
        base, uri, ignore=lambda folder, _names: ["bronze"] if folder == str(base) else []
    )
    if shards > 1:
        from claw_pipelines.lake.delta import Lake
        from claw_pipelines.lake.leases import ShardPlan

        ShardPlan.set(Lake(uri), shards)
    cores = sorted(os.sched_getaffinity(0))
    context = mp.get_context("spawn")
    go, out = context.Event(), context.Queue()
    names = [None] if shards == 1 else [f"{i}/{shards}" for i in range(shards)]
    children, readies = [], []
    os.environ["CLAW_FOLLOWER_STATE"] = f"{uri}-state"
    for n, shard in enumerate(names):
        ready = context.Event()
        cpu = cores[n % len(cores)]
        child = context.Process(
            target=follower_child, args=(uri, dataset, shard, cpu, ready, go, out)
        )
        child.start()
        children.append(child)
        readies.append(ready)
    for ready in readies:
        ready.wait(600)
    shutil.copytree(base / "bronze", Path(uri) / "bronze")  # the bronze lands, whole
    go.set()
    found = [out.get(timeout=3_600) for _ in children]
    for child in children:
        child.join(60)
    wall = max(f[1] for f in found) - min(f[0] for f in found)
    failing = {k: v for f in found for k, v in f[4].items()}
    return {
        "followers": len(names),
        "wall_s": round(wall, 2),
        "steps_per_s": round(steps / wall, 1),
        "cpu_s": [round(f[2], 2) for f in found],
        "rounds": [f[3] for f in found],
        "failing": failing,
    }


def compare(base: Path, workdir: Path, dataset: str, steps: int) -> dict:
    """One follower, then two shards, on copies of `base`."""
    one = take_in(base, workdir, dataset, 1, steps)
    log(f"{base.name}: one follower {one}")
    two = take_in(base, workdir, dataset, 2, steps)
    log(f"{base.name}: two shards {two}")
    return {
        "steps": steps,
        "one": one,
        "two_shards": two,
        "speedup": round(two["steps_per_s"] / one["steps_per_s"], 3),
    }


def agentic_bronze(workdir: Path, groups: int) -> tuple[Path, int]:
    """The long agentic shape's bronze (and its dataset's spec) in a lake of its own."""
    from claw_pipelines.contracts.tables import BRONZE_EVENTS
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.lake.specs import save_spec
    from claw_pipelines.simulation.bulk import AGENTIC, bulk_batches

    base = workdir / "agentic"
    lake = Lake(str(base))
    per_group = AGENTIC.rollouts * AGENTIC.turns
    records = per_group + AGENTIC.rollouts  # a commit a group, as the gateway's flushes
    for table in bulk_batches(groups * per_group, AGENTIC, records, seed=7):
        lake.append(BRONZE_EVENTS, table)
    save_spec(lake, _spec("agentic"))
    return base, groups * per_group


def bulk_bronze(workdir: Path, steps: int) -> tuple[Path, int]:
    """A bulk lake of short steps (`BulkShape()`) in a lake of its own."""
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.lake.specs import save_spec
    from claw_pipelines.simulation.bulk import BulkShape, write_bulk_bronze

    base = workdir / "bulk"
    lake = Lake(str(base))
    write_bulk_bronze(lake, steps, BulkShape(), batch=5_000)
    save_spec(lake, _spec("long"))
    shape = BulkShape()
    per_group = shape.rollouts * shape.turns
    return base, -(-steps // per_group) * per_group


def _spec(name: str):
    """The GRPO dataset (freshness.py's spec: complete groups of 8), named `name`."""
    from benchmarks.freshness import SPEC

    return SPEC.model_copy(update={"name": name})


def rebuild(lake_dir: Path, workdir: Path, dataset: str) -> dict:
    """`dataset`'s partitions rebuilt as Dagster runs: by one process, then by two at once."""
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.materialize.gold import policy_versions

    versions = sorted(policy_versions(Lake(str(lake_dir))))
    claw = [sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--select"]
    claw += ["group:gold", "--dataset", dataset, "--lake", str(lake_dir)]
    env = {**os.environ, "CLAW_LAKE_URI": str(lake_dir)}
    env.pop("DAGSTER_HOME", None)  # an ephemeral instance a process

    def timed(processes: int) -> float:
        began = time.monotonic()
        with (workdir / f"rebuild-{processes}.log").open("w") as out:
            code = subprocess.call(
                [*claw, "--parallel", str(processes)],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=3_600,
            )
        if code:
            raise RuntimeError(f"claw materialize exited {code} (log in {workdir})")
        return time.monotonic() - began

    one = timed(1)
    log(f"rebuild: {len(versions)} partitions by one process in {one:.1f} s")
    two = timed(2)
    log(f"rebuild: by two processes in {two:.1f} s")
    return {
        "partitions": len(versions),
        "one_s": round(one, 1),
        "two_s": round(two, 1),
        "speedup": round(one / two, 3),
    }


def live_freshness(seconds: float, drain: float) -> dict:
    """freshness.py's live path with two shard followers."""
    from benchmarks import freshness

    args = freshness.arguments().parse_args([])
    return freshness.measure("live", seconds, drain, args, shards=2)


def chaos(workdir: Path) -> dict:
    """`simulation.chaos` (as the soak test runs it): two shard followers under GRPO groups
    landing, four SIGKILLs, a resharding 2 -> 3, two trainer ranks pulling all along."""
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.simulation.chaos import Chaos, run_chaos

    result = run_chaos(Lake(str(workdir / "lake")), workdir, Chaos())
    figures = result.summary()
    figures["exactly_once"] = (
        figures["delivered_once"] == figures["acknowledged_groups"]
        and figures["lost"] == figures["twice"] == figures["unexpected"] == 0
    )
    log(f"chaos: {figures}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agentic-groups", type=int, default=12)
    parser.add_argument("--bulk-steps", type=int, default=1_000_000)
    parser.add_argument("--fresh-seconds", type=float, default=60.0, help="0 skips freshness")
    parser.add_argument("--fresh-drain", type=float, default=30.0)
    parser.add_argument("--workdir", help="keep the lakes here")
    parser.add_argument("--chaos", type=int, default=1, help="0 skips the chaos run")
    parser.add_argument(
        "--rebuild", type=int, default=1, help="0 skips the rebuild (needs --bulk-steps)"
    )
    args = parser.parse_args()
    started = time.monotonic()
    figures: dict = {}
    met: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="claw-bench-shards-") as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        base, steps = agentic_bronze(workdir, args.agentic_groups)
        figures["agentic"] = compare(base, workdir, "agentic", steps)
        met["agentic_speedup"] = figures["agentic"]["speedup"] >= TARGET_SPEEDUP
        if args.bulk_steps:
            began = time.monotonic()
            base, steps = bulk_bronze(workdir, args.bulk_steps)
            log(f"bulk: {steps:,} steps written in {time.monotonic() - began:.0f} s")
            figures["bulk"] = compare(base, workdir, "long", steps)
            met["bulk_speedup"] = figures["bulk"]["speedup"] >= TARGET_SPEEDUP
            if args.rebuild:
                built = workdir / "bulk-1"  # the one follower's lake: silver and gold built
                figures["full_rebuild"] = rebuild(built, workdir, "long")
                speedup = figures["full_rebuild"]["speedup"]
                met["full_rebuild_speedup"] = speedup >= TARGET_REBUILD_SPEEDUP
    if args.fresh_seconds > 0:
        live = live_freshness(args.fresh_seconds, args.fresh_drain)
        figures["freshness_two_shards"] = live
        met["freshness"] = (
            live["p50_s"] is not None
            and live["p50_s"] <= TARGET_P50_S
            and live["p99_s"] <= TARGET_P99_S
            and live["missing"] == 0
            and live["duplicates"] == 0
        )
    met.setdefault("full_rebuild_speedup", False)
    if args.chaos:
        with tempfile.TemporaryDirectory(prefix="claw-bench-chaos-") as tmp:
            figures["chaos"] = chaos(Path(tmp))
        met["chaos"] = figures["chaos"]["exactly_once"]
    else:
        figures["chaos"] = "skipped (--chaos 0)"
        met["chaos"] = False
    emit(
        "shards",
        target=TARGET,
        target_met=all(met.values()),
        baseline="one follower on a copy of the same bronze",
        ratio={
            k: v["speedup"] for k, v in figures.items() if isinstance(v, dict) and "speedup" in v
        },
        targets_met=met,
        cores=len(os.sched_getaffinity(0)),
        total_s=round(time.monotonic() - started, 1),
        **figures,
    )


if __name__ == "__main__":
    main()

"""Benchmark: freshness, from the ack of a GRPO group's last step to its delivery to a trainer.

Agents post complete multi-turn GRPO groups (8 rollouts x 3 turns, one white-box step per
request, several groups in flight, clock-paced at >= 200 steps/s) through a real `claw
gateway`; a trainer process blocks on `Dataset.next_batch`; for every group the time from the
ack of its last step to its delivery in a batch is measured. Two paths, each on a fresh lake
with the same curation spec:

- live: `claw materialize --follow` (the continuous materializer). Targets: p50 <= 2 s,
  p99 <= 5 s, every acknowledged complete group delivered exactly once (the trainer's record
  and `gold/consumption`), the materializer's CPU <= 0.5 core, the load rate sustained.
- dagster_sensors: `dagster-daemon` alone (bronze_version_sensor -> silver runs,
  gold_partitions_sensor -> gold partition runs), for comparison; no target.

Each group's latency is also split at its bronze commit (Delta history of bronze/events) and
its first gold version (history of gold/datasets/<name>): flush, materialize, deliver.
Prints one JSON line (progress on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import (  # noqa: E402
    ROLLOUTS,
    STEPS_PER_GROUP,
    TURNS,
    Acks,
    Plan,
    descendants,
    emit,
    group_steps,
    plan_load,
    seconds_summary,
    start_load,
    started_at,
    status_kib,
    tree_cpu_s,
)
from claw_pipelines.app.instance import DAGSTER_YAML  # noqa: E402
from claw_pipelines.app.processes import ServiceProcess, free_port  # noqa: E402
from claw_pipelines.contracts.shards import Slot  # noqa: E402
from claw_pipelines.contracts.specs import CurationSpec  # noqa: E402
from claw_pipelines.contracts.tables import (  # noqa: E402
    BRONZE_EVENTS,
    GOLD_CONSUMPTION,
    gold_dataset_table,
)
from claw_pipelines.lake.delta import COMMIT_METADATA_KEY, Lake  # noqa: E402
from claw_pipelines.lake.leases import ShardPlan  # noqa: E402
from claw_pipelines.lake.specs import save_spec  # noqa: E402
from claw_pipelines.materialize.live import materializer_running  # noqa: E402

TARGET_P50_S = 2.0
TARGET_P99_S = 5.0
TARGET_CORES = 0.5
RATE_TOLERANCE = 0.95  # the steady part of the load must reach this share of --rate
TARGET = (
    "live p50 <= 2 s, p99 <= 5 s, every acknowledged complete group delivered exactly once, "
    "materializer <= 0.5 core, at >= 0.95 x the requested step rate"
)
SPEC = CurationSpec(
    name="fresh",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    complete_groups_only=True,
    min_group_size=8,
    merge="prompt_group",
    advantage="grpo",
)
CONSUMER = "bench"
POLICY_VERSION = 1
WARM_GROUP = "warm"
ROUND_LINE = re.compile(r"^(\d+\.\d+) s  ")
PROBLEM = re.compile(r"Traceback|ERROR|CRITICAL|round failed|Exception", re.IGNORECASE)


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the JSON line)."""
    print(f"[freshness] {message}", file=sys.stderr, flush=True)


# -- agents -------------------------------------------------------------------------------


def warm_group_body(seed: int, name: str = WARM_GROUP) -> bytes:
    """The warm-up group, all 24 steps in one request."""
    rollouts = group_steps(np.random.default_rng(seed), name, POLICY_VERSION)
    return json.dumps({"steps": [s for turns in rollouts for s in turns]}).encode()


# -- trainer ------------------------------------------------------------------------------


def trainer(
    uri: str,
    groups: int | None,
    max_tokens: int | None,
    poll_s: float,
    stop,
    out,
    consumer: str = CONSUMER,
):
    """Spawned: block on `next_batch` until `stop`; report each batch's delivery time."""
    from claw_pipelines.consume.dataset import Dataset

    lake = Lake(uri)
    out.put(("ready",))
    dataset, calls, empty, errors = None, 0, 0, Counter()
    while dataset is None and not stop.is_set():
        try:
            dataset = Dataset(lake, SPEC.name)
        except LookupError:  # no gold write yet
            time.sleep(poll_s)
    while not stop.is_set():
        started = time.perf_counter()
        try:
            batch = dataset.next_batch(
                groups, consumer=consumer, max_tokens=max_tokens, timeout=1.0, poll_s=poll_s
            )
        except Exception as exc:  # every exception is reported, none hidden
            errors[f"{type(exc).__name__}: {exc}"[:300]] += 1
            time.sleep(poll_s)
            continue
        at, calls = time.time(), calls + 1
        if batch is None:
            empty += 1
            continue
        took = time.perf_counter() - started
        out.put(("batch", at, list(batch.groups), len(batch.step_keys), took))
    out.put(("done", calls, empty, dict(errors.most_common(5))))


@dataclass
class Deliveries:
    """What the trainer reported: per batch (delivered_at, groups, steps, call seconds)."""

    batches: list[tuple[float, list[str], int, float]] = field(default_factory=list)
    at: dict[str, float] = field(default_factory=dict)  # group -> first delivery
    times: Counter = field(default_factory=Counter)  # group -> deliveries
    steps: dict[str, int] = field(default_factory=dict)  # group -> steps in its batch
    summary: dict = field(default_factory=dict)

    def collect(self, out, wait_s: float) -> None:
        """Take every message the trainer sent (waiting up to `wait_s` for the first)."""
        try:
            message = out.get(timeout=wait_s)
            while True:
                self._take(message)
                message = out.get_nowait()
        except queue.Empty:
            return

    def _take(self, message: tuple) -> None:
        if message[0] == "batch":
            _, at, groups, steps, took = message
            self.batches.append((at, groups, steps, took))
            for group in groups:
                key = group.split(":", 1)[1]
                self.times[key] += 1
                self.at.setdefault(key, at)
                self.steps[key] = steps if len(groups) == 1 else -1
        elif message[0] == "done":
            _, calls, empty, errors = message
            self.summary = {"calls": calls, "empty_calls": empty, "errors": errors}


def start_trainer(
    uri: str, groups: int | None, max_tokens: int | None, poll_s: float, consumer: str = CONSUMER
) -> tuple:
    """A spawned trainer process (fork after delta-rs' runtime started would panic), once it
    has imported everything."""
    context = mp.get_context("spawn")
    stop, out = context.Event(), context.Queue()
    options = (uri, groups, max_tokens, poll_s, stop, out, consumer)
    proc = context.Process(target=trainer, args=options, daemon=True)
    proc.start()
    message = out.get(timeout=120)
    assert message == ("ready",), message
    return proc, stop, out


def stop_trainer(proc, stop, out, deliveries: Deliveries) -> int | None:
    """Tell the trainer to stop, take its last messages, join it (kill if it hangs)."""
    stop.set()
    deadline = time.monotonic() + 30
    while not deliveries.summary and time.monotonic() < deadline:
        deliveries.collect(out, 0.5)
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
    return proc.exitcode


# -- processes ----------------------------------------------------------------------------


def gateway_service(lake: str, workdir: Path, flush_ms: int) -> ServiceProcess:
    """A real `claw gateway` on a free loopback port (with its bronze flusher child)."""
    env = {
        "CLAW_LAKE_URI": lake,
        "CLAW_GATEWAY_ID": "gw-bench",
        "CLAW_FLUSH_INTERVAL_MS": str(flush_ms),
    }
    port = free_port()
    return ServiceProcess(
        "gateway", workdir / "gateway.log", port=port, health="/readyz", env=env, cwd=REPO
    )


def materializer_service(
    lake: str, workdir: Path, poll_s: float, slot: Slot | None = None
) -> ServiceProcess:
    """`claw materialize --follow` (`--shard` when `slot`), ready once its heartbeat is in
    the lake (no Dagster)."""
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--follow"]
    shard = [] if slot is None else ["--shard", str(slot)]
    return ServiceProcess(
        "materialize",
        workdir / ("materializer.log" if slot is None else f"materializer-{slot.index}.log"),
        command=[*command, "--lake", lake, "--poll-s", str(poll_s), *shard],
        env={"CLAW_LAKE_URI": lake, "DAGSTER_HOME": "", "PYTHONUNBUFFERED": "1"},
        cwd=REPO,
        ready=lambda: materializer_running(Lake(lake), slot=slot),
    )


def daemon_service(lake: str, workdir: Path) -> ServiceProcess:
    """`dagster-daemon run` with its own DAGSTER_HOME (claw up's dagster.yaml); no webserver:
    it is ready as soon as it runs (the warm-up group proves its sensors work)."""
    home = workdir / "dagster"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    script = str(Path(sys.executable).with_name("dagster-daemon"))
    return ServiceProcess(
        "dagster-daemon",
        workdir / "dagster-daemon.log",
        command=[script, "run", "-m", "claw_pipelines.definitions"],
        env={"CLAW_LAKE_URI": lake, "DAGSTER_HOME": str(home)},
        cwd=REPO,
        ready=lambda: True,
    )


def stop_service(service: ServiceProcess) -> int | None:
    """Stop gracefully, then SIGKILL any descendant it left behind (by pid and start time)."""
    if service.proc is None:
        return None
    running = service.proc.poll() is None
    left = [(p, started_at(p)) for p in descendants(service.proc.pid)] if running else []
    code = service.stop(timeout=60)
    for pid, start in left:
        if start is not None and started_at(pid) == start:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return code


def log_problems(path: Path) -> dict:
    """Lines of a log that look like errors: how many, and the first few."""
    if not path.exists():
        return {"lines": 0, "samples": []}
    lines = [line for line in path.read_text(errors="replace").splitlines() if PROBLEM.search(line)]
    return {"lines": len(lines), "samples": [line[:300] for line in lines[:3]]}


# -- measurement --------------------------------------------------------------------------


def bronze_commit_times(lake: Lake) -> dict[str, float]:
    """Per event id: when the bronze commit holding it was made (epoch s)."""
    at_seq = {}
    for entry in lake.open(BRONZE_EVENTS).history():
        raw = entry.get(COMMIT_METADATA_KEY)
        seq = (json.loads(raw) if isinstance(raw, str) else {}).get("batch_seq")
        if seq is not None:
            at_seq[int(seq)] = entry["timestamp"] / 1000
    rows = lake.read(BRONZE_EVENTS, columns=["event_id", "batch_seq"])
    return {e: at_seq.get(int(s), float("nan")) for e, s in rows.iter_rows()}


def gold_first_seen(lake: Lake) -> tuple[dict[str, float], int]:
    """Per group: the commit time of the first gold dataset version holding it; versions."""
    table = gold_dataset_table(SPEC.name)
    seen: dict[str, float] = {}
    commits = [e for e in lake.open(table).history() if int(e.get("version", -1)) >= 0]
    history = sorted(commits, key=lambda e: e["version"])
    for entry in history:
        frame = lake.read(table, int(entry["version"]), columns=["prompt_uid"]).unique()
        for (group,) in frame.iter_rows():
            seen.setdefault(group, entry["timestamp"] / 1000)
    return seen, len(history)


def consumption_check(lake: Lake, consumer: str = CONSUMER) -> dict:
    """The trainer's record in gold/consumption: batches, groups, duplicated groups."""
    rows = lake.read(GOLD_CONSUMPTION).filter(
        (pl.col("consumer") == consumer) & (pl.col("dataset") == SPEC.name)
    )
    groups = rows["groups"].explode().drop_nulls()
    return {
        "batches": rows.height,
        "groups": groups.len(),
        "duplicates": groups.len() - groups.n_unique(),
        "keys": {g.split(":", 1)[1] for g in groups.to_list()},
    }


def breakdown(lake: Lake, plan: Plan, groups: list[str], acks: Acks, got: Deliveries) -> dict:
    """Where each delivered group's latency went: ack -> bronze commit -> gold -> trainer."""
    bronze_at = bronze_commit_times(lake)
    gold_at, versions = gold_first_seen(lake)
    flush, build, deliver = [], [], []
    for group in groups:
        landed = max(bronze_at.get(e, float("nan")) for e in plan.event_ids[group])
        if group not in gold_at or np.isnan(landed):
            continue
        flush.append(landed - acks.last_ack[group])
        build.append(gold_at[group] - landed)
        deliver.append(got.at[group] - gold_at[group])
    stages = {"ack_to_bronze": flush, "bronze_to_gold": build, "gold_to_delivery": deliver}
    split = {
        name: {k: v for k, v in seconds_summary(values).items() if k in ("p50_s", "p90_s", "max_s")}
        for name, values in stages.items()
    }
    return split | {"gold_versions": versions}


def materializer_rounds(path: Path) -> dict:
    """The live materializer's rounds that wrote something (its log line per round)."""
    rounds = [
        (float(m.group(1)), line)
        for line in path.read_text(errors="replace").splitlines()
        if (m := ROUND_LINE.match(line))
    ]
    figures = seconds_summary([seconds for seconds, _ in rounds])
    slowest = [line for _, line in sorted(rounds, reverse=True)[:3]]
    return {
        "count": len(rounds),
        "p50_s": figures["p50_s"],
        "max_s": figures["max_s"],
        "slowest": slowest,  # the round lines, with where each round's time went
    }


def steady_rate(acks: Acks, seconds: float, ramp_s: float) -> float:
    """Steps acknowledged per second between the end of the ramp-up and the load's end."""
    lo, hi = acks.started + ramp_s, acks.started + seconds
    if hi <= lo:
        lo, hi = acks.started, acks.finished
    inside = sum(1 for t in acks.ack_times if lo <= t < hi)
    return inside / (hi - lo)


def warm_up(url: str, got: Deliveries, out, timeout: float, warm: str = WARM_GROUP) -> float:
    """Post the warm-up group and wait for its delivery (the path works end to end)."""
    started = time.monotonic()
    answer = httpx.post(
        url + "/v1/steps",
        content=warm_group_body(7, warm),
        headers={"content-type": "application/json"},
        timeout=60,
    )
    answer.raise_for_status()
    while warm not in got.at:
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"the warm-up group was not delivered within {timeout:.0f} s")
        got.collect(out, 0.5)
    return time.monotonic() - started


def peak_rss_gib(pid: int) -> float | None:
    """The peak resident memory of a running process (VmHWM), in GiB."""
    kib = status_kib(pid, "VmHWM")
    return round(kib / 2**20, 3) if kib is not None else None


def measure(
    path: str,
    seconds: float,
    drain_s: float,
    args: argparse.Namespace,
    lake_uri: str | None = None,
    spec: CurationSpec = SPEC,
    shards: int = 1,
) -> dict:
    """One path: services, trainer, warm-up, paced load, drain; figures. On a fresh lake,
    or on `lake_uri` (a pre-filled one, written to; groups and consumer named for this run)
    with `spec` (named SPEC.name). `shards` > 1: that many live followers split the work
    (`--shard i/N`; their cores summed)."""
    tag = f"r{uuid.uuid4().hex[:6]}" if lake_uri else ""  # ids start with a letter or digit
    consumer, warm = (f"{name}-{tag}" if tag else name for name in (CONSUMER, WARM_GROUP))
    with tempfile.TemporaryDirectory(prefix=f"claw-bench-fresh-{path}-") as tmp:
        workdir = Path(tmp)
        uri = lake_uri or str(workdir / "lake")
        lake = Lake(uri)
        save_spec(lake, spec)
        gateway = gateway_service(uri, workdir, args.flush_ms)
        if path == "live" and shards > 1:
            ShardPlan.set(lake, shards)
            slots: list[Slot | None] = [Slot(i, shards) for i in range(shards)]
        else:
            slots = [None]
        builders = (
            [materializer_service(uri, workdir, args.poll_s, slot) for slot in slots]
            if path == "live"
            else [daemon_service(uri, workdir)]
        )
        services, trainer_proc, got = [gateway, *builders], None, Deliveries()
        try:
            gateway.start(timeout=60)
            for builder in builders:
                builder.start(timeout=120)
            groups = None if args.trainer_max_tokens else args.trainer_groups
            trainer_proc, stop, out = start_trainer(
                uri, groups, args.trainer_max_tokens, args.trainer_poll_s, consumer
            )
            warm_s = warm_up(gateway.url, got, out, args.warmup_timeout, warm)
            log(f"{path}: warm-up group delivered after {warm_s:.1f} s")
            prefix = f"{tag}-" if tag else ""
            plan = plan_load(
                seconds,
                args.rate,
                args.turn_gap,
                seed=11,
                prefix=prefix,
                policy_version=POLICY_VERSION,
            )
            pids = {"gateway": [gateway.proc.pid], "trainer": [trainer_proc.pid]}
            pids["builder"] = [b.proc.pid for b in builders]

            def used() -> dict[str, float]:
                return {k: sum(tree_cpu_s(p) for p in ps) for k, ps in pids.items()}

            cpu0, t0 = used(), time.monotonic()
            thread, acks = start_load(gateway.url, plan)
            while thread.is_alive():
                got.collect(out, 0.2)
            cpu1, t1 = used(), time.monotonic()
            builder_rss = max((peak_rss_gib(b.proc.pid) or 0.0) for b in builders) or None
            cores = {k: round((cpu1[k] - cpu0[k]) / (t1 - t0), 3) for k in pids}
            expected = acks.complete_groups()
            log(f"{path}: load done ({len(expected)} complete groups acknowledged); draining")
            drain_started = time.monotonic()
            while not expected <= got.at.keys():
                if time.monotonic() - drain_started > drain_s:
                    break
                got.collect(out, 0.5)
            drained = time.monotonic() - drain_started
            trainer_code = stop_trainer(trainer_proc, stop, out, got)
            trainer_proc = None
            consumed = consumption_check(lake, consumer)
            measured = sorted(expected & got.at.keys())
            split = breakdown(lake, plan, measured, acks, got)
        finally:
            if trainer_proc is not None:
                trainer_proc.kill()
                trainer_proc.join(10)
            codes = {s.verb: stop_service(s) for s in reversed(services)}
        problems = {s.verb: log_problems(s.log_path) for s in services}
        rounds = [materializer_rounds(b.log_path) for b in builders] if path == "live" else None
    latencies = [got.at[g] - acks.last_ack[g] for g in measured]
    figures = seconds_summary(latencies)
    delivered_keys = got.at.keys() - {warm}
    duplicates = sum(n - 1 for n in got.times.values() if n > 1)
    partial = sum(1 for g in measured if 0 <= got.steps[g] < STEPS_PER_GROUP)
    calls = [b[3] for b in got.batches]
    rate = steady_rate(acks, seconds, plan.ramp_s)
    log(
        f"{path}: p50 {figures['p50_s']} s, p99 {figures['p99_s']} s, "
        f"{len(measured)}/{len(expected)} delivered, {duplicates} duplicates, cores {cores}"
    )
    result = {
        **figures,
        "delivered": len(measured),
        "acknowledged_groups": len(expected),
        "groups_planned": len(plan.event_ids),
        "incomplete_groups": len(plan.event_ids) - len(expected),
        "duplicates": duplicates,
        "missing": len(expected - got.at.keys()),
        "unexpected": len(delivered_keys - expected),
        "partial_deliveries": partial,
        "consumption_duplicates": consumed["duplicates"],
        "consumption_matches_trainer": consumed["keys"] == got.at.keys(),
        "steps_acknowledged": sum(acks.acked.values()),
        "steady_steps_per_s": round(rate, 1),
        "mean_steps_per_s": round(sum(acks.acked.values()) / (acks.finished - acks.started), 1),
        "load_s": round(t1 - t0, 2),
        "drain_s": round(drained, 2),
        "warmup_s": round(warm_s, 2),
        "statuses": {str(k): v for k, v in sorted(acks.statuses.items())},
        "client_errors": dict(acks.errors),
        "retries": acks.retries,
        ("materializer_cores" if path == "live" else "daemon_cores"): cores["builder"],
        "builder_peak_rss_gib": builder_rss,
        "gateway_cores": cores["gateway"],
        "trainer_cores": cores["trainer"],
        "breakdown": split,
        "trainer": {
            "batches": len(got.batches),
            "call_p50_s": seconds_summary(calls)["p50_s"],
            **got.summary,
            "exit_code": trainer_code,
        },
        "exit_codes": codes,
        "log_problems": problems,
    }
    if rounds is not None:
        result["materializer_rounds"] = rounds[0] if len(rounds) == 1 else rounds
        result["shards"] = shards
    return result


def verdict(live: dict, rate: float) -> bool:
    """Whether the live path met every target."""
    return (
        live["p50_s"] is not None
        and live["p50_s"] <= TARGET_P50_S
        and live["p99_s"] <= TARGET_P99_S
        and live["acknowledged_groups"] > 0
        and live["missing"] == 0
        and live["duplicates"] == 0
        and live["consumption_duplicates"] == 0
        and live["consumption_matches_trainer"]
        and live["materializer_cores"] <= TARGET_CORES
        and live["steady_steps_per_s"] >= RATE_TOLERANCE * rate
    )


def main() -> None:
    args = arguments().parse_args()
    run(args)


def arguments() -> argparse.ArgumentParser:
    """The benchmark's options (benchmarks/shards.py takes their defaults)."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="live path: load window")
    parser.add_argument("--dagster-seconds", type=float, default=45.0, help="0 skips it")
    parser.add_argument("--rate", type=float, default=200.0, help="steps per second posted")
    parser.add_argument("--turn-gap", type=float, default=1.0, help="s between turns")
    parser.add_argument("--drain", type=float, default=30.0, help="live: s to wait after load")
    parser.add_argument("--dagster-drain", type=float, default=180.0)
    parser.add_argument("--warmup-timeout", type=float, default=300.0)
    parser.add_argument("--flush-ms", type=int, default=1000, help="CLAW_FLUSH_INTERVAL_MS")
    parser.add_argument("--poll-s", type=float, default=0.2, help="materializer --poll-s")
    parser.add_argument("--trainer-groups", type=int, default=1, help="next_batch(groups=)")
    parser.add_argument(
        "--trainer-max-tokens",
        type=int,
        default=262_144,
        help="next_batch(max_tokens=): every ready group that fits, at least one (an async "
        "trainer's batch); 0: next_batch(groups=--trainer-groups) instead",
    )
    parser.add_argument("--trainer-poll-s", type=float, default=0.05)
    return parser


def run(args: argparse.Namespace) -> None:
    """Both paths, then the JSON line."""
    started = time.monotonic()
    live = measure("live", args.seconds, args.drain, args)
    dagster = None
    if args.dagster_seconds > 0:
        try:
            dagster = measure("dagster_sensors", args.dagster_seconds, args.dagster_drain, args)
        except Exception as exc:  # reported in the JSON, not hidden
            log(f"dagster path failed: {type(exc).__name__}: {exc}")
            dagster = {"p50_s": None, "p99_s": None, "error": f"{type(exc).__name__}: {exc}"}
    theirs = (dagster or {}).get("p50_s")
    emit(
        "freshness",
        target=TARGET,
        target_met=verdict(live, args.rate),
        baseline="dagster_sensors",
        ratio={
            "p50": round(live["p50_s"] / theirs, 4) if theirs and live["p50_s"] else None,
        },
        seconds=args.seconds,
        dagster_seconds=args.dagster_seconds,
        rate_steps_per_s=args.rate,
        groups=live["groups_planned"],
        rollouts_per_group=ROLLOUTS,
        turns=TURNS,
        flush_interval_ms=args.flush_ms,
        materializer_poll_s=args.poll_s,
        trainer_groups_per_batch=None if args.trainer_max_tokens else args.trainer_groups,
        trainer_max_tokens=args.trainer_max_tokens,
        trainer_poll_s=args.trainer_poll_s,
        live=live,
        dagster_sensors=dagster,
        total_s=round(time.monotonic() - started, 1),
    )


if __name__ == "__main__":
    main()

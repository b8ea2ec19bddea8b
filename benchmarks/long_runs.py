"""Benchmark (issue 56): the live follower's memory on large lakes, and storage and take-in
speed on long agentic trajectories.

Memory, for each lake size (default 500,000 and 5,000,000 short steps, `BulkShape()` as
`benchmarks/scale.py`: 8 rollouts x 3 turns a group, 1,000 groups a policy version; every
lake built (1, 2) before any is followed (3, 4), so their followers compare under the same
conditions):
  1. bronze: the bulk lake written straight to bronze (`simulation/bulk.py`);
  2. backlog: the follower `claw materialize --follow` runs (`LiveMaterializer.from_settings`:
     its window and its history in the lake's state folder) takes it all in, in a child process
     (at most `--backlog-versions` bronze versions a round, and the follower's bounds on the
     records and bytes of a round), then the maintenance schedule's pass over
     every table (as scale.py);
  3. follower: `claw materialize --follow` (a child process, `CLAW_FOLLOWER_STATE` set to a
     folder of this lake's, the backlog's too) starts on the caught-up lake; its first round
     (from its start to its first heartbeat), then 5 increments of 20 groups (480 steps), one
     bronze commit each: landed to the round that brought silver and gold up to it (the rounds'
     own seconds as the follower prints them, and the wall time from the commit); its resident
     memory after them (VmRSS); then a burst of 12,800 steps (27 commits of 480 as fast as they
     land) and its peak while taking it in (VmHWM, reset before the burst, and VmRSS sampled
     every 50 ms);
  4. restart: the follower is killed (SIGKILL) and started again on the same lake and state
     folder; 480 new steps land as it starts: seconds from its start to the end of the round
     that brought them into silver and gold.
Targets: steady resident at the largest lake <= 1.25 x at the smallest and <= 1.5 GiB; peak at
the largest <= 3 GiB; median increment at the largest <= 1.5 x at the smallest; restart to a
normal increment at the largest <= 30 s. With `--workdir`, a lake an earlier run left there
(caught up) is followed again as it is: phases 3 and 4 only.

Storage and speed on the agentic shape (`simulation.bulk.AGENTIC`: 8 rollouts x 30 turns a
group, prompts 2-4 k tokens, replies 100-400, tool results 200-1,500, each turn's prompt the
whole history; `--agentic-groups` groups, a bronze commit each): in a child process pinned to
one core, a LiveMaterializer takes the bronze into silver and the agentic dataset (steps/s; as
`claw materialize --follow --dataset agentic` does), running as the bronze lands (its first
round done on the lake before the bronze commits land; `started_cold` beside it: a follower
started on the landed bronze, its start-up timed too; the take-in is timed `--take-in-runs`
times, a new follower each on a copy of the lake with its specs and no bronze: the median,
every run beside it), then the baseline, 3 times (the median): read that bronze and write
its distinct tokens once to a Delta table (each step's new prompt tokens, its reply and its
log-probs). Beside it (`every_spec`, no target: each dataset more
writes the distinct tokens twice more), a copy of that bronze taken into silver and every
spec's dataset (the built-in `default` too). The speed targets are on CPU seconds of that
process (pinned to one core, they are the seconds an idle core would take; the machine may be
shared), wall seconds beside them. Distinct tokens (`simulation.bulk.token_counts`): the tokens no
earlier context of the group held, i.e. each group's prompt once plus every trajectory's
replies and tool results once (the sum over trajectories of the new tokens of each turn; the
rollouts of a group share its prompt); sent tokens: every step's prompt and reply. Bytes on
disk per distinct token: the sizes of the parquet files of each table's current Delta version
(bronze, silver: every silver table, gold dataset, trees), as the follower left them and after
the maintenance pass. Targets: silver <= 4 and gold dataset <= 4 bytes per distinct token;
take-in >= 2,000 steps/s on one core and <= 3 x the baseline's time.

Prints one JSON line (progress on stderr); each target's pass/fail under `targets_met`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit, in_child, status_kib  # noqa: E402

STATE_ENV = "CLAW_FOLLOWER_STATE"
MEMORY_DATASET, AGENTIC_DATASET = "long", "agentic"
GROUP_STEPS = 24  # BulkShape(): 8 rollouts x 3 turns
TARGET_RESIDENT_RATIO = 1.25
TARGET_RESIDENT_GIB = 1.5
TARGET_PEAK_GIB = 3.0
TARGET_INCREMENT_RATIO = 1.5
TARGET_RESTART_S = 30.0
TARGET_BYTES_PER_TOKEN = 4.0
TARGET_STEPS_PER_S = 2_000.0
TARGET_FLOOR_RATIO = 3.0
TARGET = (
    "memory: the follower's steady resident at the largest lake <= 1.25 x at the smallest and "
    "<= 1.5 GiB, its peak during a burst <= 3 GiB, median increment <= 1.5 x the smallest's, "
    "restart to a normal increment <= 30 s; agentic shape: silver and gold dataset <= 4 bytes "
    "per distinct token, take-in >= 2,000 steps/s on one core and <= 3 x reading that bronze "
    "and writing its distinct tokens once"
)
TARGETS = {
    "resident_ratio": TARGET_RESIDENT_RATIO,
    "resident_gib": TARGET_RESIDENT_GIB,
    "peak_gib": TARGET_PEAK_GIB,
    "increment_ratio": TARGET_INCREMENT_RATIO,
    "restart_s": TARGET_RESTART_S,
    "silver_bytes_per_distinct_token": TARGET_BYTES_PER_TOKEN,
    "gold_dataset_bytes_per_distinct_token": TARGET_BYTES_PER_TOKEN,
    "take_in_steps_per_s": TARGET_STEPS_PER_S,
    "take_in_over_baseline": TARGET_FLOOR_RATIO,
}
ROUND = re.compile(r"^(\d+\.\d+) s  ")
SILVER = re.compile(r"silver to bronze v(\d+): \+(\d+) steps")


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[long_runs] {message}", file=sys.stderr, flush=True)


def _spec(name: str):
    """The GRPO dataset both parts build (freshness.py's: complete groups of 8)."""
    from benchmarks.freshness import SPEC

    return SPEC.model_copy(update={"name": name})


def _mib(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


# -- memory: the backlog ----------------------------------------------------------------------


def take_backlog(uri: str, versions: int, out) -> None:
    """Child: a LiveMaterializer until silver and gold hold all of bronze (`versions` bronze
    versions a round), then the maintenance schedule's pass over every table."""
    import resource

    from claw_pipelines.defs.maintenance import maintained_tables
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.materialize import live
    from claw_pipelines.settings import ClawSettings

    live.CATCH_UP_VERSIONS = versions
    lake = Lake(uri)
    started, rounds = time.perf_counter(), 0
    # the follower claw materialize --follow runs (bounded, its history in the state folder)
    follower = live.LiveMaterializer.from_settings(lake, ClawSettings(lake_uri=uri))
    while follower.step().changed:
        rounds += 1
        if rounds % 10 == 0:
            log(f"  backlog: {rounds} rounds, {time.perf_counter() - started:.0f} s")
    follower.close()
    taken = time.perf_counter() - started
    started = time.perf_counter()
    for table in maintained_tables(lake):
        lake.maintain(table)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.put(
        {"take_in_s": round(taken, 1), "rounds": rounds, "peak_rss_mib": round(peak / 1024, 1)}
        | {"maintenance_s": round(time.perf_counter() - started, 1)}
    )


# -- memory: the follower, a `claw materialize --follow` child process --------------------------


@dataclass
class Taken:
    """What the follower's round lines said since `Follower.take` was called."""

    steps: int = 0
    groups: int = 0
    rounds: list[float] = field(default_factory=list)  # each round's own seconds
    lines: list[str] = field(default_factory=list)


class Follower:
    """`claw materialize --follow` on a lake as a child process; its round lines, timed."""

    started_here: ClassVar[list[Follower]] = []  # every one this run started (killed on failure)

    def __init__(self, uri: str, state: Path, log_path: Path) -> None:
        env = os.environ | {"CLAW_LAKE_URI": uri, STATE_ENV: str(state), "PYTHONPATH": str(REPO)}
        env.pop("DAGSTER_HOME", None)  # no Dagster reports: the follower alone
        self.started = time.perf_counter()
        self.stderr = log_path.open("ab")
        command = ["-m", "claw_pipelines.app.cli", "materialize", "--follow", "--poll-s", "0.05"]
        self.proc = subprocess.Popen(
            [sys.executable, *command],
            env=env,
            cwd=REPO,  # this checkout's code
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[tuple[float, str]] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        Follower.started_here.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put((time.perf_counter(), line.rstrip()))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mib(self) -> float | None:
        """Its resident memory now."""
        return _mib(status_kib(self.pid, "VmRSS"))

    def take(self, steps: int, groups: int, timeout: float) -> tuple[float, Taken]:
        """Wait until its round lines added `steps` steps to silver and `groups` groups to the
        memory dataset; (the time of the last such line, what they said)."""
        taken, deadline = Taken(), time.perf_counter() + timeout
        gold = re.compile(rf"\b{MEMORY_DATASET}: \+(\d+) ~\d+ -\d+ groups")
        while taken.steps < steps or taken.groups < groups:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the follower exited with {self.proc.returncode}")
            try:
                at, line = self.lines.get(
                    timeout=max(0.01, min(1.0, deadline - time.perf_counter()))
                )
            except queue.Empty:
                if time.perf_counter() > deadline:
                    said = taken.lines[-5:]
                    raise TimeoutError(
                        f"follower: {taken.steps} steps, {taken.groups} groups "
                        f"after {timeout} s; it said {said}"
                    ) from None
                continue
            taken.lines.append(line)
            if (found := SILVER.search(line)) is not None:
                taken.steps += int(found.group(2))
            if (found := gold.search(line)) is not None:
                taken.groups += int(found.group(1))
            if (found := ROUND.match(line)) is not None:
                taken.rounds.append(float(found.group(1)))
        return at, taken

    def kill(self) -> None:
        """SIGKILL, as an OOM killer or a lost node would."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.stderr.close()

    def stop(self) -> None:
        """SIGTERM (the follower finishes its round), SIGKILL after 60 s."""
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()


def wait_first_round(lake, follower: Follower, timeout: float = 1_800.0) -> float:
    """Seconds from the follower's start to its first heartbeat (its first round: a
    restarted follower loads what it keeps between rounds)."""
    import json

    from claw_pipelines.materialize.live import HEARTBEAT

    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if follower.proc.poll() is not None:
            raise RuntimeError(f"the follower exited with {follower.proc.returncode}")
        try:
            beat = json.loads(lake.read_text(HEARTBEAT) or "{}")
        except ValueError:
            beat = {}
        if beat.get("pid") == follower.pid:
            return time.perf_counter() - follower.started
        time.sleep(0.05)
    raise TimeoutError("no heartbeat from the follower")


class Lander:
    """New GRPO groups landed in bronze, numbered after the lake's (one commit a call)."""

    def __init__(self, uri: str, bulk_steps: int, seed: int) -> None:
        import numpy as np
        import polars as pl

        from claw_pipelines.contracts.tables import SILVER_TRAJECTORIES
        from claw_pipelines.lake.delta import Lake
        from claw_pipelines.simulation.bulk import BulkShape

        self.lake, self.shape = Lake(uri), BulkShape()
        self.rng = np.random.default_rng(seed)
        # the lake's groups are 0 .. this - 1 (a kept lake's earlier runs landed more)
        held = self.lake.scan(SILVER_TRAJECTORIES).select(pl.len()).collect().item()
        self.group = max(-(-bulk_steps // GROUP_STEPS), held // self.shape.rollouts)
        self.seq = 50_000_000 + seed * 1_000_000 + self.group

    def land(self, groups: int) -> int:
        """Append `groups` new groups (and their rewards) in one commit; its version."""
        from claw_pipelines.contracts.tables import BRONZE_EVENTS
        from claw_pipelines.simulation.bulk import bronze_batch, group_rows

        new = range(self.group, self.group + groups)
        rows = [row for g in new for row in group_rows(g, self.shape, self.rng)]
        self.group, self.seq = self.group + groups, self.seq + 1
        self.lake.append(BRONZE_EVENTS, bronze_batch(rows, self.seq, self.rng))
        return self.lake.version(BRONZE_EVENTS)


def reset_peak(pid: int) -> bool:
    """Start a process's VmHWM afresh from its current RSS (5 to its clear_refs)."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def sample_rss(pid: int, stop: threading.Event, every_s: float = 0.05) -> list[int]:
    """VmRSS (KiB) of `pid` every `every_s` until `stop` (a thread fills the list it returns)."""
    found: list[int] = []

    def sample() -> None:
        while not stop.is_set():
            kib = status_kib(pid, "VmRSS")
            if kib is not None:
                found.append(kib)
            stop.wait(every_s)

    threading.Thread(target=sample, daemon=True).start()
    return found


def follow_lake(uri: str, steps: int, state: Path, workdir: Path, args) -> dict:
    """Phases 3 and 4 on a caught-up lake: the follower's increments, resident memory, the
    burst and its peak; then SIGKILL and the restart to a normal increment."""
    from claw_pipelines.lake.delta import Lake

    lake, lander = Lake(uri), Lander(uri, steps, seed=11)
    per_increment = args.groups * GROUP_STEPS
    follower = Follower(uri, state, workdir / f"follower-{steps}.log")
    result: dict = {"first_round_s": round(wait_first_round(lake, follower), 2)}
    result["rss_after_first_round_mib"] = follower.rss_mib()
    log(f"{steps:,}: follower's first round {result['first_round_s']} s")
    walls, rounds = [], []
    for _ in range(args.increments):
        lander.land(args.groups)
        landed = time.perf_counter()
        at, taken = follower.take(per_increment, args.groups, timeout=600.0)
        walls.append(at - landed)
        rounds.append(sum(taken.rounds))
        time.sleep(0.5)
    time.sleep(2.0)  # what it holds between rounds, not within one
    result |= {
        "increment_s": [round(s, 3) for s in rounds],
        "increment_median_s": round(statistics.median(rounds), 3),
        "increment_wall_s": [round(s, 3) for s in walls],
        "increment_wall_median_s": round(statistics.median(walls), 3),
        "resident_mib": follower.rss_mib(),
        "peak_before_burst_mib": _mib(status_kib(follower.pid, "VmHWM")),
    }
    log(f"{steps:,}: increments {result['increment_s']} s, resident {result['resident_mib']} MiB")

    burst_groups = -(-args.burst_steps // GROUP_STEPS)
    commits = -(-burst_groups // args.groups)
    result["hwm_reset"] = reset_peak(follower.pid)
    stop = threading.Event()
    samples = sample_rss(follower.pid, stop)
    began = time.perf_counter()
    left = burst_groups
    for _ in range(commits):
        lander.land(min(args.groups, left))
        left -= args.groups
    at, taken = follower.take(burst_groups * GROUP_STEPS, burst_groups, timeout=1_800.0)
    stop.set()
    hwm = status_kib(follower.pid, "VmHWM")
    peak = max([hwm or 0, *samples]) if result["hwm_reset"] else max(samples, default=0)
    result |= {
        "burst_steps": burst_groups * GROUP_STEPS,
        "burst_commits": commits,
        "burst_take_in_s": round(at - began, 2),
        "burst_rounds": len(taken.rounds),
        "peak_mib": _mib(peak),
        "peak_sampled_mib": _mib(max(samples, default=0)),
        "resident_after_burst_mib": follower.rss_mib(),
    }
    log(f"{steps:,}: burst {result['burst_take_in_s']} s, peak {result['peak_mib']} MiB")
    follower.kill()

    restarted = Follower(uri, state, workdir / f"follower-{steps}.log")
    lander.land(args.groups)  # lands while the new process starts
    at, taken = restarted.take(per_increment, args.groups, timeout=1_800.0)
    result |= {
        "restart_s": round(at - restarted.started, 2),
        "restart_rounds_s": taken.rounds,
        "restart_rss_mib": restarted.rss_mib(),
    }
    log(f"{steps:,}: restart to a normal increment {result['restart_s']} s")
    restarted.stop()
    return result


def build_memory_lake(steps: int, workdir: Path, args) -> dict:
    """Phases 1 and 2 of one lake size (bronze, the backlog taken in), each timed; a kept
    lake (--workdir, caught up by an earlier run) as it is."""
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.lake.specs import save_spec
    from claw_pipelines.simulation.bulk import BulkShape, write_bulk_bronze

    uri, state = str(workdir / f"lake-{steps}"), workdir / f"state-{steps}"
    state.mkdir(parents=True, exist_ok=True)
    phases: dict = {}
    lake = Lake(uri)
    result: dict = {"steps": steps, "phases": phases}
    if Path(uri, "silver").exists():  # a kept lake (--workdir), caught up by an earlier run
        result["kept_lake"] = True
        log(f"{steps:,}: a kept lake")
        return result
    started = time.perf_counter()
    result["records"] = write_bulk_bronze(lake, steps, BulkShape(), batch=5_000, seed=7)
    save_spec(lake, _spec(MEMORY_DATASET))
    phases["bronze_s"] = round(time.perf_counter() - started, 1)
    log(f"{steps:,}: bronze written ({phases['bronze_s']} s); backlog")
    started = time.perf_counter()
    env = {STATE_ENV: str(state)}
    result["backlog"] = in_child(take_backlog, uri, args.backlog_versions, env=env)
    phases["backlog_s"] = round(time.perf_counter() - started, 1)
    log(f"{steps:,}: backlog taken in: {result['backlog']}")
    return result


def follow_memory_lake(built: dict, workdir: Path, args) -> dict:
    """Phases 3 and 4 of a built lake, timed (the lake removed after, unless kept)."""
    steps = built["steps"]
    uri, state = str(workdir / f"lake-{steps}"), workdir / f"state-{steps}"
    started = time.perf_counter()
    result = built | follow_lake(uri, steps, state, workdir, args)
    result["phases"]["follower_s"] = round(time.perf_counter() - started, 1)
    if not args.workdir:  # the lake is not needed again: free the disk
        shutil.rmtree(uri, ignore_errors=True)
    return result


# -- storage and speed on the agentic shape ---------------------------------------------------


def table_bytes(lake, name: str) -> int:
    """The sizes of the parquet files of a table's current Delta version."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not lake.exists(name):
        return 0
    actions = pa.table(lake.open(name).get_add_actions(flatten=True))
    return int(pc.sum(actions["size_bytes"]).as_py() or 0)


def storage_of(lake, dataset: str, distinct: int) -> dict:
    """Bytes and bytes per distinct token of bronze, silver (each table and all), gold."""
    from claw_pipelines.contracts.tables import (
        BRONZE_EVENTS,
        SILVER_TABLES,
        gold_dataset_table,
        gold_rejection_table,
        gold_tree_table,
    )

    tables = {"bronze": BRONZE_EVENTS} | {t: t for t in SILVER_TABLES}
    tables |= {
        "gold_dataset": gold_dataset_table(dataset),
        "trees": gold_tree_table(dataset),
        "gold_rejections": gold_rejection_table(dataset),
    }
    sizes = {key: table_bytes(lake, name) for key, name in tables.items()}
    sizes["silver"] = sum(sizes[t] for t in SILVER_TABLES)
    return {
        "bytes": sizes,
        "bytes_per_distinct_token": {k: round(v / distinct, 3) for k, v in sizes.items()},
    }


def floor_write(lake, target: str) -> dict:
    """The baseline: read bronze's steps and write their distinct tokens once to a Delta table
    (each step's prompt tokens beyond its trajectory's previous prompt and reply, the group's
    prompt once, its reply and log-probs)."""
    import polars as pl
    from deltalake import write_deltalake

    from claw_pipelines.contracts.tables import BRONZE_EVENTS

    started, cpu = time.perf_counter(), _cpu_s()
    columns = ["kind", "trajectory_uid", "prompt_uid", "step_index"]
    columns += ["prompt_ids", "response_ids", "rollout_log_probs"]
    read = lake.open(BRONZE_EVENTS).to_pyarrow_table(columns=columns)  # the fastest read here
    steps = pl.DataFrame(read).filter(pl.col("kind") == "step")
    steps = steps.sort("trajectory_uid", "step_index")
    prompt, reply = pl.col("prompt_ids").list.len(), pl.col("response_ids").list.len()
    seen = (prompt + reply).shift(1).over("trajectory_uid")
    group_first = pl.col("trajectory_uid") == pl.col("trajectory_uid").min().over("prompt_uid")
    offset = pl.when(pl.col("step_index") > 0).then(seen)
    offset = offset.when(group_first).then(0).otherwise(prompt)
    rows = steps.select(
        "trajectory_uid",
        "step_index",
        pl.col("prompt_ids").list.slice(offset.cast(pl.Int64)).alias("new_prompt_ids"),
        "response_ids",
        "rollout_log_probs",
    )
    write_deltalake(target, rows.to_arrow(), mode="overwrite")
    seconds, used = time.perf_counter() - started, _cpu_s() - cpu
    tokens = rows.select(
        pl.col("new_prompt_ids").list.len().sum() + pl.col("response_ids").list.len().sum()
    ).item()
    return {"seconds": round(seconds, 3), "cpu_s": round(used, 3), "tokens": int(tokens)}


def _cpu_s() -> float:
    """This process's user + system CPU seconds so far (every thread)."""
    import resource

    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def agentic_child(
    uri: str,
    staged: str | None,
    floor_uri: str | None,
    cpu: int,
    steps: int,
    distinct: int,
    runs: int,
    datasets: list[str] | None,
    out,
) -> None:
    """Child, pinned to one core: the follower (as `claw materialize --follow [--dataset
    ...]` runs it, its history in the state folder) takes the agentic bronze into silver and
    `datasets` (None: every spec's). With `staged` (a lake holding that bronze), the follower
    is running when it lands: started on `uri` (its specs, no bronze), its first round done,
    then `staged`'s bronze commits land on `uri` one by one (as the gateways would), then the
    clock starts; without, it starts on `uri` with the bronze there (start-up timed too).
    With `floor_uri`: storage as it left it and after maintenance, then the baseline on the
    same bronze (`runs` times)."""
    os.sched_setaffinity(0, {cpu})
    import resource

    # what a follower that has run a while has loaded (pyarrow imports pandas on its first
    # conversion of Python values, 0.25 s once a process; the baseline runs after it here)
    import pandas  # noqa: F401

    from claw_pipelines.contracts.tables import BRONZE_EVENTS
    from claw_pipelines.defs.maintenance import maintained_tables
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.materialize.live import LiveMaterializer
    from claw_pipelines.settings import ClawSettings

    lake = Lake(uri)
    follower = None
    if staged is not None:
        follower = LiveMaterializer.from_settings(lake, ClawSettings(lake_uri=uri), datasets)
        follower.step()
        source = Lake(staged)
        for version in range(1, (source.version(BRONZE_EVENTS) or 0) + 1):
            lake.append(BRONZE_EVENTS, source.appended(BRONZE_EVENTS, version - 1, version))
    started, cpu_before, rounds = time.perf_counter(), _cpu_s(), 0
    if follower is None:
        follower = LiveMaterializer.from_settings(lake, ClawSettings(lake_uri=uri), datasets)
    while follower.step().changed:
        rounds += 1
    follower.close()
    seconds, used = time.perf_counter() - started, _cpu_s() - cpu_before
    result = {
        "datasets": datasets or "every spec",
        "follower": "running as the bronze lands" if staged else "started on the landed bronze",
        "take_in_s": round(seconds, 3),
        "take_in_cpu_s": round(used, 3),
        "take_in_rounds": rounds,
        "take_in_steps_per_s": round(steps / seconds, 1),
        "take_in_steps_per_cpu_s": round(steps / used, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if floor_uri is None:
        out.put(result)
        return
    result["storage"] = storage_of(lake, AGENTIC_DATASET, distinct)
    began = time.perf_counter()
    for table in maintained_tables(lake):
        lake.maintain(table)
    result["maintenance_s"] = round(time.perf_counter() - began, 2)
    result["storage_maintained"] = storage_of(lake, AGENTIC_DATASET, distinct)
    floors = [floor_write(lake, floor_uri) for _ in range(runs)]
    assert all(f["tokens"] == distinct for f in floors), (floors, distinct)
    floor_bytes = table_bytes(Lake(str(Path(floor_uri).parent)), Path(floor_uri).name)
    result["baseline"] = {
        "seconds": statistics.median(f["seconds"] for f in floors),
        "cpu_s": statistics.median(f["cpu_s"] for f in floors),
        "runs_s": [f["seconds"] for f in floors],
        "runs_cpu_s": [f["cpu_s"] for f in floors],
        "tokens": distinct,
        "bytes": floor_bytes,
        "bytes_per_distinct_token": round(floor_bytes / distinct, 3),
    }
    out.put(result)


def agentic(workdir: Path, groups: int, runs: int, take_in_runs: int) -> dict:
    """The agentic shape's storage and take-in speed (the median of `take_in_runs` followers),
    and the baseline, each timed."""
    from claw_pipelines.contracts.tables import BRONZE_EVENTS
    from claw_pipelines.lake.delta import Lake
    from claw_pipelines.lake.specs import save_spec
    from claw_pipelines.simulation.bulk import AGENTIC, bulk_batches, token_counts

    staged, uri = str(workdir / "agentic-bronze"), str(workdir / "agentic")
    every, cold = str(workdir / "agentic-every-spec"), str(workdir / "agentic-cold")
    built = ("agentic-bronze", "agentic", "agentic-every-spec", "agentic-cold", "floor")
    for folder in (*built, *(f"{b}-state" for b in built)):  # a kept workdir's: built again
        shutil.rmtree(workdir / folder, ignore_errors=True)
    lake = Lake(staged)
    per_group = AGENTIC.rollouts * AGENTIC.turns
    started, sent, distinct = time.perf_counter(), 0, 0
    records = per_group + AGENTIC.rollouts  # a commit a group, as the gateway's flushes
    for table in bulk_batches(groups * per_group, AGENTIC, records, seed=7):
        lake.append(BRONZE_EVENTS, table)
        counted = token_counts(table)
        sent, distinct = sent + counted[0], distinct + counted[1]
    save_spec(lake, _spec(AGENTIC_DATASET))
    written = time.perf_counter() - started
    steps = groups * per_group
    log(f"agentic: {steps:,} steps, {sent:,} tokens sent, {distinct:,} distinct ({written:.1f} s)")
    shutil.copytree(staged, cold)
    for folder in (uri, every):  # its specs, no bronze: the bronze lands as the follower runs
        shutil.copytree(Path(staged) / "specs", Path(folder) / "specs")
    cpu, only = max(os.sched_getaffinity(0)), [AGENTIC_DATASET]

    def child(lake: str, warm: bool, floor: str | None, datasets: list[str] | None) -> dict:
        state = {STATE_ENV: f"{lake}-state"}
        source = staged if warm else None
        args = (lake, source, floor, cpu, steps, distinct, runs, datasets)
        return in_child(agentic_child, *args, env=state)

    every_spec = child(every, True, None, None)
    log(f"agentic, every spec's dataset: {every_spec}")
    started_cold = child(cold, False, None, only)
    log(f"agentic, the follower started on the landed bronze: {started_cold}")
    result = child(uri, True, str(workdir / "floor" / "tokens"), only)
    takes = [result]  # the take-in again, each time a new follower on a copy with no bronze
    for run in range(1, take_in_runs):
        again = str(workdir / f"agentic-again-{run}")
        shutil.rmtree(again, ignore_errors=True)
        shutil.rmtree(f"{again}-state", ignore_errors=True)
        shutil.copytree(Path(staged) / "specs", Path(again) / "specs")
        takes.append(child(again, True, None, only))
        shutil.rmtree(again, ignore_errors=True)
    result["take_in_runs_cpu_s"] = [t["take_in_cpu_s"] for t in takes]
    result["take_in_runs_s"] = [t["take_in_s"] for t in takes]
    result["take_in_cpu_s"] = round(statistics.median(result["take_in_runs_cpu_s"]), 3)
    result["take_in_s"] = round(statistics.median(result["take_in_runs_s"]), 3)
    result["take_in_steps_per_s"] = round(steps / result["take_in_s"], 1)
    result["take_in_steps_per_cpu_s"] = round(steps / result["take_in_cpu_s"], 1)
    for other in (every_spec, started_cold):
        other["take_in_over_baseline"] = round(
            other["take_in_cpu_s"] / result["baseline"]["cpu_s"], 2
        )
    result |= {
        "every_spec": every_spec,
        "started_cold": started_cold,
        "groups": groups,
        "steps": steps,
        "sent_tokens": sent,
        "distinct_tokens": distinct,
        "tokens_per_step": round(sent / steps),
        "bronze_s": round(written, 2),
        "cpu": cpu,
        "take_in_over_baseline": round(result["take_in_cpu_s"] / result["baseline"]["cpu_s"], 2),
        "take_in_over_baseline_wall": round(result["take_in_s"] / result["baseline"]["seconds"], 2),
    }
    log(f"agentic: {result}")
    return result


@contextlib.contextmanager
def _followers_killed():
    """Kill every follower this run started that still runs (a phase that raised)."""
    try:
        yield
    finally:
        for follower in Follower.started_here:
            if follower.proc.poll() is None:
                follower.proc.kill()
                follower.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="500000,5000000", help="lake sizes, in steps")
    parser.add_argument("--increments", type=int, default=5)
    parser.add_argument("--groups", type=int, default=20, help="groups (24 steps) an increment")
    parser.add_argument("--burst-steps", type=int, default=12_800)
    parser.add_argument(
        "--backlog-versions", type=int, default=64, help="bronze versions a backlog round takes"
    )
    parser.add_argument("--agentic-groups", type=int, default=6)
    parser.add_argument("--baseline-runs", type=int, default=3, help="the baseline's (median)")
    parser.add_argument(
        "--take-in-runs", type=int, default=3, help="followers taking the bronze in (median)"
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-storage", action="store_true")
    parser.add_argument(
        "--workdir", help="keep the lakes here (a kept caught-up lake is followed again as it is)"
    )
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))

    figures: dict = {}
    met: dict[str, bool] = {}
    ratio: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="claw-bench-long-") as tmp, _followers_killed():
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.skip_storage:
            started = time.perf_counter()
            found = agentic(workdir, args.agentic_groups, args.baseline_runs, args.take_in_runs)
            found["phase_s"] = round(time.perf_counter() - started, 1)
            per_token = found["storage"]["bytes_per_distinct_token"]
            met |= {
                "silver_bytes_per_distinct_token": per_token["silver"] <= TARGET_BYTES_PER_TOKEN,
                "gold_dataset_bytes_per_distinct_token": per_token["gold_dataset"]
                <= TARGET_BYTES_PER_TOKEN,
                "take_in_steps_per_s": found["take_in_steps_per_cpu_s"] >= TARGET_STEPS_PER_S,
                "take_in_over_baseline": found["take_in_over_baseline"] <= TARGET_FLOOR_RATIO,
            }
            figures["agentic"] = found
            ratio["take_in_over_baseline"] = found["take_in_over_baseline"]
        if not args.skip_memory:
            # every lake built first, then each followed: the followers' increments compare
            # under the same conditions (a large backlog's take-in evicts the page cache)
            built = [build_memory_lake(steps, workdir, args) for steps in sizes]
            lakes = {str(b["steps"]): follow_memory_lake(b, workdir, args) for b in built}
            small, large = lakes[str(sizes[0])], lakes[str(sizes[-1])]
            resident_ratio = large["resident_mib"] / small["resident_mib"]
            increments = round(large["increment_median_s"] / small["increment_median_s"], 3)
            ratio["increment"] = increments
            met |= {
                "resident_ratio": resident_ratio <= TARGET_RESIDENT_RATIO,
                "resident_gib": large["resident_mib"] / 1024 <= TARGET_RESIDENT_GIB,
                "peak_gib": large["peak_mib"] / 1024 <= TARGET_PEAK_GIB,
                "increment_ratio": increments <= TARGET_INCREMENT_RATIO,
                "restart_s": large["restart_s"] <= TARGET_RESTART_S,
            }
            figures |= {
                "lakes": lakes,
                "resident_ratio": round(resident_ratio, 3),
                "increment_ratio": increments,
                "resident_gib": round(large["resident_mib"] / 1024, 3),
                "peak_gib": round(large["peak_mib"] / 1024, 3),
                "restart_s": large["restart_s"],
            }
    emit(
        "long_runs",
        target=TARGET,
        targets=TARGETS,
        target_met=bool(met) and all(met.values()),
        baseline={
            "memory": None if args.skip_memory else f"lakes.{sizes[0]}",
            "speed": None if args.skip_storage else "agentic.baseline.cpu_s",
        },
        ratio=ratio or None,
        targets_met=met,
        **figures,
    )


if __name__ == "__main__":
    main()

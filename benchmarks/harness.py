"""What every benchmark shares: the one JSON line and its fixed keys, a process's CPU and memory
read from /proc, percentiles, and the paced load of GRPO groups (freshness, recovery, scale).

The JSON line (`emit`), one per run on stdout, progress on stderr:

    benchmark    the script's name
    target       the target in words (a string)
    targets      the target's thresholds by figure (a dict), where it has several
    target_met   whether this run met the target (a bool)
    baseline     the same run's baseline: its figure(s), or the name of the key holding them
                 (None when the benchmark compares against a bound instead of a baseline)
    ratio        the run against its baseline (None when there is none)
    measured_at  UTC, ISO 8601
    ...          the benchmark's own figures, at the top level
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import queue
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

FIXED_KEYS = ("benchmark", "target", "targets", "target_met", "baseline", "ratio", "measured_at")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- the JSON line --------------------------------------------------------------------------


def result_line(
    benchmark: str,
    *,
    target: str,
    target_met: bool,
    baseline: Any,
    ratio: Any,
    targets: dict | None = None,
    measured_at: str | None = None,
    **figures: Any,
) -> dict:
    """The benchmark's result: the fixed keys first, then its figures (none may reuse one)."""
    if not isinstance(target, str):
        raise TypeError(f"{benchmark}: target is the target in words, got {target!r}")
    clash = set(figures) & set(FIXED_KEYS)
    if clash:
        raise ValueError(f"{benchmark}: figures named like fixed keys: {sorted(clash)}")
    line = {
        "benchmark": benchmark,
        "target": target,
        "targets": targets,
        "target_met": bool(target_met),
        "baseline": baseline,
        "ratio": ratio,
        "measured_at": measured_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return line | figures


RECORD_ENV = "CLAW_BENCH_RECORD"  # a folder: every run's line is appended to <benchmark>.jsonl


def emit(benchmark: str, **fields: Any) -> dict:
    """Print the one JSON line (see `result_line`) and return it; with `CLAW_BENCH_RECORD`
    set (`make bench` sets it to `benchmarks/results`), also append it to that folder's
    `<benchmark>.jsonl`: every run kept, the docs include their figures from there."""
    line = result_line(benchmark, **fields)
    print(json.dumps(line), flush=True)
    folder = os.environ.get(RECORD_ENV)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with (Path(folder) / f"{benchmark}.jsonl").open("a") as record:
            record.write(json.dumps(line) + "\n")
    return line


# -- processes (Linux /proc) -----------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (field 3 onwards)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_s(pid: int, reaped_children: bool = False) -> float:
    """User + system CPU seconds of a process so far; with `reaped_children`, its waited-for
    children's too."""
    fields = _stat_fields(pid)
    used = (11, 12, 13, 14) if reaped_children else (11, 12)  # utime stime [cutime cstime]
    return sum(int(fields[i]) for i in used) / CLOCK_TICKS


def children_cpu_s(pid: int) -> float:
    """CPU seconds so far of a process's live children (a gateway's syncer and flusher)."""
    found = Path(f"/proc/{pid}/task/{pid}/children")
    kids = found.read_text().split() if found.exists() else []
    total = 0.0
    for kid in kids:
        try:
            total += cpu_s(int(kid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def _parent_and_cpu(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its reaped children), None once gone."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return None
    return int(fields[1]), sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children, their children, ...)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _parent_and_cpu(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def tree_cpu_s(pid: int) -> float:
    """CPU seconds used by `pid` and all its descendants so far."""
    return sum(
        stat[1] for p in [pid, *descendants(pid)] if (stat := _parent_and_cpu(p)) is not None
    )


def started_at(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        return _stat_fields(pid)[19]
    except (OSError, IndexError):
        return None


def status_kib(pid: int | str, field_name: str) -> int | None:
    """A /proc/<pid>/status memory field (VmRSS, VmHWM: the peak) in KiB; None if absent."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return None


def reset_peak_rss() -> None:
    """Start this process's VmHWM afresh from its current RSS (Linux: 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


# -- percentiles -----------------------------------------------------------------------------


def percentiles(
    values, points: tuple[int, ...] = (50, 99), digits: int = 3, empty: float | None = None
) -> dict[str, float | None]:
    """{"p50": ..., "p99": ...} of `values`, rounded to `digits` (`empty` each when none)."""
    if not len(values):
        return {f"p{p}": empty for p in points}
    found = np.percentile(values, list(points))
    return {f"p{p}": round(float(v), digits) for p, v in zip(points, found, strict=True)}


def seconds_summary(values: list[float]) -> dict:
    """p50/p90/p99/max/mean in seconds (None when empty)."""
    if not values:
        return {"p50_s": None, "p90_s": None, "p99_s": None, "max_s": None, "mean_s": None}
    found = percentiles(values, (50, 90, 99))
    return {f"{k}_s": v for k, v in found.items()} | {
        "max_s": round(float(max(values)), 3),
        "mean_s": round(float(np.mean(values)), 3),
    }


# -- the paced load: GRPO groups posted one step per request, by the clock --------------------

ROLLOUTS, TURNS = 8, 3
STEPS_PER_GROUP = ROLLOUTS * TURNS
VOCAB = 150_000


@dataclass
class Plan:
    """Every step to post: (due offset in s, group, body), in due order; each group's ids."""

    sends: list[tuple[float, str, bytes]]
    event_ids: dict[str, list[str]]
    ramp_s: float  # the first and last this many seconds are ramps, not steady load


def group_steps(rng: np.random.Generator, group: str, policy_version: int = 1) -> list[list[dict]]:
    """One GRPO group: 8 rollouts of one shared prompt, 3 turns each; turn t+1's prompt is
    turn t's prompt + response + a tool answer; the last turn ends it with a reward."""
    prompt = rng.integers(1, VOCAB, int(rng.integers(150, 250))).tolist()
    rollouts = []
    for r in range(ROLLOUTS):
        history, turns = prompt, []
        for turn in range(TURNS):
            response = rng.integers(1, VOCAB, int(rng.integers(40, 120)))
            last = turn == TURNS - 1
            step = {
                "event_id": uuid.uuid4().hex,
                "trajectory_uid": f"{group}-r{r}",
                "prompt_uid": group,
                "step_index": turn,
                "prompt_ids": history,
                "response_ids": response.tolist(),
                "rollout_log_probs": np.round(-rng.random(len(response)) * 4, 4).tolist(),
                "policy_version": policy_version,
                "is_last": last,
            }
            if last:
                step["reward"] = round(float(rng.random()), 3)
            turns.append(step)
            tool = rng.integers(1, VOCAB, int(rng.integers(10, 30))).tolist()
            history = [*history, *step["response_ids"], *tool]
        rollouts.append(turns)
    return rollouts


def plan_load(
    seconds: float,
    rate: float,
    turn_gap: float,
    seed: int,
    prefix: str = "",
    policy_version: int = 1,
) -> Plan:
    """A new group every 24/rate s for `seconds`; turn t of each rollout due t x turn_gap
    (plus up to half a gap of jitter) after its group starts: the rollouts of ~2.5 x
    turn_gap x rate / 24 groups interleave, at `rate` steps/s once the ramp is over."""
    rng = np.random.default_rng(seed)
    interval = STEPS_PER_GROUP / rate
    sends, event_ids = [], {}
    for g in range(max(1, int(seconds / interval))):
        group, start = f"{prefix}g{g:05d}", g * interval
        rollouts = group_steps(rng, group, policy_version)
        event_ids[group] = [s["event_id"] for turns in rollouts for s in turns]
        for turns in rollouts:
            for turn, step in enumerate(turns):
                due = start + turn * turn_gap + float(rng.uniform(0, turn_gap / 2))
                sends.append((due, group, json.dumps({"steps": [step]}).encode()))
    sends.sort(key=lambda send: send[0])
    return Plan(sends, event_ids, ramp_s=TURNS * turn_gap)


@dataclass
class Acks:
    """What the agents sent and when each group's steps were acknowledged (200)."""

    posted: int = 0
    acked: Counter = field(default_factory=Counter)  # group -> steps acknowledged
    last_ack: dict[str, float] = field(default_factory=dict)  # group -> time.time()
    ack_times: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    retries: int = 0
    started: float = 0.0
    finished: float = 0.0

    def complete_groups(self) -> set[str]:
        """Groups whose every step was acknowledged."""
        return {g for g, n in self.acked.items() if n == STEPS_PER_GROUP}


async def _post(client: httpx.AsyncClient, url: str, group: str, body: bytes, acks: Acks) -> None:
    """Post one step; retry (same event_id) on 429/503/transport errors; record the ack."""
    for attempt in range(6):
        try:
            answer = await client.post(url, content=body)
        except httpx.HTTPError as exc:
            acks.errors[type(exc).__name__] += 1
        else:
            acks.statuses[answer.status_code] += 1
            if answer.status_code == 200:
                now = time.time()
                acks.acked[group] += 1
                acks.last_ack[group] = max(acks.last_ack.get(group, 0.0), now)
                acks.ack_times.append(now)
                return
            if answer.status_code not in (429, 503):
                return
        acks.retries += 1
        await asyncio.sleep(0.1 * 2**attempt)


async def _paced(url: str, plan: Plan, acks: Acks) -> None:
    """Post every step of the plan at its due time by the clock; await the last answers."""
    pending: set[asyncio.Task] = set()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(timeout=60.0, headers=headers) as client:
        started = time.monotonic()
        acks.started = time.time()
        for due, group, body in plan.sends:
            await asyncio.sleep(max(0.0, started + due - time.monotonic()))
            task = asyncio.create_task(_post(client, url + "/v1/steps", group, body, acks))
            pending.add(task)
            task.add_done_callback(pending.discard)
            acks.posted += 1
        await asyncio.gather(*pending)
    acks.finished = time.time()


def start_load(url: str, plan: Plan) -> tuple[threading.Thread, Acks]:
    """The paced agents on their own thread (with their own event loop)."""
    acks = Acks()
    thread = threading.Thread(target=asyncio.run, args=(_paced(url, plan, acks),), daemon=True)
    thread.start()
    return thread, acks


def in_child(target, *args, env: dict[str, str] | None = None):
    """Run `target(*args, out)` in a spawned process (with `env` added); what it put on `out`."""
    context = mp.get_context("spawn")
    out = context.Queue()
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})  # a spawned child takes the environment as it starts
    try:
        proc = context.Process(target=target, args=(*args, out))
        proc.start()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    while True:  # a child that dies (an assertion, the OOM killer) must not hang the run
        try:
            result = out.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} exited with {proc.exitcode}") from None
    proc.join()
    return result

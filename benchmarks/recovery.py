"""Benchmark: recovery, from a fault clearing to every dataset current again.

Agents post GRPO groups (8 rollouts x 3 turns, white-box steps) through two `claw gateway`
replicas on one lake; `claw materialize --follow` keeps silver and three datasets up to date
(a live GRPO one, one of every step, the built-in default). Faults are injected one after
the other, each held for --hold seconds while traffic flows, then cleared:

- failing_gold: a torn commit at the head of one dataset's table (a writer that died
  mid-put): every increment of that dataset fails until it is removed;
- bad_spec: a new spec file that does not parse, fixed after the hold;
- killed_materializer: `kill -9` of the materializer, restarted after the hold;
- killed_gateway: `kill -9` of one gateway replica (its agents' posts fail and retry),
  restarted on the same write-ahead log after the hold.

For each: the time from the fault clearing until every dataset is current (the materializer
has brought each spec, as it is now, to a silver run that read bronze as it stood when the
fault cleared), and whether the datasets without a fault stayed current during it. The
baseline, in the same run: the same time measured with no fault. At the end every
acknowledged step must be in silver and in the every-step dataset exactly once.
Targets: every dataset current within 60 s of each fault clearing; 0 lost, 0 duplicated.
Prints one JSON line (progress on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.freshness import SPEC, materializer_service, stop_service  # noqa: E402
from benchmarks.harness import emit, plan_load  # noqa: E402
from claw_pipelines.app.processes import ServiceProcess, free_port  # noqa: E402
from claw_pipelines.contracts.specs import CurationSpec  # noqa: E402
from claw_pipelines.contracts.tables import (  # noqa: E402
    BRONZE_EVENTS,
    SILVER_STEPS,
    gold_dataset_table,
)
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.lake.specs import load_specs, save_spec  # noqa: E402
from claw_pipelines.materialize.live import HEARTBEAT  # noqa: E402
from claw_pipelines.materialize.silver import WATERMARK_TABLE, silver_state  # noqa: E402

TARGET_S = 60.0
TARGET = "every dataset current within 60 s of each fault clearing; 0 lost, 0 duplicated steps"
EVERY = CurationSpec(
    name="every",
    reward_status=["final", "pending", "missing"],
    merge="trajectory",
)
LATE = CurationSpec(name="late", reward_status=["final", "missing"], merge="trajectory")
FAULTS = ("failing_gold", "bad_spec", "killed_materializer", "killed_gateway")


def log(message: str) -> None:
    """Progress on stderr (stdout carries only the JSON line)."""
    print(f"[recovery] {message}", file=sys.stderr, flush=True)


# -- agents -------------------------------------------------------------------------------


@dataclass
class Agents:
    """Paced agents posting one plan to one gateway until stopped; what was acknowledged."""

    url: str
    acked: set[str] = field(default_factory=set)  # step keys acknowledged (200)
    failed: int = 0  # posts given up after their retries (not acknowledged: not counted)
    stop: threading.Event = field(default_factory=threading.Event)

    async def _post(self, client: httpx.AsyncClient, body: bytes, key: str) -> None:
        for attempt in range(6):
            try:
                answer = await client.post(self.url + "/v1/steps", content=body)
            except httpx.HTTPError:
                pass
            else:
                if answer.status_code == 200:
                    self.acked.add(key)
                    return
                if answer.status_code not in (429, 503):
                    break
            await asyncio.sleep(0.1 * 2**attempt)
        self.failed += 1

    async def _run(self, sends: list[tuple[float, bytes, str]]) -> None:
        pending: set[asyncio.Task] = set()
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(timeout=30.0, headers=headers) as client:
            started = time.monotonic()
            for due, body, key in sends:
                if self.stop.is_set():
                    break
                await asyncio.sleep(max(0.0, started + due - time.monotonic()))
                task = asyncio.create_task(self._post(client, body, key))
                pending.add(task)
                task.add_done_callback(pending.discard)
            await asyncio.gather(*pending)

    def start(self, seconds: float, rate: float, seed: int, prefix: str) -> threading.Thread:
        """Post a plan of `seconds` at `rate` steps/s on a thread of its own."""
        plan = plan_load(seconds, rate, 1.0, seed, prefix)
        sends = []
        for due, _, body in plan.sends:
            step = json.loads(body)["steps"][0]
            sends.append((due, body, f"{step['trajectory_uid']}:{step['step_index']}"))
        thread = threading.Thread(target=asyncio.run, args=(self._run(sends),), daemon=True)
        thread.start()
        return thread


# -- the stack ----------------------------------------------------------------------------


def gateway(lake: str, workdir: Path, name: str, port: int | None = None) -> ServiceProcess:
    """A `claw gateway` replica with its own id (so its own write-ahead log) on the lake."""
    env = {"CLAW_LAKE_URI": lake, "CLAW_GATEWAY_ID": name, "CLAW_FLUSH_INTERVAL_MS": "500"}
    return ServiceProcess(
        "gateway",
        workdir / f"{name}.log",
        port=port or free_port(),
        health="/readyz",
        env=env,
        cwd=REPO,
    )


def current(lake: Lake, bronze: int, marker: list[int], skip: set[str] = frozenset()) -> bool:
    """Whether every spec's dataset (but `skip`) stands at a silver run that read bronze
    version `bronze` (`marker` caches that run's marker version once seen)."""
    if not marker:
        state = silver_state(lake)
        if state.bronze_version is None or state.bronze_version < bronze:
            return False
        marker.append(state.versions[WATERMARK_TABLE])
    try:
        brought = json.loads(lake.read_text(HEARTBEAT) or "{}").get("brought", {})
    except (OSError, ValueError):
        return False
    for name, spec in load_specs(lake).items():
        if name in skip:
            continue
        at = brought.get(name)
        if at is None or at["spec_hash"] != spec.spec_hash or (at["marker"] or -1) < marker[0]:
            return False
    return True


def time_to_current(lake: Lake, timeout: float, skip: set[str] = frozenset()) -> float | None:
    """Seconds from now until every dataset (but `skip`) is current with bronze as it is
    now (None: not within `timeout`)."""
    began, bronze, marker = time.monotonic(), lake.version(BRONZE_EVENTS), []
    while time.monotonic() - began < timeout:
        if current(lake, bronze, marker, skip):
            return round(time.monotonic() - began, 2)
        time.sleep(0.2)
    return None


def tear_head(lake_root: Path, table: str) -> Path:
    """Leave a torn commit at the head of `table`'s log: its reads and writes fail."""
    log_dir = lake_root / table / "_delta_log"
    while True:
        head = max(int(p.stem) for p in log_dir.glob("*.json"))
        torn = log_dir / f"{head + 1:020d}.json"
        try:
            with open(torn, "xb") as out:  # never over a commit that just landed
                out.write(b'{"commitInfo": {"timestamp": 1, "operation": "WRITE"')
            return torn
        except FileExistsError:
            continue


def check_exactly_once(lake: Lake, acked: set[str]) -> dict:
    """Acknowledged steps missing from silver and the every-step dataset, and duplicates."""
    steps = lake.read(SILVER_STEPS, columns=["step_key"])["step_key"]
    every = lake.read(gold_dataset_table(EVERY.name), columns=["step_key"])["step_key"]
    return {
        "acked": len(acked),
        "lost_silver": len(acked - set(steps.to_list())),
        "lost_gold": len(acked - set(every.to_list())),
        "duplicated_silver": steps.len() - steps.n_unique(),
        "duplicated_gold": every.len() - every.n_unique(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rate", type=float, default=60.0, help="steps/s over both replicas")
    parser.add_argument("--hold", type=float, default=15.0, help="s each fault lasts")
    parser.add_argument("--timeout", type=float, default=120.0, help="longest wait per fault")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    started = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="claw-recovery-"))
    stack = Stack(workdir)
    budget = args.timeout * (len(FAULTS) + 2) + args.hold * len(FAULTS) + 60
    agents = [Agents(replica.url) for replica in stack.replicas]
    threads = [
        a.start(budget, args.rate / 2, seed, prefix)
        for a, seed, prefix in zip(agents, (1, 2), ("a", "b"), strict=True)
    ]
    faults: dict[str, dict] = {}
    try:
        time.sleep(10)  # the load ramps up
        baseline = time_to_current(stack.lake, args.timeout)
        log(f"no fault: current in {baseline} s")
        for fault in FAULTS:
            hold_until = time.monotonic() + args.hold
            untouched = stack.inject(fault)
            others = None  # the datasets the fault leaves alone: current meanwhile?
            if untouched is not None:
                others = time_to_current(stack.lake, args.hold, skip=untouched)
            time.sleep(max(0.0, hold_until - time.monotonic()))
            stack.clear(fault)
            took = time_to_current(stack.lake, args.timeout)
            faults[fault] = {"current_after_s": took, "others_current_after_s": others}
            log(f"{fault}: current {took} s after it cleared (others during it: {others})")
    finally:
        for a in agents:
            a.stop.set()
        for thread in threads:
            thread.join(60)
    drained = time_to_current(stack.lake, args.timeout)
    acked = set().union(*(a.acked for a in agents))
    exact = check_exactly_once(stack.lake, acked)
    stack.stop()
    took = [f["current_after_s"] for f in faults.values()]
    met = (
        all(t is not None and t <= TARGET_S for t in took)
        and drained is not None
        and not any(v for k, v in exact.items() if k != "acked")
    )
    emit(
        "recovery",
        target=TARGET,
        target_met=met,
        baseline={"no_fault_current_after_s": baseline},
        ratio={
            f: round(v["current_after_s"] / baseline, 2)
            for f, v in faults.items()
            if v["current_after_s"] and baseline
        },
        rate_steps_per_s=args.rate,
        hold_s=args.hold,
        faults=faults,
        drained_after_s=drained,
        exactly_once=exact,
        posts_given_up=sum(a.failed for a in agents),
        total_s=round(time.monotonic() - started, 1),
    )


class Stack:
    """Two gateway replicas and the live materializer on one lake, and the faults."""

    def __init__(self, workdir: Path) -> None:
        self.workdir, self.root = workdir, workdir / "lake"
        self.lake = Lake(str(self.root))
        for spec in (SPEC, EVERY):
            save_spec(self.lake, spec)
        self.replicas = [gateway(str(self.root), workdir, f"gw-{n}").start(60) for n in "ab"]
        self.materializer = materializer_service(str(self.root), workdir, 0.2).start(90)
        self._torn: Path | None = None

    def inject(self, fault: str) -> set[str] | None:
        """Start `fault`; the datasets it stops (None: all of them)."""
        if fault == "failing_gold":
            self._torn = tear_head(self.root, gold_dataset_table(EVERY.name))
            return {EVERY.name}
        if fault == "bad_spec":
            self.lake.write_text(f"specs/{LATE.name}.yaml", "name: late\nmerge: sideways\n")
            return {LATE.name}
        if fault == "killed_materializer":
            os.kill(self.materializer.proc.pid, signal.SIGKILL)
            self.materializer.proc.wait(10)
            return None
        os.kill(self.replicas[1].proc.pid, signal.SIGKILL)  # killed_gateway
        self.replicas[1].proc.wait(10)
        return set()  # the other replica's steps keep flowing to every dataset

    def clear(self, fault: str) -> None:
        """End `fault`: the torn commit removed, the spec fixed, the process restarted."""
        if fault == "failing_gold":
            self._torn.unlink()
        elif fault == "bad_spec":
            save_spec(self.lake, LATE)
        elif fault == "killed_materializer":
            self.materializer = materializer_service(str(self.root), self.workdir, 0.2).start(90)
        else:
            port = self.replicas[1].port
            self.replicas[1] = gateway(str(self.root), self.workdir, "gw-b", port).start(60)

    def stop(self) -> None:
        """Stop every process."""
        for service in [self.materializer, *self.replicas]:
            stop_service(service)


if __name__ == "__main__":
    main()

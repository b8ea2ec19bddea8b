"""`claw demo`: one end-to-end run on simulated agents against real processes, then a summary."""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import polars as pl
from tqdm import tqdm

from claw_pipelines.app.processes import ServiceProcess
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_LINEAGE,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    STEP_KINDS,
)
from claw_pipelines.lake import Lake
from claw_pipelines.settings import ClawSettings
from claw_pipelines.simulation.agents import (
    Tally,
    Task,
    black_box_rollout,
    feedback_service,
    session_event,
    white_box_group,
)

POLICY_VERSIONS = (1, 2, 3)
TASKS_PER_VERSION = 4
ROLLOUTS = 4
DEMO_KEY = "claw-demo-key"


def say(message: str) -> None:
    """Progress on stderr, so stdout stays the summary."""
    print(message, file=sys.stderr, flush=True)


def run_demo(settings: ClawSettings, workdir: str | None = None, seed: int = 7) -> dict:
    """Start the simulated model and the gateway, run the agents, stop, summarize."""
    logs = Path(workdir or tempfile.mkdtemp(prefix="claw-demo-"))
    lake = Lake.from_settings(settings)
    say(f"claw demo: lake {lake.uri}; logs in {logs}")
    sim = ServiceProcess("sim-llm", logs / "sim-llm.log", health="/health", args=("--seed", "7"))
    gateway_env = {
        "CLAW_LAKE_URI": settings.lake_uri,
        "CLAW_API_KEYS": f"{DEMO_KEY}=demo",
        "CLAW_FLUSH_INTERVAL_MS": "100",
    }
    with sim:
        gateway_env["CLAW_UPSTREAM_URL"] = f"{sim.url}/v1"
        with ServiceProcess(
            "gateway", logs / "gateway.log", health="/readyz", env=gateway_env
        ) as gateway:
            say(f"  simulated model {sim.url} (a test double, not a language model)")
            say(f"  gateway {gateway.url}")
            rng = random.Random(seed)
            tally = drive_agents(sim.url, gateway.url, rng)
            say("  the online loop: agents -> live gold -> trainer -> next policy version")
            rounds = online_loop(lake, sim.url, gateway.url, rng, tally)
            say("  stopping the gateway: it lands every acknowledged record in bronze")
        summary = summarize(lake, tally) | {"rounds": rounds}
    say("  materializing every asset (Dagster, in-process)")
    summary |= materialize_all(settings, lake)
    summary |= consume_a_batch(lake)
    print(render(summary, lake))
    return summary


def drive_agents(sim_url: str, gateway_url: str, rng: random.Random) -> Tally:
    """One round of every simulated agent against a gateway (and its inference server)."""
    tally = Tally()
    auth = {"Authorization": f"Bearer {DEMO_KEY}"}
    with (
        httpx.Client(base_url=f"{sim_url}/v1", timeout=60) as llm,
        httpx.Client(base_url=gateway_url, headers=auth, timeout=60) as gateway,
    ):
        proxy = gateway.get("/v1/models").status_code == 200
        if not proxy:
            say("  (this gateway has no OpenAI proxy routes: black-box agents skipped)")
        total = len(POLICY_VERSIONS) * TASKS_PER_VERSION
        progress = tqdm(total=total, unit="task", desc="  agents", file=sys.stderr)
        for version in POLICY_VERSIONS:
            finished: list[str] = []
            for index in range(TASKS_PER_VERSION):
                task = Task.random(rng)
                scoped = index % 2 == 0  # half the black-box groups send unscoped calls
                session_event(gateway, "session_started", None, tally)
                finished += white_box_group(llm, gateway, task, ROLLOUTS, version, tally)
                if proxy:
                    group = f"bb-group-{rng.getrandbits(48):012x}"
                    for rollout in range(ROLLOUTS):
                        black_box_rollout(
                            gateway_url,
                            DEMO_KEY,
                            task,
                            group,
                            version,
                            tally,
                            scoped=scoped,
                            seed=rollout,  # rollouts of a group sample differently
                        )
                progress.set_postfix_str(f"policy v{version}: {task.question}")
                progress.update()
            feedback_service(gateway, finished, rng, tally)
        progress.close()
    return tally


def online_loop(
    lake: Lake, sim_url: str, gateway_url: str, rng: random.Random, tally: Tally
) -> list[str]:
    """Three rounds of the asynchronous RL loop (claw_pipelines.app.demo_loop); a line each."""
    from claw_pipelines.app.demo_loop import run_loop

    auth = {"Authorization": f"Bearer {DEMO_KEY}"}
    with (
        httpx.Client(base_url=f"{sim_url}/v1", timeout=60) as llm,
        httpx.Client(base_url=gateway_url, headers=auth, timeout=60) as gateway,
    ):
        done = run_loop(
            lake, llm, gateway, rng, rollouts=ROLLOUTS, tally=tally,
            first_version=max(POLICY_VERSIONS) + 1,
        )  # fmt: skip
    for number, played in enumerate(done, 1):
        say(f"    round {number}: {played.line()}")
    return [played.line() for played in done]


def summarize(lake: Lake, tally: Tally) -> dict:
    """Counts read back from `bronze/events`, beside what the agents were acknowledged."""
    deadline = time.monotonic() + 30
    while True:  # the gateway's flusher finishes landing before the process exits
        frame = lake.read(BRONZE_EVENTS)
        if set(tally.event_ids) <= set(frame["event_id"].to_list()):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("acknowledged records are missing from bronze")
        time.sleep(0.2)
    steps = frame.filter(pl.col("kind").is_in(STEP_KINDS))
    return {
        "records_by_kind": dict(frame.group_by("kind").len().sort("kind").iter_rows()),
        "steps": steps.height,
        "trajectories": steps["trajectory_uid"].n_unique(),
        "prompt_groups": steps["prompt_uid"].drop_nulls().n_unique(),
        "policy_versions": sorted(steps["policy_version"].drop_nulls().unique().to_list()),
        "prompt_tokens": int(steps["prompt_ids"].list.len().sum()),
        "response_tokens": int(steps["response_ids"].list.len().sum()),
        "acknowledged": len(set(tally.event_ids)),
        "steps_acknowledged": tally.steps,
        "bronze_version": lake.version(BRONZE_EVENTS),
    }


def materialize_all(settings: ClawSettings, lake: Lake) -> dict:
    """Run every Dagster asset on the lake; what silver holds afterwards."""
    from claw_pipelines.app.materialize import materialize

    report = materialize(settings)
    if not report.success:
        raise RuntimeError(f"materialization failed: {report.error}")
    steps = lake.read(SILVER_STEPS, columns=["trajectory_uid", "origin_step_key"])
    trajectories = lake.read(SILVER_TRAJECTORIES, columns=["status"])
    rewards = lake.read(SILVER_STEP_REWARDS, columns=["reward_status"])
    stitched = steps.filter(pl.col("origin_step_key").is_not_null())
    lineage = (
        lake.read(GOLD_LINEAGE)
        .sort("written_at")
        .unique(["dataset", "policy_version"], keep="last")
    )
    raw, tree = int(lineage["raw_tokens"].sum()), int(lineage["tree_tokens"].sum())
    datasets = {
        f"{d} v{v}": n
        for d, v, n in lineage.sort("dataset", "policy_version")
        .select("dataset", "policy_version", "steps")
        .iter_rows()
    }
    return {
        "silver_steps": steps.height,
        "silver_trajectories": dict(
            trajectories.group_by("status").len().sort("status").iter_rows()
        ),
        "stitched_unscoped": f"{stitched.height} calls -> "
        f"{stitched['trajectory_uid'].n_unique()} trajectories",
        "reward_status": dict(
            rewards.group_by("reward_status").len().sort("reward_status").iter_rows()
        ),
        "gold_datasets": ", ".join(f"{k}: {n} steps" for k, n in datasets.items()),
        "gold_tokens": f"raw {raw}, tree {tree}, saved {raw - tree} "
        f"({1 - tree / raw:.0%}; token_ratio {tree / raw:.3f})"
        if raw
        else "none",
        "checks": f"{sum(report.checks.values())}/{len(report.checks)} passed",
    }


def consume_a_batch(lake: Lake) -> dict:
    """Pull one tree batch per policy version of `default`, as a trainer would (logged)."""
    from claw_pipelines.consume import Dataset

    dataset = Dataset(lake, "default")
    pulled = []
    for version in dataset.policy_versions():
        batch = next(dataset.batches(version, batch_size=16, consumer="claw-demo"), None)
        if batch is not None:
            flat = sum(len(i) for i in batch.step_token_index)
            pulled.append(
                f"v{version}: {len(batch.step_keys)} steps in {batch.num_tokens} tokens "
                f"(flat {flat})"
            )
    return {"consumed": "; ".join(pulled) or "nothing"}


def render(summary: dict, lake: Lake) -> str:
    """The summary as a small table."""
    rows = [
        ("records by kind", ", ".join(f"{k}={v}" for k, v in summary["records_by_kind"].items()))
    ]
    rows += [
        (name.replace("_", " "), str(summary[name]))
        for name in (
            "steps",
            "trajectories",
            "prompt_groups",
            "policy_versions",
            "prompt_tokens",
            "response_tokens",
            "acknowledged",
            "steps_acknowledged",
            "bronze_version",
            "silver_steps",
            "silver_trajectories",
            "stitched_unscoped",
            "reward_status",
            "gold_datasets",
            "gold_tokens",
            "checks",
            "consumed",
        )
        if name in summary
    ]
    rows += [(f"online round {i}", line) for i, line in enumerate(summary.get("rounds", []), 1)]
    width = max(len(name) for name, _ in rows)
    lines = ["", "claw demo: summary"] + [f"  {n:<{width}}  {v}" for n, v in rows]
    lines += [
        "",
        f"  lake: {lake.uri}",
        f"  read it: polars.read_delta('{lake.table_uri(SILVER_STEPS)}')",
        f"  Dagster UI: CLAW_LAKE_URI={lake.uri} dagster dev -w workspace.yaml",
        f"  dashboard:  claw dashboard --lake {lake.uri}",
        f"  everything: claw up --lake {lake.uri}",
    ]
    return "\n".join(lines)

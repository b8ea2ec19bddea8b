"""`claw demo`: one end-to-end run on simulated agents against real processes, then a summary.

The summary is read back from the lake (`demo_summary`), in the order data flows: records in
bronze, silver steps, trajectories, what curation kept and left out, the prefix-tree saving.
Lines marked "agents:" are what the simulated agents counted, not the lake. The closing hints
(`next_steps`) run as printed from the directory the demo ran in.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import polars as pl
from tqdm import tqdm

from claw_pipelines.app.processes import ServiceProcess
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_CONSUMPTION,
    SILVER_STEP_CONFLICTS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    STEP_KINDS,
    TRAJECTORY_STATUSES,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.lake.delta import Lake
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
COMPACTING_TURNS = 6  # calls of a black-box session that compacts its context


def say(message: str) -> None:
    """Progress on stderr, so stdout stays the summary."""
    print(message, file=sys.stderr, flush=True)


@dataclass
class DemoTally(Tally):
    """What the agents sent and the gateway acknowledged, proxied calls counted apart (they
    are acknowledged by the answer and a step key, not by an event id)."""

    proxied_calls: int = 0
    black_box_rollouts: int = 0


def run_demo(
    settings: ClawSettings,
    workdir: str | None = None,
    seed: int = 7,
    compact_every: int | None = None,
) -> DemoSummary:
    """Start the simulated model and the gateway, run the agents, stop, summarize.
    `compact_every`: the black-box agents compact their context (see `drive_agents`)."""
    logs = Path(workdir or tempfile.mkdtemp(prefix="claw-demo-"))
    lake = Lake.from_settings(settings)
    say(f"claw demo: lake {lake.uri}; logs in {logs}")
    sim = ServiceProcess("sim-llm", logs / "sim-llm.log", health="/health", args=("--seed", "7"))
    gateway_env = {
        "CLAW_LAKE_URI": settings.lake_uri,
        "CLAW_API_KEYS": f"{DEMO_KEY}=demo",
        "CLAW_FLUSH_INTERVAL_MS": "100",
    }
    tally = DemoTally()
    with sim:
        gateway_env["CLAW_UPSTREAM_URL"] = f"{sim.url}/v1"
        with ServiceProcess(
            "gateway", logs / "gateway.log", health="/readyz", env=gateway_env
        ) as gateway:
            say(f"  simulated model {sim.url} (a test double, not a language model)")
            say(f"  gateway {gateway.url}")
            rng = random.Random(seed)
            drive_agents(
                sim.url, gateway.url, rng, tally, progress=True, compact_every=compact_every
            )
            say("  the online loop: agents -> live gold -> trainer -> next policy version")
            say(
                "    (pg loss: the policy-gradient loss of a round's batch; its sign follows "
                "the groups' advantages, it is no score)"
            )
            rounds = online_loop(lake, sim.url, gateway.url, rng, tally)
            say("  stopping the gateway: it lands every acknowledged record in bronze")
    wait_for_bronze(lake, tally)
    say("  materializing every asset (Dagster, in-process)")
    checks = materialize_all(settings)
    consume_a_batch(lake)
    summary = demo_summary(lake, tally, rounds, checks)
    print(render(summary, next_steps(settings, lake)))
    return summary


def drive_agents(
    sim_url: str,
    gateway_url: str,
    rng: random.Random,
    tally: DemoTally | None = None,
    progress: bool = False,
    compact_every: int | None = None,
) -> DemoTally:
    """One round of every simulated agent against a gateway (and its inference server);
    `progress`: a progress bar on stderr, when it is a terminal. `compact_every`: the
    black-box agents hold longer sessions (COMPACTING_TURNS calls) and compact their context
    after every that many calls (`agents.black_box_rollout`)."""
    tally = tally if tally is not None else DemoTally()
    auth = {"Authorization": f"Bearer {DEMO_KEY}"}
    with (
        httpx.Client(base_url=f"{sim_url}/v1", timeout=60) as llm,
        httpx.Client(base_url=gateway_url, headers=auth, timeout=60) as gateway,
    ):
        proxy = gateway.get("/v1/models").status_code == 200
        if not proxy and progress:
            say("  (this gateway has no OpenAI proxy routes: black-box agents skipped)")
        total = len(POLICY_VERSIONS) * TASKS_PER_VERSION
        bar = tqdm(
            total=total,
            unit="task",
            desc="  agents",
            file=sys.stderr,
            disable=None if progress else True,  # None: only on a terminal
        )
        for version in POLICY_VERSIONS:
            finished: list[str] = []
            for index in range(TASKS_PER_VERSION):
                task = Task.random(rng)
                session_event(gateway, "session_started", None, tally)
                finished += white_box_group(llm, gateway, task, ROLLOUTS, version, tally)
                if proxy:  # half the black-box groups send unscoped calls
                    _black_box_group(
                        gateway_url, task, version, rng, tally, index % 2 == 0, compact_every
                    )
                bar.set_postfix_str(f"policy v{version}: {task.question}")
                bar.update()
            feedback_service(gateway, finished, rng, tally)
        bar.close()
    return tally


def _black_box_group(
    gateway_url: str,
    task: Task,
    version: int,
    rng: random.Random,
    tally: DemoTally,
    scoped: bool,
    compact_every: int | None = None,
) -> None:
    """A GRPO group of tool agents that know only an OpenAI base URL (compacting their
    context after every `compact_every` calls, when given)."""
    group = f"bb-group-{rng.getrandbits(48):012x}"
    turns = 4 if compact_every is None else COMPACTING_TURNS
    for rollout in range(ROLLOUTS):
        before = tally.steps
        black_box_rollout(
            gateway_url, DEMO_KEY, task, group, version, tally, max_turns=turns,
            scoped=scoped, seed=rollout,  # rollouts of a group sample differently
            compact_every=compact_every,
        )  # fmt: skip
        tally.proxied_calls += tally.steps - before
        tally.black_box_rollouts += 1


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


def wait_for_bronze(lake: Lake, tally: Tally, timeout: float = 30) -> None:
    """Until every event id the gateway acknowledged is in `bronze/events`."""
    deadline = time.monotonic() + timeout
    wanted = set(tally.event_ids)
    while not wanted <= set(lake.read(BRONZE_EVENTS, columns=["event_id"])["event_id"]):
        if time.monotonic() > deadline:
            raise RuntimeError("acknowledged records are missing from bronze")
        time.sleep(0.2)


def materialize_all(settings: ClawSettings) -> tuple[int, int]:
    """Run every Dagster asset on the lake; (asset checks passed, asset checks run)."""
    from claw_pipelines.app.materialize import materialize

    report = materialize(settings)
    if not report.success:
        raise RuntimeError(f"materialization failed: {report.error}")
    return sum(report.checks.values()), len(report.checks)


def consume_a_batch(lake: Lake) -> None:
    """Pull one tree batch per policy version of `default`, as a trainer would (logged)."""
    from claw_pipelines.consume.dataset import Dataset

    dataset = Dataset(lake, "default")
    for version in dataset.policy_versions():
        next(dataset.batches(version, batch_size=16, consumer="claw-demo"), None)


# The summary: numbers read from the lake, each stage's parts adding up to its total.


def _counts(frame: pl.DataFrame, column: str) -> dict[str, int]:
    """Rows per value of `column`, largest first."""
    grouped = frame.group_by(column).len().sort(["len", column], descending=[True, False])
    return {str(k): int(n) for k, n in grouped.iter_rows()}


@dataclass
class DatasetCounts:
    """One gold dataset: steps kept (per policy version), left out (per reason), tokens."""

    kept: int
    kept_by_version: dict[int, int]
    rejected_by_reason: dict[str, int]
    flat_tokens: int  # prompt + response tokens of the kept steps, one sequence each
    tree_tokens: int  # the tokens its prefix trees store

    @property
    def rejected(self) -> int:
        """Steps the spec left out."""
        return sum(self.rejected_by_reason.values())


@dataclass
class DemoSummary:
    """What one demo run left in the lake (and, apart, what its agents counted)."""

    lake: str
    records_by_kind: dict[str, int]
    step_records_by_kind: dict[str, int]
    silver_steps: int
    conflicts: int
    steps_by_source: dict[str, int]
    policy_versions: list[int]
    prompt_groups: int
    prompt_tokens: int
    response_tokens: int
    reward_status: dict[str, int]
    trajectories_by_status: dict[str, int]
    bronze_trajectory_ids: int
    stitched_calls: int
    stitched_trajectories: int
    fragment_starts: dict[str, int]  # turns that start a new fragment, per reason
    fragmented_trajectories: int  # trajectories of more than one fragment
    datasets: dict[str, DatasetCounts]
    consumed: dict[str, tuple[int, int]]  # consumer -> (batches, steps)
    sent: DemoTally | None = None
    checks: tuple[int, int] | None = None
    rounds: list[str] = field(default_factory=list)

    @property
    def records(self) -> int:
        """Records in `bronze/events`."""
        return sum(self.records_by_kind.values())

    @property
    def step_records(self) -> int:
        """Bronze records that are steps (white-box steps and proxied completions)."""
        return sum(self.step_records_by_kind.values())

    @property
    def duplicates(self) -> int:
        """Step records silver dropped as exact duplicates (same event id, or same key and
        tokens)."""
        return self.step_records - self.silver_steps - self.conflicts

    @property
    def trajectories(self) -> int:
        """Trajectories in `silver/trajectories`."""
        return sum(self.trajectories_by_status.values())


def demo_summary(
    lake: Lake,
    sent: DemoTally | None = None,
    rounds: list[str] | None = None,
    checks: tuple[int, int] | None = None,
) -> DemoSummary:
    """Read the summary back from the lake; `sent`, `rounds`, `checks`: what the run itself
    counted, shown beside it."""
    bronze = lake.read(BRONZE_EVENTS, columns=["kind", "trajectory_uid"])
    bronze_steps = bronze.filter(pl.col("kind").is_in(STEP_KINDS))
    steps = lake.read(SILVER_STEPS, columns=list(SUMMARY_STEP_COLUMNS))
    stitched = steps.filter(pl.col("origin_step_key").is_not_null())
    trajectories = table_counts(lake, SILVER_TRAJECTORIES, "status")
    return DemoSummary(
        lake=lake.uri,
        records_by_kind=_counts(bronze, "kind"),
        step_records_by_kind=_counts(bronze_steps, "kind"),
        silver_steps=steps.height,
        conflicts=sum(table_counts(lake, SILVER_STEP_CONFLICTS, "tenant").values()),
        steps_by_source=_counts(steps, "source_kind"),
        policy_versions=sorted(steps["policy_version"].drop_nulls().unique().to_list()),
        prompt_groups=steps["prompt_uid"].drop_nulls().n_unique(),
        prompt_tokens=int(steps["prompt_len"].sum()),
        response_tokens=int(steps["response_len"].sum()),
        reward_status=table_counts(lake, SILVER_STEP_REWARDS, "reward_status"),
        trajectories_by_status={s: trajectories.pop(s, 0) for s in STATUS_ORDER} | trajectories,
        bronze_trajectory_ids=bronze_steps["trajectory_uid"].n_unique(),
        stitched_calls=stitched.height,
        stitched_trajectories=stitched["trajectory_uid"].n_unique(),
        fragment_starts=_counts(
            steps.filter(pl.col("fragment_reason").is_not_null()), "fragment_reason"
        ),
        fragmented_trajectories=steps.filter(pl.col("fragment") > 0)["trajectory_uid"].n_unique(),
        datasets={name: dataset_counts(lake, name) for name in gold_dataset_names(lake)},
        consumed=consumed(lake),
        sent=sent,
        checks=checks,
        rounds=list(rounds or []),
    )


STATUS_ORDER = ("complete", *(s for s in TRAJECTORY_STATUSES if s != "complete"))
SUMMARY_STEP_COLUMNS = (
    "trajectory_uid",
    "prompt_uid",
    "policy_version",
    "source_kind",
    "origin_step_key",
    "prompt_len",
    "response_len",
    "fragment",
    "fragment_reason",
)


def table_counts(lake: Lake, table: str, column: str) -> dict[str, int]:
    """Rows of `table` per value of `column` (none when the table does not exist yet)."""
    return _counts(lake.read(table, columns=[column]), column) if lake.exists(table) else {}


def gold_dataset_names(lake: Lake) -> list[str]:
    """The gold datasets the lake holds, `default` first."""
    from claw_pipelines.lake.catalog import gold_datasets

    return sorted(gold_datasets(lake), key=lambda name: (name != "default", name))


def dataset_counts(lake: Lake, name: str) -> DatasetCounts:
    """Kept, left out and token counts of one gold dataset, from its tables."""
    kept = lake.read(
        gold_dataset_table(name), columns=["policy_version", "prompt_len", "response_len"]
    )
    reasons = table_counts(lake, gold_rejection_table(name), "reason")
    trees = lake.read(gold_tree_table(name), columns=["tokens"])
    by_version = kept.group_by("policy_version").len().sort("policy_version")
    return DatasetCounts(
        kept=kept.height,
        kept_by_version={int(v): int(n) for v, n in by_version.iter_rows()},
        rejected_by_reason=reasons,
        flat_tokens=int((kept["prompt_len"] + kept["response_len"]).sum()),
        tree_tokens=int(trees["tokens"].list.len().sum()),
    )


def consumed(lake: Lake) -> dict[str, tuple[int, int]]:
    """Per consumer in `gold/consumption`: batches pulled and steps in them."""
    if not lake.exists(GOLD_CONSUMPTION):
        return {}
    frame = lake.read(GOLD_CONSUMPTION, columns=["consumer", "step_keys"])
    per = frame.group_by("consumer").agg(pl.len(), pl.col("step_keys").list.len().sum())
    return {c: (int(b), int(s)) for c, b, s in per.sort("consumer").iter_rows()}


def _parts(counts: dict, sep: str = ", ") -> str:
    return sep.join(f"{k} {v}" for k, v in counts.items())


def summary_lines(s: DemoSummary) -> list[tuple[str, str]]:
    """(stage, text) rows of the summary, in the order data flows."""
    rows = [("bronze", f"{s.records} records landed in bronze/events: {_parts(s.records_by_kind)}")]
    if s.sent is not None:
        rows.append(("  agents:", _acknowledged(s)))
    rows += [
        (
            "silver steps",
            f"{s.silver_steps} in silver/steps = {s.step_records} step records "
            f"({_parts(s.step_records_by_kind, ' + ')}) - {s.duplicates} exact duplicates - "
            f"{s.conflicts} conflicts (kept apart in silver/step_conflicts)",
        ),
        (
            "",
            f"by source {_parts(s.steps_by_source)}; policy versions "
            f"{', '.join(map(str, s.policy_versions))} ({_versions_told()}); "
            f"{s.prompt_groups} prompt groups; "
            f"{s.prompt_tokens} prompt + {s.response_tokens} response tokens",
        ),
        (
            "",
            f"rewards: {_parts(s.reward_status, ' + ')} = {sum(s.reward_status.values())} "
            "steps (silver/step_rewards; missing: the trajectory ended without a reward for "
            "that step, e.g. a tool agent's earlier turns)",
        ),
        (
            "trajectories",
            f"{s.trajectories} in silver/trajectories = {_parts(s.trajectories_by_status, ' + ')}",
        ),
        (
            "",
            f"bronze named {s.bronze_trajectory_ids} trajectory ids: {s.stitched_calls} "
            "calls sent without a trajectory (unscoped: a fresh id each) were joined by their "
            f"shared token prefixes (stitched) into {s.stitched_trajectories} "
            f"trajectories ({s.bronze_trajectory_ids} - {s.stitched_calls} + "
            f"{s.stitched_trajectories} = {s.trajectories})",
        ),
    ]
    if s.fragment_starts:
        rows.append(
            (
                "",
                f"{s.fragmented_trajectories} trajectories compacted or rewrote their context: "
                f"{sum(s.fragment_starts.values())} turns started a new fragment "
                f"({_parts(s.fragment_starts)})",
            )
        )
    if s.sent is not None:
        white_box = s.sent.trajectories - s.sent.black_box_rollouts
        rows.append(
            (
                "  agents:",
                f"{s.sent.trajectories} trajectories started ({white_box} "
                f"white-box rollouts + {s.sent.black_box_rollouts} black-box tool agents)",
            )
        )
    rows += _curation_rows(s)
    if s.consumed:
        rows.append(
            (
                "consumed",
                "; ".join(
                    f"{c}{CONSUMERS_TOLD.get(c, '')} pulled {b} batches ({n} steps)"
                    for c, (b, n) in s.consumed.items()
                )
                + " (gold/consumption)",
            )
        )
    if s.checks is not None:
        rows.append(("checks", f"{s.checks[0]}/{s.checks[1]} Dagster asset checks passed"))
    rows += [(f"online round {i}", line) for i, line in enumerate(s.rounds, 1)]
    return rows


# who the demo's two consumers are (gold/consumption names them)
CONSUMERS_TOLD = {
    "claw-demo": " (a reader pulling one batch per version of `default`)",
    "claw-demo-trainer": " (the online loop's trainer, on `live-grpo`)",
}
# why a dataset leaves steps out, for the reasons the demo's datasets give
REASONS_TOLD = {
    "stale": "made by an older policy than the dataset trains",
    "incomplete": "their group or trajectory was not finished yet",
    "zero_variance": "every rollout of the group earned the same reward",
    "reward": "no usable reward",
}


def _versions_told() -> str:
    first, last = min(POLICY_VERSIONS), max(POLICY_VERSIONS)
    return f"{first}-{last}: the agents' rollout rounds; later: published by the online loop"


def _told(by_reason: dict[str, int]) -> str:
    """Rejections by reason, each with what it means when the demo knows."""
    return ", ".join(
        f"{reason} {n}" + (f": {REASONS_TOLD[reason]}" if reason in REASONS_TOLD else "")
        for reason, n in by_reason.items()
    )


def _acknowledged(s: DemoSummary) -> str:
    ids, calls = len(set(s.sent.event_ids)), s.sent.proxied_calls
    return (
        f"the gateway acknowledged {ids} records by event id (white-box steps, feedback, "
        f"events, completions) + {calls} proxied chat calls (one record per choice, one choice "
        f"each) = {ids + calls}; a client's retry of a proxied call would land once more"
    )


def _curation_rows(s: DemoSummary) -> list[tuple[str, str]]:
    rows = []
    for name, d in s.datasets.items():
        versions = ", ".join(f"v{v} {n}" for v, n in d.kept_by_version.items())
        reasons = f" ({_told(d.rejected_by_reason)})" if d.rejected else ""
        rows.append(
            (
                "curation" if not rows else "",
                f"{name}: kept {d.kept} ({versions or 'none'})"
                f" + rejected {d.rejected}{reasons} = {d.kept + d.rejected} of "
                f"{s.silver_steps} silver steps",
            )
        )
    for index, (name, d) in enumerate(s.datasets.items()):
        saved = d.flat_tokens - d.tree_tokens
        share = f"{saved / d.flat_tokens:.0%}" if d.flat_tokens else "-"
        rows.append(
            (
                "gold tokens" if index == 0 else "",
                f"{name}: {d.flat_tokens} flat tokens"
                f" (one sequence per kept step) -> {d.tree_tokens} in prefix trees "
                f"(saved {saved}, {share})",
            )
        )
    return rows


@dataclass(frozen=True)
class Hint:
    """A next step: a shell command that runs as printed from the demo's directory."""

    label: str
    command: str
    serves: bool = True  # a server that runs until Ctrl-C (else it finishes by itself)


def shell_path(path: str | Path, cwd: Path | None = None) -> str:
    """`path` as a shell word: relative (`./lake`, `.venv/bin/claw`) when under `cwd`."""
    cwd = (cwd or Path.cwd()).absolute()
    absolute = Path(os.path.abspath(path))
    if absolute.is_relative_to(cwd):
        relative = absolute.relative_to(cwd).as_posix()
        return shlex.quote(relative if "/" in relative else f"./{relative}")
    return shlex.quote(str(absolute))


def _script(name: str, module: str, cwd: Path) -> str:
    """The running interpreter's `name` script, or `python -m module` when there is none."""
    script = Path(sys.executable).with_name(name)
    if script.exists():
        return shell_path(script, cwd)
    return f"{shell_path(sys.executable, cwd)} -m {module}"


def next_steps(settings: ClawSettings, lake: Lake, cwd: Path | None = None) -> list[Hint]:
    """What to run next on the demo's lake, as commands that need nothing on PATH."""
    from claw_pipelines.app.instance import dagster_home

    cwd = (cwd or Path.cwd()).absolute()
    remote = settings.lake_is_remote
    where = shlex.quote(lake.uri) if remote else shell_path(lake.uri, cwd)
    home = dagster_home(settings)
    home_word = shell_path(home, cwd)
    if not home_word.startswith("/"):  # Dagster wants an absolute DAGSTER_HOME
        home_word = f"$PWD/{home_word.removeprefix('./')}"
    claw = _script("claw", "claw_pipelines.app.cli", cwd)
    python = shell_path(sys.executable, cwd)
    read = f"import polars as pl; print(pl.read_delta({json.dumps(lake.table_uri(SILVER_STEPS))}))"
    return [
        Hint("read it", f"{python} -c {shlex.quote(read)}", serves=False),
        Hint("dashboard", f"{claw} dashboard --lake {where}"),
        Hint(
            "Dagster UI",
            f"CLAW_LAKE_URI={where} DAGSTER_HOME={home_word} "
            f"{_script('dagster', 'dagster', cwd)} dev -m claw_pipelines.definitions",
        ),
        Hint("everything", f"{claw} up --lake {where}"),
    ]


def render(summary: DemoSummary, hints: list[Hint] = ()) -> str:
    """The summary as aligned lines, then the next steps."""
    rows = summary_lines(summary)
    width = max(len(stage) for stage, _ in rows)
    lines = [
        "",
        f"claw demo: summary, read back from the lake {summary.lake}",
        '(lines marked "agents:" are what the simulated agents counted, not the lake)',
    ]
    lines += [f"  {stage:<{width}}  {text}" for stage, text in rows]
    if hints:
        lines += ["", "next (from this directory):"]
        lines += [f"  {h.label + ':':<12} {h.command}" for h in hints]
    return "\n".join(lines)

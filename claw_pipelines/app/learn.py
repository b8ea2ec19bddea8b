"""`claw demo --learn`: a loop where reward rises, through every part of the lakehouse.

A tiny random Qwen2 (`simulation.model_folders.word_policy_folder`) is the first policy
version; a real third-party server, `transformers serve` started without a model, serves each
policy version from its own checkpoint folder (a request's `model` names the folder). Agents
on a toy verifiable task (`simulation.word_task`: the share of a reply's words in a small
target set; the untrained policy scores about 0.125) call it through the gateway, scoped per
trajectory and GRPO group, naming the version they ask for, and post each reply's reward as
the trajectory completes. The gateway computes the ids with the model's tokenizer (the
server returns none, and no log-probs) and checks them against the server's counts; the
live materializer (`claw materialize --follow --dataset learn-grpo`, its own process: only
the dataset the trainer pulls) curates complete groups into a GRPO dataset; the trainer pulls
the groups there are with `Dataset.next_batch`, takes one GRPO step through the tree
attention (`train.grpo.TreeGRPO`: `LearnOptions.updates` optimizer updates, PPO-clipped after
the first), saves the next checkpoint folder and publishes its version. Its next batch is
fetched on a thread of its own while it trains (`Prefetcher`); a group may be trained on
`LearnOptions.max_uses` times (fresh groups first: next_batch's replay; with `cooldown` 0
a group may come back in the batch right after its first, fetched while that one trains: a
group arrives fresh a few versions old, and two steps later it would be past the staleness
bound), so the trainer trains on the freshest groups there are instead of idling while the
next group is generated. The server loads the first checkpoint before the loop's clock starts.

The agents make one group at a time with the newest published version, at most
`LearnOptions.ahead` groups beyond what the trainer took (unless it waits for data):
generation overlaps training, and a delivered step may be a few versions older than the
trainer (its staleness, reported per token; the spec drops steps older than
`LearnOptions.staleness`). The loop stops when the mean reward of the latest
`judge_groups` groups reaches the target, or after `max_versions` versions.
"""

from __future__ import annotations

import random
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from claw_pipelines.app.demo_loop import wait_for_dataset
from claw_pipelines.app.processes import ServiceProcess, TransformersServe
from claw_pipelines.consume.dataset import Batch, Dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    EXACT_TOKEN_SOURCES,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    gold_rejection_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import publish_policy_version, published_version
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.live import materializer_running
from claw_pipelines.materialize.silver import SilverOptions, build_silver
from claw_pipelines.settings import ClawSettings
from claw_pipelines.simulation.word_task import Rollout, WordAgent, WordTask
from claw_pipelines.transforms.feedback import reward_by_policy_version

TRAINER = "claw-learner"
CLI = (sys.executable, "-m", "claw_pipelines.app.cli")
LEARN_KEY = "claw-learn-key"
TENANT = "learn"  # the agents' API key's tenant: the learn spec takes its steps only
SPEC_NAME = "learn-grpo"


def say(message: str) -> None:
    """Progress on stderr, so stdout stays the summary."""
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LearnOptions:
    """The loop's knobs (the defaults reach the target on 2 CPU cores in under a minute)."""

    seed: int = 0
    target: float = 0.8  # the mean reward the latest `judge_groups` groups must reach
    max_versions: int = 40  # published versions at most, the random policy (v1) included
    rollouts: int = 8  # replies per prompt group (GRPO)
    max_tokens: int = 6  # words per reply
    vocabulary: int = 128  # words the policy can say
    targets: int = 16  # of which rewarded
    batch_tokens: int = 1024  # a trainer step takes the groups there are, within this many
    ahead: int = 8  # groups the agents may have generated beyond what the trainer took
    staleness: int = 4  # the spec's max_policy_staleness
    judge_groups: int = 2  # the target is judged on the mean of this many latest groups
    stop_at_target: bool = True  # else the loop trains on to `max_versions` (a whole run)
    lr: float = 1e-2
    updates: int = 12  # optimizer updates per batch (GRPO's mu; PPO-clipped after the first)
    max_uses: int = 2  # times a group may be trained on (next_batch's replay, fresh first)
    cooldown: int = 0  # trainer steps at least between two uses of a group


def learn_spec(options: LearnOptions) -> CurationSpec:
    """The dataset the trainer pulls: complete, rewarded GRPO groups of recent versions."""
    return CurationSpec(
        name=SPEC_NAME,
        description="Complete, rewarded word-task groups for the learning loop.",
        reward_status=["final"],
        trajectory_status=["complete"],
        token_sources=EXACT_TOKEN_SOURCES,
        tenants=[TENANT],
        complete_groups_only=True,
        min_group_size=options.rollouts,
        max_policy_staleness=options.staleness,
        merge="prompt_group",
        advantage="grpo",
    )


class Checkpoints:
    """One folder per policy version under `root` (`v1`, `v2`, ...)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def folder(self, version: int) -> Path:
        """The checkpoint folder of `version`."""
        return self.root / f"v{version}"

    def versions_served(self, models: pl.Series) -> pl.Series:
        """Per step's `model` (as the server answered it: `<folder>@<revision>`), the version
        whose checkpoint folder served it; null for any other model."""
        folder = models.str.split("@").list.first()
        return folder.str.strip_prefix(f"{self.root}/v").cast(pl.Int64, strict=False)


@dataclass
class Generated:
    """What the agents generated and scored, group by group (shared with the trainer)."""

    groups: list[tuple[int, float]] = field(default_factory=list)  # (version, mean reward)
    finished: dict[str, float] = field(default_factory=dict)  # group -> when scored (monotonic)
    taken: int = 0  # groups the trainer has taken
    trainer_waiting: bool = False  # the trainer is waiting for data: the agents go on
    reached: tuple[int, float] | None = None  # (version, seconds into the loop)
    error: BaseException | None = None
    changed: threading.Condition = field(default_factory=threading.Condition)

    @property
    def made(self) -> int:
        """Groups generated so far."""
        return len(self.groups)

    def add(self, rollouts: list[Rollout], options: LearnOptions, started: float) -> None:
        """Count a scored group; the target is reached when the mean reward of the last
        `judge_groups` groups reaches it (at the newest version among them)."""
        with self.changed:
            self.groups.append((rollouts[0].policy_version, mean_reward(rollouts)))
            self.finished[rollouts[0].group] = time.monotonic()
            window = self.groups[-options.judge_groups :]
            if (
                self.reached is None
                and len(window) == options.judge_groups
                and float(np.mean([m for _, m in window])) >= options.target
            ):
                self.reached = (max(v for v, _ in window), time.monotonic() - started)
            self.changed.notify_all()

    def take(self, groups: int) -> None:
        """The trainer took `groups` groups: the agents may go on."""
        with self.changed:
            self.taken += groups
            self.changed.notify_all()

    def waiting(self, waits: bool) -> None:
        """The trainer starts (or stops) waiting for data."""
        with self.changed:
            self.trainer_waiting = waits
            self.changed.notify_all()

    def may_generate(self, ahead: int) -> bool:
        """Whether the agents may start a group: fewer than `ahead` beyond what the trainer
        took, or the trainer waiting (groups the spec leaves out never arrive)."""
        return self.trainer_waiting or self.made - self.taken < ahead


def mean_reward(rollouts: list[Rollout]) -> float:
    """The mean reward of a group's rollouts."""
    return float(np.mean([r.reward for r in rollouts]))


def run_agents(
    agent: WordAgent,
    lake_uri: str,
    checkpoints: Checkpoints,
    generated: Generated,
    options: LearnOptions,
    stop: threading.Event,
    started: float,
) -> threading.Thread:
    """The agents on their own thread: a group at a time with the newest published version,
    at most `options.ahead` groups beyond what the trainer took unless it waits for data."""
    rng = random.Random(options.seed)
    lake = Lake(lake_uri)  # its own table handles

    def loop() -> None:
        try:
            while not stop.is_set():
                with generated.changed:
                    if not generated.may_generate(options.ahead):
                        generated.changed.wait(0.1)
                        continue
                version = published_version(lake)
                model = str(checkpoints.folder(version))
                generated.add(agent.group(model, version, rng, options.rollouts), options, started)
        except BaseException as exc:  # reported by the trainer's loop, which stops
            generated.error = exc
            with generated.changed:
                generated.changed.notify_all()

    thread = threading.Thread(target=loop, name="word-agents", daemon=True)
    thread.start()
    return thread


@dataclass
class TrainedVersion:
    """One trainer step: the version it trained, the batch, the wait for it, the update."""

    version: int  # the trainer's version when it took the batch (it publishes version + 1)
    groups: int
    steps: int
    tree_tokens: int
    trained_tokens: int
    waited_s: float
    lake_wait_s: float  # of which after a group of the batch was scored (the lake's part)
    step_s: float
    loss: float
    staleness_tokens: dict[int, int]  # staleness -> trained tokens delivered that stale
    behaviour_tokens: int
    mismatch: dict[str, float | None]
    step_keys: list[str] = field(default_factory=list)  # the batch's steps


@dataclass
class LearnSummary:
    """What one learning run did, with reward by policy version read back from the lake."""

    lake: str
    workdir: str
    options: LearnOptions
    reward_by_version: pl.DataFrame  # policy_version, steps, rewarded, mean/min/max reward
    versions_published: int
    reached: tuple[int, float] | None  # (version, seconds into the loop) first at the target
    wall_s: float
    trainer_wait_s: float
    first_batch_wait_s: float
    trained: list[TrainedVersion]
    served_by_own_checkpoint: tuple[int, int]  # steps whose model folder is their version's
    token_sources: dict[str, int]
    discarded_tokens: dict[str, int]  # why -> reply tokens generated and never trained on

    @property
    def wait_share(self) -> float:
        """The share of the loop's wall time the trainer spent waiting for data."""
        return self.trainer_wait_s / self.wall_s if self.wall_s else 0.0

    @property
    def lake_wait_share(self) -> float:
        """The share of the loop's wall time the trainer waited for groups already scored:
        the lake's part of the waiting (gateway to bronze, materializer, delivery); the rest
        is generation (the server, one call at a time)."""
        return sum(t.lake_wait_s for t in self.trained) / self.wall_s if self.wall_s else 0.0

    @property
    def wait_share_until_target(self) -> float | None:
        """The share of the loop's wall time until the target was first reached that the
        trainer spent waiting for data (None when it was not reached)."""
        if self.reached is None:
            return None
        version, seconds = self.reached
        waited = sum(t.waited_s for t in self.trained if t.version < version)
        return waited / seconds if seconds else 0.0

    @property
    def steady_wait_share(self) -> float:
        """The same after the first batch arrived (start-up: the first group generated)."""
        rest = self.wall_s - self.first_batch_wait_s
        return (self.trainer_wait_s - self.first_batch_wait_s) / rest if rest > 0 else 0.0

    def staleness_tokens(self) -> dict[int, int]:
        """Trained tokens delivered per staleness (the trainer's version minus the version
        that generated the token)."""
        total: dict[int, int] = defaultdict(int)
        for step in self.trained:
            for stale, tokens in step.staleness_tokens.items():
                total[stale] += tokens
        return dict(sorted(total.items()))

    def mismatch(self) -> dict[str, Any]:
        """The behaviour/trainer mismatch over the run (token-weighted means), or why none."""
        measured = [s for s in self.trained if s.behaviour_tokens]
        if not measured:
            return {"available": False, "why": "the server returns no log-probs: IS ratio 1"}
        weights = np.array([s.behaviour_tokens for s in measured], dtype=np.float64)
        figures = {
            name: float(np.average([s.mismatch[name] for s in measured], weights=weights))
            for name in ("mean_abs_diff", "kl_k1", "kl_k3", "outside_band", "truncated")
        }
        return {"available": True, "tokens": int(weights.sum()), **figures}


def run_learn(
    settings: ClawSettings, workdir: str | None = None, options: LearnOptions | None = None
) -> LearnSummary:
    """Build the first policy, start `transformers serve` and the gateway, run the loop (see
    the module doc), stop, summarize from the lake; prints the summary. On a lake that has
    published versions already, the random policy is the next version."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # checkpoints load and save every step
    options = options or LearnOptions()
    work = Path(workdir or tempfile.mkdtemp(prefix="claw-learn-"))
    logs = work / "logs"
    lake = Lake.from_settings(settings)
    checkpoints = Checkpoints((work / "checkpoints").absolute())
    say(f"claw demo --learn: lake {lake.uri}; checkpoints and logs in {work}")
    first = (published_version(lake) or 0) + 1
    folder = _random_policy(checkpoints.folder(first), options)
    task = WordTask.of_folder(folder, options.targets, options.seed)
    say(
        f"  task: reply with words of {len(task.targets)} targets among "
        f"{len(task.vocabulary)} (chance {task.chance:.3f}); target mean reward {options.target}"
    )
    save_spec(lake, learn_spec(options))
    publish_policy_version(lake, first, by=TRAINER, note="the random policy")
    with TransformersServe(None, logs) as server:
        gateway_env = {
            "CLAW_LAKE_URI": settings.lake_uri,
            "CLAW_API_KEYS": f"{LEARN_KEY}={TENANT}",
            "CLAW_FLUSH_INTERVAL_MS": "50",
            "CLAW_UPSTREAM_URL": server.base_url,
            "CLAW_TOKENIZER": str(folder),  # every checkpoint keeps the first one's tokenizer
        }
        gateway = ServiceProcess("gateway", logs / "gateway.log", health="/readyz", env=gateway_env)
        materializer = ServiceProcess(
            "materialize",
            logs / "materializer.log",
            env={"CLAW_LAKE_URI": settings.lake_uri},
            command=[*CLI, "materialize", "--follow", "--poll-s", "0.05", "--dataset", SPEC_NAME],
            ready=lambda: materializer_running(lake),
        )
        with gateway, materializer:
            say(f"  transformers serve {server.url} (no model: each request names a folder)")
            _load(server, folder, task)
            say(f"  gateway {gateway.url}; live materializer (claw materialize --follow)")
            loop = _loop(lake, gateway.url, task, checkpoints, first, options)
            say("  stopping the gateway: it lands every acknowledged record in bronze")
    build_silver(lake, SilverOptions.from_settings(settings))  # what the gateway landed last
    summary = _summary(lake, work, options, checkpoints, first, *loop)
    print(render(summary))
    return summary


def _load(server: TransformersServe, folder: Path, task: WordTask) -> None:
    """Have the server load the first policy's folder before the loop's clock starts (its
    first call loads the model: seconds), with a call straight to it (nothing lands)."""
    import httpx

    messages = task.messages(random.Random(0))
    body = {"model": str(folder), "messages": messages, "max_tokens": 1}
    httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).raise_for_status()


def _random_policy(folder: Path, options: LearnOptions) -> Path:
    """The random policy's checkpoint folder, built afresh (a workdir used before may hold
    a trained checkpoint there)."""
    from claw_pipelines.simulation.model_folders import word_policy_folder

    return word_policy_folder(folder, options.vocabulary, options.seed, options.max_tokens)


def _loop(
    lake: Lake,
    gateway_url: str,
    task: WordTask,
    checkpoints: Checkpoints,
    first: int,
    options: LearnOptions,
) -> tuple[Generated, list[TrainedVersion], float, float]:
    """Agents, the live materializer and the trainer from version `first` until the target
    or the last version: (what was generated, each trainer step, the loop's wall seconds,
    seconds until the first batch)."""
    from claw_pipelines.train.grpo import TreeGRPO

    trainer = TreeGRPO(
        checkpoints.folder(first),
        lr=options.lr,
        seed=options.seed,
        threads=1,
        updates_per_step=options.updates,
    )
    stop = threading.Event()
    generated = Generated()
    agent = WordAgent(gateway_url, LEARN_KEY, task, options.max_tokens)
    started = time.monotonic()
    agents = run_agents(agent, lake.uri, checkpoints, generated, options, stop, started)
    trained: list[TrainedVersion] = []
    version, last = first, first + options.max_versions - 1
    fetcher: Prefetcher | None = None
    try:
        generated.waiting(True)
        dataset = wait_for_dataset(lake, SPEC_NAME)
        # its own dataset (and table handles): it fetches while the trainer trains
        own = Dataset(Lake(lake.uri, lake.storage_options), SPEC_NAME)
        fetcher = Prefetcher(own, generated, options, first)
        fetcher.ask(version)
        while version < last and (generated.reached is None or not options.stop_at_target):
            asked = time.monotonic() if trained else started  # the first: from the start
            generated.waiting(True)
            batch = fetcher.take()
            generated.waiting(False)
            got = time.monotonic()
            generated.take(len(batch.groups))
            if version + 1 < last:  # the next batch is fetched while this one trains
                fetcher.ask(version + 1)
            scored = [generated.finished.get(u.split(":", 1)[1], got) for u in batch.groups]
            waits = (got - asked, got - max(asked, min(scored)))
            done = _train(trainer, dataset, batch, version, waits, len(trained))
            trainer.save(checkpoints.folder(version + 1))
            publish_policy_version(lake, version + 1, by=TRAINER, note="a GRPO step")
            trained.append(done)
            say(f"    v{version} -> v{version + 1}: {_step_line(done)}")
            version += 1
        wall = time.monotonic() - started
    finally:
        stop.set()
        if fetcher is not None:
            fetcher.close()
        agents.join(60)
        agent.close()
    if generated.error is not None:
        raise RuntimeError(f"the agents failed: {generated.error}") from generated.error
    return generated, trained, wall, trained[0].waited_s if trained else wall


class Prefetcher:
    """The trainer's next batch, fetched on a thread of its own while the trainer trains on
    the current one (a data loader's prefetch): delivery (the lake's reads, the durable
    consumption record) and the wait for fresh groups overlap the optimizer step."""

    def __init__(
        self, dataset: Dataset, generated: Generated, options: LearnOptions, first: int
    ) -> None:
        self.dataset, self.generated, self.options = dataset, generated, options
        self.first = first  # this run's first version: older ones are never fetched
        self.closed = threading.Event()
        self._pending: Future[Batch] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")

    def ask(self, version: int) -> None:
        """Start fetching the batch the trainer will train at `version`: groups of this run's
        policy versions at most `options.staleness` older."""
        floor = max(self.first, version - self.options.staleness)
        self._pending = self._pool.submit(
            _next_batch, self.dataset, self.generated, floor, self.options, self.closed
        )

    def take(self) -> Batch:
        """The batch asked for (waiting for it)."""
        if self._pending is None:
            raise RuntimeError("take() before ask()")
        pending, self._pending = self._pending, None
        return pending.result()

    def close(self) -> None:
        """Stop fetching (a batch fetched and never taken stays recorded as delivered)."""
        self.closed.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


def _next_batch(
    dataset: Dataset,
    generated: Generated,
    floor: int,
    options: LearnOptions,
    closed: threading.Event,
) -> Batch:
    """The fresh groups of policy versions from `floor` on there are, within
    `batch_tokens` (at least one: waiting for it); fails when the agents did or the loop
    closed."""
    while True:
        if closed.is_set():
            raise RuntimeError("the loop stopped before a batch came")
        if generated.error is not None:
            raise RuntimeError(f"the agents failed: {generated.error}") from generated.error
        batch = dataset.next_batch(
            consumer=TRAINER,
            max_tokens=options.batch_tokens,
            min_policy_version=floor,
            timeout=0.5,
            poll_s=0.05,
            max_uses=options.max_uses,
            cooldown=options.cooldown,
        )
        if batch is not None:
            return batch


def _train(
    trainer: Any,
    dataset: Dataset,
    batch: Batch,
    version: int,
    waits: tuple[float, float],
    index: int,
) -> TrainedVersion:
    """One GRPO step on `batch` (`waits`: the wait for it, and the part of it after its
    first group was scored), its trainer log-probs recorded beside the batch where the
    consumption API takes them (`Dataset.record_feedback`)."""
    began = time.monotonic()
    report = trainer.step(batch)
    spent = time.monotonic() - began
    dataset.record_feedback(batch, report.log_probs, loss=report.loss, step=index)
    trained = batch.loss_mask.astype(bool)
    # each trained token's staleness: the versions published since the one that generated it
    stale, counts = np.unique(version - batch.token_policy_versions[trained], return_counts=True)
    staleness = dict(zip(stale.tolist(), counts.tolist(), strict=True))
    return TrainedVersion(
        version=version,
        groups=len(batch.groups),
        steps=len(batch.step_keys),
        tree_tokens=batch.num_tokens,
        trained_tokens=report.trained_tokens,
        waited_s=waits[0],
        lake_wait_s=waits[1],
        step_s=spent,
        loss=report.loss,
        staleness_tokens=staleness,
        behaviour_tokens=report.behaviour_tokens,
        step_keys=list(batch.step_keys),
        mismatch={
            "mean_abs_diff": report.mean_abs_diff,
            "kl_k1": report.kl_k1,
            "kl_k3": report.kl_k3,
            "outside_band": report.outside_band,
            "truncated": report.truncated,
        },
    )


def _step_line(done: TrainedVersion) -> str:
    stale = ", ".join(f"{s}: {n}" for s, n in done.staleness_tokens.items())
    return (
        f"{done.groups} groups ({done.steps} steps, {done.tree_tokens} tree tokens), waited "
        f"{done.waited_s:.2f} s, step {done.step_s:.2f} s, loss {done.loss:.3f}; tokens by "
        f"staleness {{{stale}}}"
    )


def _summary(
    lake: Lake,
    work: Path,
    options: LearnOptions,
    checkpoints: Checkpoints,
    first: int,
    generated: Generated,
    trained: list[TrainedVersion],
    wall_s: float,
    first_wait_s: float,
) -> LearnSummary:
    """The run's figures; reward by policy version read back from silver (the agents'
    steps, from version `first` on)."""
    steps = lake.read(
        SILVER_STEPS,
        columns=["step_key", "policy_version", "model", "token_source", "tenant", "response_len"],
    ).filter((pl.col("tenant") == TENANT) & (pl.col("policy_version") >= first))
    rewards = lake.read(SILVER_STEP_REWARDS, columns=["step_key", "reward", "reward_status"])
    joined = steps.join(rewards, on="step_key", how="left")
    served = checkpoints.versions_served(joined["model"])
    sources = joined.group_by("token_source").len().sort("token_source")
    return LearnSummary(
        lake=lake.uri,
        workdir=str(work),
        options=options,
        reward_by_version=reward_by_policy_version(joined),
        versions_published=(published_version(lake) or 0) - first + 1,
        reached=generated.reached,
        wall_s=wall_s,
        trainer_wait_s=sum(t.waited_s for t in trained),
        first_batch_wait_s=first_wait_s,
        trained=trained,
        served_by_own_checkpoint=(int((served == joined["policy_version"]).sum()), joined.height),
        token_sources=dict(sources.iter_rows()),
        discarded_tokens=_discarded(lake, steps, trained),
    )


def _discarded(lake: Lake, steps: pl.DataFrame, trained: list[TrainedVersion]) -> dict[str, int]:
    """Reply tokens of `steps` generated and never trained on, by why: the reason the learn
    spec leaves the step out now (`stale`: past `max_policy_staleness` before the trainer
    took it, ...), `delivered, never trained` (the batch fetched ahead when the loop
    stopped), `kept, never taken` (generated ahead when the loop stopped), or `not curated`
    (landed after the materializer's last round)."""
    dataset = Dataset(lake, SPEC_NAME)
    taken = pl.Series([key for t in trained for key in t.step_keys], dtype=pl.String)
    left = steps.filter(~pl.col("step_key").is_in(taken.implode()))
    delivered = dataset.consumed(TRAINER)["step_keys"].explode().unique()
    fetched = pl.DataFrame({"step_key": delivered}).select(
        "step_key", reason=pl.lit("delivered, never trained")
    )
    kept = dataset.steps().select("step_key", reason=pl.lit("kept, never taken"))
    table = gold_rejection_table(SPEC_NAME)
    rejected = (
        lake.read(table, columns=["step_key", "reason"])
        if lake.exists(table)
        else pl.DataFrame(schema={"step_key": pl.String, "reason": pl.String})
    )
    why = pl.concat([fetched, kept, rejected]).unique("step_key", keep="first")
    left = left.join(why, on="step_key", how="left").with_columns(
        pl.col("reason").fill_null("not curated")
    )
    per = left.group_by("reason").agg(pl.col("response_len").sum()).sort("reason")
    return {str(reason): int(tokens) for reason, tokens in per.iter_rows()}


def render(summary: LearnSummary) -> str:
    """The summary as lines: reward by policy version, then the loop's figures."""
    s, o = summary, summary.options
    lines = ["", f"claw demo --learn: summary, rewards read back from the lake {s.lake}"]
    lines.append("  reward by policy version (silver: mean of the version's rewarded steps)")
    for row in s.reward_by_version.iter_rows(named=True):
        mean = row["mean_reward"]
        bar = "#" * round(20 * mean) if mean is not None else ""
        shown = f"{mean:.3f}" if mean is not None else "  -  "
        lines.append(
            f"    v{row['policy_version']:<3} {shown} {bar:<20} "
            f"({row['rewarded']} of {row['steps']} steps rewarded)"
        )
    if s.reached is not None:
        version, seconds = s.reached
        lines.append(
            f"  reached mean reward >= {o.target} at policy version {version}, "
            f"{seconds:.0f} s into the loop ({s.versions_published} versions published)"
        )
    else:
        lines.append(
            f"  did not reach mean reward {o.target} within {o.max_versions} versions "
            f"({s.wall_s:.0f} s)"
        )
    own, total = s.served_by_own_checkpoint
    stale = s.staleness_tokens()
    trained = sum(stale.values()) or 1
    lines += [
        f"  served: {own} of {total} steps by their own version's checkpoint folder; token "
        f"sources {s.token_sources}",
        f"  trainer: {len(s.trained)} GRPO steps in {s.wall_s:.0f} s, waiting for data "
        f"{s.wait_share:.0%} of the time ({s.steady_wait_share:.0%} after the first batch; "
        f"{s.lake_wait_share:.0%} for groups already scored, the rest for generation)",
        "  staleness of trained tokens: "
        + ", ".join(f"{k}: {v / trained:.0%}" for k, v in stale.items()),
        f"  behaviour/trainer mismatch: {_mismatch_text(s.mismatch())}",
        "  reply tokens generated and never trained on: "
        + (", ".join(f"{k} {v}" for k, v in s.discarded_tokens.items()) or "none"),
        f"  checkpoints in {Path(s.workdir) / 'checkpoints'}",
    ]
    return "\n".join(lines)


def _mismatch_text(found: dict[str, Any]) -> str:
    if not found["available"]:
        return found["why"]
    return (
        f"mean |Δlogp| {found['mean_abs_diff']:.4f}, k1 {found['kl_k1']:.5f}, k3 "
        f"{found['kl_k3']:.5f}, {found['outside_band']:.1%} of ratios outside the band, "
        f"{found['truncated']:.1%} truncated ({found['tokens']} tokens)"
    )

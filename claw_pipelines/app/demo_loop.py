"""The online RL loop of `claw demo`: agents generate with the published policy, a live
materializer curates their groups, a trainer blocks on `next_batch`, takes a tiny torch step
on the tree batch, publishes the next policy version, and the agents continue with it.

The "model" is a bag of token embeddings with a vocabulary head: enough to show a real
policy-gradient update on a tree batch (log-probs read at each token's parent row, weighted
by advantages), not a language model. Needs torch (the `train` extra); without it the
rounds still run and say that no update was made.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import publish_policy_version, published_version
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.live import LiveMaterializer
from claw_pipelines.materialize.silver import SilverOptions
from claw_pipelines.simulation.agents import Tally, Task, white_box_group
from claw_pipelines.train.tiny_policy import TinyPolicy

TRAINER = "claw-demo-trainer"
VOCAB = 4096  # the bundled tokenizer's ids lie below this (larger ids are folded in)


def loop_spec(rollouts: int) -> CurationSpec:
    """The live dataset the trainer pulls: whole scored GRPO groups of recent policies."""
    return CurationSpec(
        name="live-grpo",
        description="Complete GRPO groups of the last two policy versions, for the online loop.",
        reward_status=["final", "missing"],
        trajectory_status=["complete"],
        complete_groups_only=True,
        min_group_size=rollouts,
        group_deadline_s=30,
        max_policy_staleness=1,
        merge="prompt_group",
        advantage="grpo",
    )


@dataclass
class LoopRound:
    """One round: what was generated, delivered and learned, and how fresh it was."""

    policy_version: int
    groups: int
    steps: int
    tree_tokens: int
    flat_tokens: int
    loss: float | None
    freshness_p50_s: float
    freshness_max_s: float
    staleness: int

    def line(self) -> str:
        """The round as one summary line."""
        loss = "no torch: no update" if self.loss is None else f"pg loss {self.loss:.3f}"
        return (
            f"policy v{self.policy_version}: {self.groups} groups ({self.steps} steps, "
            f"{self.tree_tokens} tree / {self.flat_tokens} flat tokens), {loss}; fresh "
            f"{self.freshness_p50_s:.1f} s p50 / {self.freshness_max_s:.1f} s max after the "
            f"last ack; staleness {self.staleness}; published v{self.policy_version + 1}"
        )


def materialize_in_background(lake: Lake, stop: threading.Event) -> threading.Thread:
    """The live materializer, following the lake until `stop` is set."""
    live = LiveMaterializer(lake, SilverOptions())

    def follow() -> None:
        try:
            while not stop.is_set():
                if not live.step().changed:
                    stop.wait(0.1)
        finally:
            live.close()

    thread = threading.Thread(target=follow, name="live-materializer", daemon=True)
    thread.start()
    return thread


def run_loop(
    lake: Lake,
    llm: httpx.Client,
    gateway: httpx.Client,
    rng: random.Random,
    rounds: int = 3,
    groups: int = 4,
    rollouts: int = 4,
    tally: Tally | None = None,
    first_version: int = 1,
) -> list[LoopRound]:
    """`rounds` rounds of generate → pull → update → publish (see the module doc), from
    policy `first_version` (or the published one, when newer)."""
    spec = loop_spec(rollouts)
    save_spec(lake, spec)
    try:
        policy: TinyPolicy | None = TinyPolicy(vocab=VOCAB)
    except ImportError:
        policy = None
    published = published_version(lake)
    if published is None or published < first_version:
        publish_policy_version(lake, first_version, by=TRAINER)
    _wait_for_gateway_version(gateway, max(first_version, published or 0))
    stop = threading.Event()
    worker = materialize_in_background(lake, stop)
    tally = tally or Tally()
    done = []
    try:
        for _ in range(rounds):
            version = published_version(lake)
            acked = {}
            for _ in range(groups):  # no policy_version: the gateway stamps the published one
                keys = white_box_group(llm, gateway, Task.random(rng), rollouts, None, tally)
                acked[keys[0].rsplit("-r", 1)[0]] = time.time()
            dataset = wait_for_dataset(lake, spec.name)
            batch = dataset.next_batch(
                groups, consumer=TRAINER, min_policy_version=version, timeout=120, poll_s=0.05
            )
            if batch is None:
                raise RuntimeError(f"no fresh groups reached {spec.name} within 120 s")
            delivered = time.time()
            groups_of = [unit.split(":", 1)[1] for unit in batch.groups]
            fresh = [delivered - acked[g] for g in groups_of if g in acked]
            loss = policy.step(batch) if policy is not None else None
            done.append(
                LoopRound(
                    policy_version=version,
                    groups=len(batch.groups),
                    steps=len(batch.step_keys),
                    tree_tokens=batch.num_tokens,
                    flat_tokens=int(sum(len(i) for i in batch.step_token_index)),
                    loss=loss,
                    freshness_p50_s=float(np.median(fresh)) if fresh else float("nan"),
                    freshness_max_s=max(fresh, default=float("nan")),
                    staleness=version - int(batch.step_policy_versions.min()),
                )
            )
            publish_policy_version(lake, version + 1, by=TRAINER, note="after a demo update")
            _wait_for_gateway_version(gateway, version + 1)
    finally:
        stop.set()
        worker.join(30)
    return done


def wait_for_dataset(lake: Lake, name: str, timeout: float = 120) -> Dataset:
    """The dataset, once the materializer has written it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Dataset(lake, name)
        except LookupError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _wait_for_gateway_version(gateway: httpx.Client, version: int, timeout: float = 30) -> None:
    """Until the gateway stamps `version` (it reads the published one every second)."""
    deadline = time.monotonic() + timeout
    while gateway.get("/readyz").json().get("policy_version") != version:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not pick up policy version {version}")
        time.sleep(0.1)

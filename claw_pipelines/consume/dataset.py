"""Trainer consumption (docs/DESIGN.md §8): gold partitions by policy version, as tree-packed or
flat batches, exact and reproducible. Needs nothing of the agent runtime (no gateway, no Dagster).

```python
ds = open_dataset("default", lake_uri="./lake")          # version=N: time travel
for batch in ds.batches(policy_version=3, batch_size=64, layout="tree", consumer="run-7"):
    tensors = batch.to_torch()                            # torch: `pip install .[train]`

# the same batches planned (no token read), the same on every rank; a rank packs its own
plan = ds.batch_plan(policy_version=3, batch_size=64, seed=0)
for batch in plan.batches(range(rank, len(plan), world_size)): ...

# asynchronous RL: block for fresh whole groups, each delivered once per consumer rank
batch = ds.next_batch(groups=16, consumer="run-7", min_policy_version=4, timeout=60)
# or reuse: each group up to twice, 8 batches apart, fresh ones first, high reward variance first
batch = ds.next_batch(16, consumer="run-8", max_uses=2, cooldown=8, order="reward_variance")
ds.record_feedback(batch, trainer_log_probs, loss=loss, step=7)  # behaviour vs trainer
publish_policy_version(5, lake_uri="./lake")             # agents move on to policy 5
print(ds.feedback_report(consumer="run-7"))              # k1, k3, ratios outside [0.8, 1.2]
```

`Dataset` is the front of the modules beside it, each with one job: `source` (the dataset's
rows, tokens and stored trees at a version, and packing steps), `offline` (`BatchPlan`: offline
batches planned, then packed), `live` (`next_batch` and `replay`), `feedback` (what trainers
feed back on delivered batches, and the behaviour-vs-trainer mismatch), `judge` (the
contract's verdicts), `lineage` (which spec wrote what). What a batch holds: `consume.batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import polars as pl

from claw_pipelines.consume import feedback
from claw_pipelines.consume.batch import Batch, subtree_ends
from claw_pipelines.consume.delivery import LiveRows, Order, Selection
from claw_pipelines.consume.feedback import FEEDBACK_BAND, WORST_STEPS, FeedbackReport
from claw_pipelines.consume.judge import Judge
from claw_pipelines.consume.lineage import LINEAGE_COLUMNS, Lineage
from claw_pipelines.consume.live import Live
from claw_pipelines.consume.offline import BatchPlan, consumed, log_batch, plan_batches
from claw_pipelines.consume.report import ContractReport
from claw_pipelines.consume.source import (
    BATCH_READ_COLUMNS,
    BATCH_STEP_COLUMNS,
    GoldSource,
    require_lake,
)
from claw_pipelines.contracts.access import Caller, caller_from_settings
from claw_pipelines.contracts.errors import Forbidden, NotFound
from claw_pipelines.contracts.tables import gold_dataset_table, gold_tree_table
from claw_pipelines.lake import policy
from claw_pipelines.lake.delta import Lake
from claw_pipelines.settings import ClawSettings
from claw_pipelines.transforms.packing import Layout

__all__ = [  # the names this module has always given (some now defined beside it)
    "BATCH_READ_COLUMNS",
    "BATCH_STEP_COLUMNS",
    "LINEAGE_COLUMNS",
    "Batch",
    "BatchPlan",
    "Dataset",
    "Forbidden",
    "Layout",
    "NotFound",
    "current_policy_version",
    "open_dataset",
    "publish_policy_version",
    "require_lake",
    "subtree_ends",
]


class Dataset:
    """A gold dataset at one Delta version (the newest unless pinned), read for one caller:
    a key of the tenant the dataset belongs to, or an admin's (`Forbidden` otherwise).
    Without `caller`, this process's `CLAW_API_KEY` decides (local mode when no keys are
    configured)."""

    def __init__(
        self, lake: Lake, name: str, version: int | None = None, caller: Caller | None = None
    ) -> None:
        self.lake, self.name = lake, name
        self.table = gold_dataset_table(name)
        self.trees_table = gold_tree_table(name)
        lineage = Lineage(lake, name)
        self._source = GoldSource(lake, name, lineage)
        self.version: int = self._source.pinned(version)
        self.caller = caller_from_settings(ClawSettings()) if caller is None else caller
        if not self.caller.sees_every_tenant:
            self.caller.require(lineage.tenant(), f"dataset {name!r}")
        self._judge = Judge(lake, name, lineage)
        self._live = Live(self._source, self._judge)

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, version={self.version})"

    def __reduce__(self):
        """Pickles as lake, name and pinned version (e.g. into spawned DataLoader workers)."""
        return Dataset, (self.lake, self.name, self.version, self.caller)

    @property
    def token_versions(self) -> bool:
        """Whether batches carry `token_policy_versions` (on by default; off saves laying
        them out, for a trainer that does not read them)."""
        return self._source.token_versions

    @token_versions.setter
    def token_versions(self, on: bool) -> None:
        self._source.token_versions = bool(on)

    @property
    def _newest(self) -> LiveRows | None:
        """The newest rows live delivery keeps (None before its first delivery)."""
        return self._live.newest

    # -- reading ----------------------------------------------------------------------------
    def policy_versions(self) -> list[int]:
        """The policy versions (partitions) this version of the dataset holds."""
        return self._source.policy_versions(self.version)

    def steps(self, policy_version: int | None = None) -> pl.DataFrame:
        """The dataset's steps (of one policy version when given: NotFound when it holds
        none of it), in step order."""
        return self._source.steps(self.version, policy_version)

    def stored_trees(
        self, policy_version: int, steps: pl.DataFrame, version: int | None = None
    ) -> pl.DataFrame | None:
        """The stored prefix trees (`gold/trees` segments) of the trees of `steps` (step_key,
        tree_id, prompt_len, response_len: a partition, or some of its trees), as written
        with the rows of this dataset version (or `version`), found through lineage; None
        when they cannot stand for exactly those steps."""
        at = self.version if version is None else version
        return self._source.stored_trees(policy_version, steps, at)

    def consumed(self, consumer: str) -> pl.DataFrame:
        """Batches `consumer` pulled from this dataset (any version), oldest first."""
        return consumed(self.lake, self.name, consumer)

    # -- offline batches --------------------------------------------------------------------
    def batches(
        self,
        policy_version: int,
        batch_size: int | None = None,
        layout: Layout = "tree",
        consumer: str | None = None,
        seed: int | None = None,
        skip_consumed_by: str | None = None,
        max_tokens: int | None = None,
    ) -> Iterator[Batch]:
        """Batches of whole trees, of at most `batch_size` steps and at most `max_tokens`
        tokens (tree tokens, or flat ones), whichever comes first; a tree larger than that
        is a batch of its own (`token_report()` says so). Tree order: by tree id, or shuffled
        by `seed` (same seed, same order). With `consumer`, each batch pulled is logged in
        `gold/consumption`; with `skip_consumed_by`, steps that consumer already took are
        left out. The whole partition is packed at the first batch; `batch_plan` packs only
        the batches asked for."""
        plan = self.batch_plan(
            policy_version, batch_size, layout, seed, max_tokens, skip_consumed_by
        )
        for index, batch in enumerate(plan.batches()):
            if consumer is not None:
                log_batch(
                    self.lake,
                    self.name,
                    self.version,
                    consumer,
                    policy_version,
                    index,
                    batch.step_keys,
                )
            yield batch

    def batch_plan(
        self,
        policy_version: int,
        batch_size: int | None = None,
        layout: Layout = "tree",
        seed: int | None = None,
        max_tokens: int | None = None,
        skip_consumed_by: str | None = None,
    ) -> BatchPlan:
        """The batches `batches` would yield with these arguments, planned but not packed:
        `len(plan)`, `plan.step_keys(i)`, and `plan.batches(indexes)` packs only the trees of
        those batches (a rank, or a DataLoader worker, packs only its share). Reads the
        partition's step columns without their tokens; with `max_tokens` in the tree layout,
        tree sizes come from the stored trees, or, when those do not stand for the steps (a
        partly consumed partition), from packing the whole partition now."""
        return plan_batches(
            self, policy_version, batch_size, layout, seed, max_tokens, skip_consumed_by
        )

    # -- live delivery ----------------------------------------------------------------------
    def next_batch(
        self,
        groups: int | None = None,
        *,
        consumer: str,
        max_tokens: int | None = None,
        min_policy_version: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        timeout: float | None = None,
        layout: Layout = "tree",
        poll_s: float = 0.2,
        max_uses: int = 1,
        cooldown: int = 0,
        order: Order = "oldest",
    ) -> Batch | None:
        """The next `groups` whole prompt groups (default 1; with `max_tokens`, as many as
        fit, at least one) that `consumer` rank `rank` of `world_size` may be given, from the
        newest version of the dataset. Blocks until they exist; None when `timeout` seconds
        pass first. Policy versions below `min_policy_version` (default: the newest published
        minus the spec's `max_policy_staleness`) are left out. A group goes to a consumer rank
        at most `max_uses` times (default once), with at least `cooldown` of that rank's
        batches between two deliveries of it (by batch index: from batch b, again at
        b + cooldown + 1 at the earliest; nothing else to give waits for fresh groups). Order:
        groups used fewer times by the rank first (a fresh group before any reuse), then
        `order`: "oldest" landed first, "newest" landed first, or "reward_variance" (the
        highest variance of `reward` over the group's steps first, groups without rewards
        last, then oldest), the group key breaking ties. Each batch is recorded in
        `gold/consumption` (its groups and their use numbers, `batch.uses`) before it is
        returned, so the counts hold across restarts and processes of a rank (`replay`
        re-reads a batch)."""
        return self._live.next_batch(
            groups,
            consumer,
            max_tokens,
            min_policy_version,
            rank,
            world_size,
            timeout,
            layout,
            poll_s,
            Selection(max_uses, cooldown, order),
        )

    def follow(
        self,
        groups: int | None = None,
        *,
        consumer: str,
        stop: Callable[[], bool] | None = None,
        poll_s: float = 0.2,
        **options: Any,
    ) -> Iterator[Batch]:
        """`next_batch` after `next_batch` as the dataset grows, until `stop()` says so (or for
        ever); the same options (`max_uses`, `cooldown` and `order` too)."""
        while stop is None or not stop():
            batch = self.next_batch(groups, consumer=consumer, timeout=poll_s, **options)
            if batch is not None:
                yield batch

    def replay(
        self, consumer: str, rank: int = 0, after_batch: int = -1, layout: Layout = "tree"
    ) -> Iterator[Batch]:
        """The batches `next_batch` delivered to `consumer` rank `rank` after batch index
        `after_batch`, rebuilt exactly (each at its recorded dataset version): a trainer that
        restarts from a checkpoint trains on them again, then goes on with `next_batch`."""
        return self._live.replay(consumer, rank, after_batch, layout)

    # -- trainer feedback -------------------------------------------------------------------
    def record_feedback(
        self, batch: Batch, log_probs: Any, *, loss: Any = None, step: int | None = None
    ) -> bool:
        """Record the trainer's log-probs on a batch `next_batch` (or `replay`) delivered:
        `log_probs` holds one per packed token (numpy or torch, len(batch.input_ids)), read at
        each step's response tokens (where trained); `loss` and `step` (the trainer's step)
        are kept beside them. One `gold/trainer_feedback` row per step, beside the behaviour
        log-probs the batch carried; recorded once per (consumer, rank, batch_index): True
        when this call recorded it, False when it was on record already. Then
        `batch.contract.feedback` holds the batch's mismatch. ValueError names a wrong
        argument (shape, a non-finite or positive log-prob at a trained token); NotFound, a
        batch never delivered."""
        return feedback.record_feedback(self.lake, self.name, batch, log_probs, loss, step)

    def feedback_report(
        self,
        consumer: str | None = None,
        band: tuple[float, float] = FEEDBACK_BAND,
        worst: int = WORST_STEPS,
    ) -> FeedbackReport:
        """Behaviour vs trainer over the feedback trainers recorded on this dataset (of
        `consumer` when given): mean |log-prob difference|, KL estimates k1 and k3, the share
        of importance ratios outside `band`, tokens compared; overall, per policy version and
        per batch, and the `worst` steps (consume.feedback)."""
        return feedback.feedback_report(self.lake, self.name, consumer, band, worst)

    # -- contract ---------------------------------------------------------------------------
    def contract(
        self, batch: Batch, rows: pl.DataFrame, version: int | None = None
    ) -> ContractReport:
        """The contract report of `batch` (its steps' gold rows in `rows`, BATCH_READ_COLUMNS)
        as of dataset version `version` (default: this one)."""
        return self._judge.report(batch, rows, self.version if version is None else version)

    def staleness_floor(self) -> int | None:
        """The oldest policy version the dataset's spec still admits: the newest published
        minus its `max_policy_staleness` (None when either is unknown)."""
        return self._judge.staleness_floor()


def open_dataset(
    name: str,
    lake_uri: str | None = None,
    version: int | None = None,
    key: str | None = None,
    tenant: str | None = None,
) -> Dataset:
    """A gold dataset by name, from `lake_uri` (default: `CLAW_LAKE_URI`), at a Delta version
    (default: the newest), read with API key `key` (default: `CLAW_API_KEY`) against the
    configured keys; `tenant` narrows an admin key to one tenant. `Forbidden`, naming the
    tenant, for another tenant's dataset."""
    settings = ClawSettings().with_overrides(lake_uri=lake_uri, api_key=key)
    caller = caller_from_settings(settings, tenant)
    return Dataset(Lake.from_settings(settings), name, version, caller)


def publish_policy_version(
    version: int, lake_uri: str | None = None, by: str | None = None, note: str | None = None
) -> int:
    """Record that the trainer's policy `version` is current (newer than every published one):
    the gateway stamps it on steps that name none, and staleness counts from it."""
    settings = ClawSettings().with_overrides(lake_uri=lake_uri)
    return policy.publish_policy_version(Lake.from_settings(settings), version, by, note)


def current_policy_version(lake_uri: str | None = None) -> int | None:
    """The newest published policy version (None before the first)."""
    settings = ClawSettings().with_overrides(lake_uri=lake_uri)
    return policy.published_version(Lake.from_settings(settings))

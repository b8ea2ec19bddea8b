"""The contract's inputs for one dataset, and its verdicts on batches (`consume.report` judges).

A batch is judged against its partitions' spec and spec hashes (`gold/lineage`), the staleness
floor (the newest published policy version minus the spec's `max_policy_staleness`) and the
steps the spec left out (`gold/rejections`); each is kept while the tables it came from have
not moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import polars as pl

from claw_pipelines.consume.batch import Batch
from claw_pipelines.consume.kept import Kept
from claw_pipelines.consume.lineage import Lineage
from claw_pipelines.consume.report import ContractReport, Verdicts, verdicts
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    GOLD_LINEAGE,
    GOLD_POLICY_VERSIONS,
    gold_dataset_table,
    gold_rejection_table,
)
from claw_pipelines.lake import policy
from claw_pipelines.lake.delta import Lake


@dataclass(frozen=True)
class Grounds:
    """What the steps of some partitions are judged against, read at one moment."""

    spec: CurationSpec | None  # the spec of the dataset version's newest write
    hashes: dict[int, str]  # per partition: the spec hash of its newest write
    floor: int | None  # the staleness floor (None: unknown)
    left_out: dict[str, int]  # steps the spec left out of the partitions, per reason

    @property
    def token_floor(self) -> int | None:
        """The floor below which tokens are masked out of the loss: the staleness floor when
        the spec judges staleness per token, else None."""
        token = self.spec is not None and self.spec.staleness == "token"
        return self.floor if token else None

    @property
    def blocking(self) -> bool:
        """Whether the spec blocks on any check (a batch is then judged as it is made)."""
        return self.spec is not None and bool(self.spec.blocking)

    def verdicts(self, rows: pl.DataFrame, laid_out: Any) -> Verdicts:
        """The verdicts on the steps of `laid_out` (a batch, or a packed partition), their
        gold rows in `rows`."""
        return verdicts(self.spec, self.hashes, rows, laid_out, self.floor, self.left_out)


class Judge:
    """The contract of gold dataset `name`: its grounds, kept, and the report on a batch."""

    def __init__(self, lake: Lake, name: str, lineage: Lineage) -> None:
        self.lake, self.name, self.lineage = lake, name, lineage
        self.table = gold_dataset_table(name)
        # (lineage version, policy versions version) -> the staleness floor
        self._floor: Kept[tuple[int | None, int | None], int | None] = Kept()
        # (rejections version, policy versions) -> steps left out per reason
        self._rejections: Kept[tuple[int | None, tuple[int, ...]], dict[str, int]] = Kept()

    def report(self, batch: Batch, rows: pl.DataFrame, at: int) -> ContractReport:
        """The contract report of `batch` (its steps' gold rows in `rows`, BATCH_READ_COLUMNS)
        as of dataset version `at`."""
        versions = tuple(sorted({int(v) for v in batch.step_policy_versions.tolist()}))
        judged = self.grounds(versions or (batch.policy_version,), at).verdicts(rows, batch)
        return judged.report(self.name, at, batch.step_keys)

    def grounds(self, versions: tuple[int, ...], at: int) -> Grounds:
        """What steps of policy `versions` are judged against as of dataset version `at`."""
        spec, hashes = self.lineage.specs(at)
        return Grounds(
            spec,
            {v: hashes[v] for v in versions if v in hashes},
            self.staleness_floor(),
            self.left_out(versions),
        )

    def left_out(self, versions: tuple[int, ...]) -> dict[str, int]:
        """Steps the spec left out of these partitions, per reason (gold/rejections)."""
        table = gold_rejection_table(self.name)
        if not self.lake.exists(table):
            return {}
        key = (self.lake.version(table), versions)
        return self._rejections.get(key, lambda: self._count_left_out(table, versions))

    def _count_left_out(self, table: str, versions: tuple[int, ...]) -> dict[str, int]:
        counts = (
            self.lake.read(
                table, columns=["reason"], where=pl.col("policy_version").is_in(list(versions))
            )
            .group_by("reason")
            .agg(pl.len())
        )
        return {r: int(n) for r, n in counts.iter_rows()}

    def staleness(self) -> str:
        """How the dataset's spec (its newest write's) judges staleness: step or token."""
        spec, _ = self.lineage.specs(self.lake.version(self.table))
        return "step" if spec is None else spec.staleness

    def staleness_floor(self) -> int | None:
        """The oldest policy version the dataset's spec still admits: the newest published
        minus its `max_policy_staleness` (None when either is unknown)."""
        inputs = (self.lake.version(GOLD_LINEAGE), self.lake.version(GOLD_POLICY_VERSIONS))
        return self._floor.get(inputs, self._staleness_floor)

    def _staleness_floor(self) -> int | None:
        published = policy.published_version(self.lake)
        if published is None:
            return None
        spec, _ = self.lineage.specs(self.lake.version(self.table))  # the newest write's
        if spec is None or spec.max_policy_staleness is None:
            return None
        return published - spec.max_policy_staleness

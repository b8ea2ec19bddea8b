"""Live delivery of one dataset (`Dataset.next_batch`, which `follow` repeats, and
`replay`): fresh whole groups from its newest version, each once per consumer rank (or as a
`delivery.Selection` reuses them), recorded (`consume.delivery` chooses and records); and the
batches recorded, rebuilt exactly at their dataset versions (with the feedback their trainer
recorded, `consume.feedback`, in their contract reports).

It keeps, while the tables they came from have not moved, the newest rows (brought up to date
by the dataset's change feed, `delivery.LiveRows`) and each consumer rank's ledger.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import polars as pl

from claw_pipelines.consume.batch import Batch, batch_of
from claw_pipelines.consume.delivery import (
    NEXT,
    REFUSED,
    UNIT_COLUMNS,
    Ledger,
    LiveRows,
    Selection,
    available_units,
    choose,
    ledger,
    record_delivery,
)
from claw_pipelines.consume.feedback import mismatch_of, recorded
from claw_pipelines.consume.judge import Judge
from claw_pipelines.consume.kept import Kept
from claw_pipelines.consume.report import blocking_failures
from claw_pipelines.consume.source import BATCH_READ_COLUMNS, GoldSource
from claw_pipelines.contracts.errors import ContractViolation
from claw_pipelines.contracts.tables import GOLD_CONSUMPTION
from claw_pipelines.lake.delta import until_landed
from claw_pipelines.transforms.packing import Layout

# what live delivery reads of each row: a batch's columns and what units are made of
LIVE_COLUMNS = list(dict.fromkeys([*BATCH_READ_COLUMNS, *UNIT_COLUMNS]))


class Live:
    """Live delivery from the gold dataset of `source`, judged by `judge`."""

    def __init__(self, source: GoldSource, judge: Judge) -> None:
        self.source, self.judge = source, judge
        self.lake, self.name, self.table = source.lake, source.name, source.table
        # the newest rows read (None before the first delivery)
        self.newest: LiveRows | None = None
        # (consumer, rank) -> consumption version -> its ledger
        self._books: defaultdict[tuple[str, int], Kept[int, Ledger]] = defaultdict(Kept)

    def next_batch(
        self,
        groups: int | None,
        consumer: str,
        max_tokens: int | None,
        min_policy_version: int | None,
        rank: int,
        world_size: int,
        timeout: float | None,
        layout: Layout,
        poll_s: float,
        selection: Selection,
    ) -> Batch | None:
        """`Dataset.next_batch`: a delivery attempt until one delivers or `timeout` passes."""
        check_delivery(groups, max_tokens, rank, world_size, layout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch, _ = until_landed(
                lambda: self.deliver(
                    groups,
                    consumer,
                    max_tokens,
                    min_policy_version,
                    rank,
                    world_size,
                    layout,
                    selection,
                ),
                f"delivery to {consumer}",
            )
            if batch is not None:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    def replay(self, consumer: str, rank: int, after_batch: int, layout: Layout) -> Iterator[Batch]:
        """`Dataset.replay`: the batches recorded for `consumer` rank `rank` after batch
        `after_batch`, each rebuilt at its recorded dataset version, with its groups' use
        numbers (rows recorded before they were kept: first uses, as delivery then was) and
        its contract report carrying the feedback its trainer recorded (if any)."""
        if not self.lake.exists(GOLD_CONSUMPTION):
            return
        rows = (
            self.lake.scan(GOLD_CONSUMPTION)
            .filter(
                (pl.col("dataset") == self.name)
                & (pl.col("consumer") == consumer)
                & (pl.col("kind") == NEXT)
                & (pl.col("rank") == rank)
                & (pl.col("batch_index") > after_batch)
            )
            .sort("batch_index")
            .collect()
        )
        if rows.is_empty():
            return
        fed = recorded(self.lake, self.name, consumer, rank)  # what their trainer fed back
        for row in rows.iter_rows(named=True):
            rows_of = self.source.scan(row["dataset_version"]).filter(
                pl.col("step_key").is_in(row["step_keys"])
            )
            frame = self.source.read(rows_of, BATCH_READ_COLUMNS)
            batch = self.pack(frame, row["dataset_version"], layout, row.get("token_floor"))
            report = self.judge.report(batch, frame, row["dataset_version"])
            feedback = fed.filter(pl.col("batch_index") == row["batch_index"])
            if feedback.height:
                report = replace(report, feedback=mismatch_of(feedback))
            batch.contract = report
            batch.groups, batch.batch_index = list(row["groups"]), row["batch_index"]
            uses = row.get("uses")
            batch.uses = [1] * len(batch.groups) if uses is None else list(uses)
            batch.consumer, batch.rank = consumer, rank
            yield batch

    def deliver(
        self,
        groups: int | None,
        consumer: str,
        max_tokens: int | None,
        min_policy_version: int | None,
        rank: int,
        world_size: int,
        layout: Layout,
        selection: Selection,
    ) -> Batch | None:
        """One attempt: choose from the newest version, pack, record (guarded), or None."""
        book = self.ledger(consumer, rank)
        version = self.lake.version(self.table)
        if self.newest is None:
            self.newest = LiveRows.read(self.lake, self.table, version, LIVE_COLUMNS)
        self.newest = live = self.newest.at(self.lake, self.table, version, LIVE_COLUMNS)
        floor = self.judge.staleness_floor() if min_policy_version is None else min_policy_version
        staleness = self.judge.staleness()
        units = available_units(live.units, book, floor, rank, world_size, selection, staleness)
        picked = choose(units, groups, max_tokens, selection.order)
        if picked is None:
            return None
        chosen, uses = picked["unit"].to_list(), (picked["used"] + 1).to_list()
        frame = live.rows_of(chosen).drop("unit")
        token_floor = floor if staleness == "token" else None
        batch = self.pack(frame.select(BATCH_READ_COLUMNS), version, layout, token_floor)
        batch.contract = self.judge.report(batch, frame, version)
        failed = blocking_failures(batch.contract)
        newest = int(frame["policy_version"].max())
        written = record_delivery(
            self.lake,
            self.name,
            version,
            consumer,
            rank,
            world_size,
            book,
            chosen,
            uses,
            batch.step_keys,
            newest,
            REFUSED if failed else NEXT,
            token_floor,
        )
        self._books[consumer, rank].put(written, book.after(written, chosen, uses, bool(failed)))
        if failed:  # recorded as refused (never offered again), never returned
            raise ContractViolation(batch.contract, failed)
        batch.groups, batch.uses, batch.batch_index = chosen, uses, book.next_index
        batch.consumer, batch.rank = consumer, rank
        return batch

    def ledger(self, consumer: str, rank: int) -> Ledger:
        """The consumer rank's deliveries: as this object last wrote them when nobody has
        written since, else read again."""
        kept = self._books[consumer, rank]
        # the consumption version is read only when there is a ledger to compare it with
        if kept.entry is not None and kept.holds(self.lake.version(GOLD_CONSUMPTION)):
            return kept.entry[1]
        book = ledger(self.lake, self.name, consumer, rank)
        return kept.put(book.version, book)

    def pack(
        self, frame: pl.DataFrame, version: int, layout: Layout, token_floor: int | None = None
    ) -> Batch:
        """One batch of `frame`'s steps (BATCH_STEP_COLUMNS and policy_version, at dataset
        version `version`; whole trees, possibly of several partitions), trees in id order;
        response tokens older than `token_floor` masked out of the loss."""
        segments = None
        if layout == "tree":
            found = []
            for (policy_version,), part in frame.group_by("policy_version"):
                stored = self.source.stored_trees(int(policy_version), part, version)
                if stored is None:
                    break
                found.append(stored.with_columns(policy_version=pl.lit(policy_version, pl.Int64)))
            else:
                segments = pl.concat(found) if found else None
        # trees are told apart by partition too: a trajectory may span policy versions
        within = pl.col("policy_version").cast(pl.String) + ":" + pl.col("tree_id")
        frame = frame.with_columns(tree_id=within)
        if segments is not None:
            segments = segments.with_columns(tree_id=within).drop("policy_version")
        trees = frame.group_by("tree_id").agg(pl.len().alias("n")).sort("tree_id")
        packed, frame = self.source.pack(
            frame, trees, layout, segments, version, stale_floor=token_floor
        )
        newest = int(frame["policy_version"].max()) if frame.height else 0
        batch = batch_of(packed, 0, frame.height, newest)
        version_of = dict(zip(frame["step_key"], frame["policy_version"], strict=True))
        batch.step_policy_versions = np.array(
            [version_of[k] for k in batch.step_keys], dtype=np.int64
        )
        return batch


def check_delivery(
    groups: int | None, max_tokens: int | None, rank: int, world_size: int, layout: str
) -> None:
    """One clear error naming the argument, before anything is read."""
    if groups is not None and groups < 1:
        raise ValueError(f"groups must be at least 1, not {groups}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), not {rank}")
    if layout not in ("tree", "flat"):
        raise ValueError(f"layout must be 'tree' or 'flat', not {layout!r}")

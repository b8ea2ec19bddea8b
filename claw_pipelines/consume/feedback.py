"""Trainer feedback: what a trainer tells the lake about a batch `next_batch` delivered (its own
log-prob of each trained token; optionally its loss and train step), recorded once per batch
in `gold/trainer_feedback` beside the consumption record, and the mismatch between the
behaviour policy (the log-probs captured when the steps were generated, which the batch
carried) and the trained one.

The mismatch (`report.Mismatch`) is taken over the response tokens that carry both log-probs
(b: behaviour, t: trainer; r = exp(t - b), the importance ratio): `mean_abs_diff` = mean
|b - t|; `k1` = mean(b - t) and `k3` = mean(r - 1 - log r), estimates of KL(behaviour ‖
trainer) from the behaviour policy's own samples (k3 is never negative and varies less);
`outside_band`, the share of ratios outside the band (default [0.8, 1.2]: what truncated
importance sampling clips); `tokens_compared`. Each step's figures are computed as its
feedback is recorded and stored beside its log-probs, so a summary reads them, not the lists:
a batch's, a policy version's or the overall figures are their means weighted by the tokens
compared (a band other than the recorded one reads the lists again). `feedback_report` gives
them per batch, per policy version and overall, and the steps that differ most.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.consume.batch import Batch
from claw_pipelines.consume.delivery import NEXT
from claw_pipelines.consume.report import Mismatch
from claw_pipelines.contracts.errors import NotFound
from claw_pipelines.contracts.tables import (
    GOLD_CONSUMPTION,
    GOLD_TRAINER_FEEDBACK,
    GOLD_TRAINER_FEEDBACK_SPEC,
)
from claw_pipelines.lake.delta import Guard, Lake, until_landed

FEEDBACK_BAND = (0.8, 1.2)
WORST_STEPS = 5
BATCH_KEYS = ["consumer", "rank", "batch_index"]
FIGURES = ["tokens_compared", "mean_abs_diff", "k1", "k3", "outside_band"]
# the small columns a summary reads (not the log-prob lists)
SUMMARY_COLUMNS = (
    *BATCH_KEYS,
    "step_key",
    "policy_version",
    *FIGURES,
    "band_low",
    "band_high",
    "loss",
    "train_step",
    "recorded_at",
)
# a trained token's log-prob above this is no log-probability (probabilities or logits given)
LOG_PROB_SLACK = 1e-3


def feedback_writer(dataset: str, consumer: str, rank: int) -> str:
    """The application id of one consumer rank's feedback on one dataset."""
    return f"claw.feedback.{dataset}.{consumer}.{int(rank)}"


# -- recording --------------------------------------------------------------------------------
def record_feedback(
    lake: Lake,
    dataset: str,
    batch: Batch,
    log_probs: Any,
    loss: Any = None,
    step: Any = None,
) -> bool:
    """`Dataset.record_feedback`: validate, then append one `gold/trainer_feedback` row per
    step of `batch` unless its feedback is on record already (guarded per consumer rank: a
    retried or concurrent call records once); True when this call recorded it. The batch's
    contract report then carries the mismatch on record (`feedback`)."""
    if batch.consumer is None or batch.rank is None or batch.batch_index is None:
        raise ValueError(
            "batch was never delivered: record_feedback takes a batch next_batch (or replay) "
            "returned, which knows its consumer, rank and batch_index"
        )
    values = checked_log_probs(batch, log_probs)
    rows = feedback_rows(
        batch,
        values,
        dataset,
        delivered_version(lake, dataset, batch),
        checked_loss(loss),
        checked_step(step),
    )
    rows = step_figures(rows, FEEDBACK_BAND)
    what = f"feedback on batch {batch.batch_index} of {batch.consumer} rank {batch.rank}"
    (recorded_now, on_record), _ = until_landed(
        lambda: _record_once(lake, dataset, batch, rows), what
    )
    if batch.contract is not None:
        batch.contract = replace(batch.contract, feedback=mismatch_of(on_record))
    return recorded_now


def _record_once(
    lake: Lake, dataset: str, batch: Batch, rows: pl.DataFrame
) -> tuple[bool, pl.DataFrame]:
    """One guarded attempt: (False, the rows on record) when the batch's feedback is there
    already, else (True, `rows`) appended."""
    lake.ensure(GOLD_TRAINER_FEEDBACK_SPEC)
    version = lake.version(GOLD_TRAINER_FEEDBACK)
    assert batch.consumer is not None and batch.rank is not None and batch.batch_index is not None
    on_record = lake.read(
        GOLD_TRAINER_FEEDBACK,
        version,
        columns=list(SUMMARY_COLUMNS),
        where=_of(dataset, batch.consumer, batch.rank)
        & (pl.col("batch_index") == batch.batch_index),
    )
    if on_record.height:
        return False, on_record
    writer = feedback_writer(dataset, batch.consumer, batch.rank)
    guard = Guard((writer,), int(batch.batch_index), {GOLD_TRAINER_FEEDBACK: version})
    lake.append(GOLD_TRAINER_FEEDBACK_SPEC, rows.to_arrow(), guard=guard)
    return True, rows


def _of(dataset: str, consumer: str | None = None, rank: int | None = None) -> pl.Expr:
    """The feedback rows of `dataset` (of one consumer, and rank, when given)."""
    where = pl.col("dataset") == dataset
    if consumer is not None:
        where &= pl.col("consumer") == consumer
    if rank is not None:
        where &= pl.col("rank") == rank
    return where


def _as_array(log_probs: Any) -> np.ndarray:
    """A numpy array or a torch tensor (any device, any float dtype) as float64 numpy."""
    if hasattr(log_probs, "detach"):  # a torch tensor (torch is not imported here)
        log_probs = log_probs.detach().to("cpu").float().numpy()
    try:
        return np.asarray(log_probs, dtype=np.float64)
    except (TypeError, ValueError):
        kind = type(log_probs).__name__
        raise ValueError(
            f"log_probs must be numbers (a numpy array or torch tensor), not {kind}"
        ) from None


def checked_log_probs(batch: Batch, log_probs: Any) -> np.ndarray:
    """`log_probs` (one per packed token of `batch`) as float64; ValueError naming what is
    wrong: its shape, or a non-finite or positive value at a trained token (loss_mask 1)."""
    values = _as_array(log_probs)
    want = batch.num_tokens
    if values.shape != (want,):
        raise ValueError(
            f"log_probs must hold one value per token of the batch (shape ({want},), as "
            f"batch.input_ids), not shape {values.shape}"
        )
    trained = batch.loss_mask.astype(bool)
    bad = np.flatnonzero(trained & ~np.isfinite(values))
    if len(bad):
        raise ValueError(
            f"log_probs is not finite at {len(bad)} trained token(s) (loss_mask 1), the first "
            f"at index {bad[0]} ({values[bad[0]]})"
        )
    over = np.flatnonzero(trained & (values > LOG_PROB_SLACK))
    if len(over):
        raise ValueError(
            f"log_probs must be log-probabilities (<= 0): {len(over)} trained token(s) above "
            f"0, the first at index {over[0]} ({values[over[0]]:.4g})"
        )
    return values


def checked_loss(loss: Any) -> float | None:
    """`loss` (a number or a one-element tensor) as a finite float; ValueError otherwise."""
    if loss is None:
        return None
    if hasattr(loss, "detach"):  # a torch tensor, perhaps still in the graph
        loss = loss.detach()
    try:
        value = float(loss)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"loss must be a number, not {type(loss).__name__}") from None
    if not math.isfinite(value):
        raise ValueError(f"loss must be finite, not {value}")
    return value


def checked_step(step: Any) -> int | None:
    """`step` (the trainer's step number) as a non-negative int; ValueError otherwise."""
    if step is None:
        return None
    try:
        if isinstance(step, bool):
            raise TypeError
        value = operator.index(step)
    except TypeError:
        raise ValueError(f"step must be an integer, not {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be at least 0, not {value}")
    return value


def delivered_version(lake: Lake, dataset: str, batch: Batch) -> int:
    """The dataset version `batch` was delivered at (its `gold/consumption` row of kind
    `next`, with the same steps); NotFound when no such delivery is on record."""
    what = f"batch {batch.batch_index} of consumer {batch.consumer!r} rank {batch.rank}"
    rows = pl.DataFrame()
    if lake.exists(GOLD_CONSUMPTION):
        rows = lake.read(
            GOLD_CONSUMPTION,
            columns=["dataset_version", "step_keys"],
            where=_of(dataset, batch.consumer, batch.rank)
            & (pl.col("batch_index") == batch.batch_index)
            & (pl.col("kind") == NEXT),
        )
    if rows.is_empty():
        raise NotFound(
            f"{what} was never delivered from dataset {dataset!r} (no gold/consumption row "
            "of kind 'next'): record_feedback takes batches next_batch or replay returned"
        )
    if set(rows["step_keys"][0]) != set(batch.step_keys):
        raise NotFound(
            f"{what} of dataset {dataset!r} was delivered with other steps than this batch holds"
        )
    return int(rows["dataset_version"][0])


def feedback_rows(
    batch: Batch,
    values: np.ndarray,
    dataset: str,
    dataset_version: int,
    loss: float | None,
    step: int | None,
) -> pl.DataFrame:
    """One `gold/trainer_feedback` row per step of `batch`: at each of its response tokens
    the trainer's log-prob (`values`, per packed token; null where not trained) and the
    behaviour log-prob the batch carried (null where none was captured)."""
    n = len(batch.step_keys)
    starts = batch.step_prompt_lens.tolist()
    response = [index[p:] for index, p in zip(batch.step_token_index, starts, strict=True)]
    lengths = np.fromiter((len(r) for r in response), dtype=np.int64, count=n)
    at = np.concatenate(response).astype(np.int64) if n else np.zeros(0, np.int64)
    offsets = pa.array(np.r_[0, np.cumsum(lengths)].astype(np.int32))
    trained = batch.loss_mask.astype(bool)[at]
    captured = batch.has_behaviour_log_probs[at]
    trainer = pa.array(values[at].astype(np.float32), mask=~trained)
    behaviour = pa.array(batch.behaviour_log_probs[at].astype(np.float32), mask=~captured)
    versions = batch.step_policy_versions
    if len(versions) != n:  # one partition's batch
        versions = np.full(n, batch.policy_version, dtype=np.int64)
    table = pa.table(
        {
            "consumer": pa.array([batch.consumer] * n, pa.string()),
            "dataset": pa.array([dataset] * n, pa.string()),
            "rank": pa.array([batch.rank] * n, pa.int64()),
            "batch_index": pa.array([batch.batch_index] * n, pa.int64()),
            "step_key": pa.array(batch.step_keys, pa.string()),
            "policy_version": pa.array(versions, pa.int64()),
            "dataset_version": pa.array([dataset_version] * n, pa.int64()),
            "trainer_log_probs": pa.ListArray.from_arrays(offsets, trainer),
            "behaviour_log_probs": pa.ListArray.from_arrays(offsets, behaviour),
            "loss": pa.array([loss] * n, pa.float64()),
            "train_step": pa.array([step] * n, pa.int64()),
            "recorded_at": pa.array([datetime.now(UTC)] * n, pa.timestamp("us", tz="UTC")),
        }
    )
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


# -- reading and the mismatch -----------------------------------------------------------------
def recorded(
    lake: Lake,
    dataset: str,
    consumer: str | None = None,
    rank: int | None = None,
    columns: tuple[str, ...] | None = SUMMARY_COLUMNS,
) -> pl.DataFrame:
    """The feedback rows on record for `dataset` (of one consumer, and rank, when given):
    `columns` of them (by default the small ones; None: every column)."""
    if not lake.exists(GOLD_TRAINER_FEEDBACK):
        empty = pl.from_arrow(GOLD_TRAINER_FEEDBACK_SPEC.schema.empty_table())
        assert isinstance(empty, pl.DataFrame)
        return empty if columns is None else empty.select(columns)
    wanted = None if columns is None else list(columns)
    return lake.read(GOLD_TRAINER_FEEDBACK, columns=wanted, where=_of(dataset, consumer, rank))


def figures(band: tuple[float, float]) -> list[pl.Expr]:
    """The mismatch figures (module doc) over token pairs (`b`, `t`), as aggregations."""
    low, high = band
    diff, log_ratio = pl.col("b") - pl.col("t"), pl.col("t") - pl.col("b")
    ratio = log_ratio.exp()
    return [
        pl.len().cast(pl.Int64).alias("tokens_compared"),
        diff.abs().mean().alias("mean_abs_diff"),
        diff.mean().alias("k1"),
        (ratio - 1 - log_ratio).mean().alias("k3"),
        ((ratio < low) | (ratio > high)).cast(pl.Float64).mean().alias("outside_band"),
    ]


def step_figures(rows: pl.DataFrame, band: tuple[float, float]) -> pl.DataFrame:
    """`rows` (feedback rows with their log-prob lists, one per step of a batch) with each
    step's mismatch figures over its tokens that carry both log-probs, against `band`
    (tokens_compared 0 and null figures where none does)."""
    keys = [*BATCH_KEYS, "step_key"]
    same = pl.col("behaviour_log_probs").list.len() == pl.col("trainer_log_probs").list.len()
    pairs = (
        rows.filter(same.fill_null(False))
        .select(*keys, b="behaviour_log_probs", t="trainer_log_probs")
        .explode("b", "t")
        .with_columns(pl.col("b", "t").cast(pl.Float64))
        .filter((pl.col("b").is_finite() & pl.col("t").is_finite()).fill_null(False))
    )
    found = pairs.group_by(keys).agg(figures(band))
    low, high = band
    return (
        rows.drop(FIGURES, "band_low", "band_high", strict=False)
        .join(found, on=keys, how="left", nulls_equal=True, maintain_order="left")
        .with_columns(
            pl.col("tokens_compared").fill_null(0),
            band_low=pl.lit(low, pl.Float64),
            band_high=pl.lit(high, pl.Float64),
        )
    )


def weighted_figures() -> list[pl.Expr]:
    """Steps' figures (FIGURES columns) combined: the tokens compared summed, each figure's
    mean weighted by them (the figure over all their tokens); null where none was compared."""
    tokens = pl.col("tokens_compared")
    total = tokens.sum()
    return [
        total.alias("tokens_compared"),
        *(
            pl.when(total > 0).then((pl.col(c) * tokens).sum() / total).alias(c)
            for c in FIGURES[1:]
        ),
    ]


def mismatch_of(rows: pl.DataFrame, band: tuple[float, float] = FEEDBACK_BAND) -> Mismatch:
    """The mismatch over every token of `rows` (feedback rows with their figures, computed
    against `band`)."""
    return Mismatch(band=band, **rows.select(weighted_figures()).row(0, named=True))


def check_band(band: tuple[float, float]) -> tuple[float, float]:
    """`band` as (low, high) floats with 0 <= low < 1 < high; ValueError otherwise."""
    try:
        low, high = (float(v) for v in band)
    except (TypeError, ValueError):
        raise ValueError(f"band must be two numbers (low, high), not {band!r}") from None
    if not 0 <= low < 1 < high:
        raise ValueError(f"band must hold 1 with 0 <= low < 1 < high, not ({low}, {high})")
    return low, high


@dataclass(frozen=True)
class FeedbackReport:
    """Behaviour vs trainer on everything trainers fed back on a dataset (module doc):
    overall, per policy version, per batch, and the `worst` steps (highest mean |b - t|)."""

    dataset: str
    consumer: str | None
    overall: Mismatch
    by_policy_version: pl.DataFrame  # policy_version, batches, steps, FIGURES
    by_batch: pl.DataFrame  # BATCH_KEYS, policy_versions, steps, loss, train_step, FIGURES
    worst_steps: pl.DataFrame  # step_key, policy_version, BATCH_KEYS, FIGURES

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for a trainer's logs)."""
        return {
            "dataset": self.dataset,
            "consumer": self.consumer,
            "overall": asdict(self.overall),
            "by_policy_version": self.by_policy_version.to_dicts(),
            "by_batch": self.by_batch.to_dicts(),
            "worst_steps": self.worst_steps.to_dicts(),
        }

    def __str__(self) -> str:
        who = "every consumer" if self.consumer is None else self.consumer
        lines = [f"trainer feedback on {self.dataset} ({who}): {self.overall}"]
        for row in self.by_policy_version.iter_rows(named=True):
            one = Mismatch(band=self.overall.band, **{k: row[k] for k in FIGURES})
            lines.append(f"  policy version {row['policy_version']}: {one}")
        for row in self.worst_steps.iter_rows(named=True):
            lines.append(f"  worst step {row['step_key']}: mean |b - t| {row['mean_abs_diff']:.4g}")
        return "\n".join(lines)


def mismatch_report(
    steps: pl.DataFrame,
    dataset: str,
    consumer: str | None = None,
    band: tuple[float, float] = FEEDBACK_BAND,
    worst: int = WORST_STEPS,
) -> FeedbackReport:
    """The report over feedback rows `steps` whose figures were computed against `band`."""
    per_version = steps.group_by("policy_version").agg(
        pl.struct(BATCH_KEYS).n_unique().cast(pl.Int64).alias("batches"),
        pl.len().cast(pl.Int64).alias("steps"),
        *weighted_figures(),
    )
    per_batch = steps.group_by(BATCH_KEYS).agg(
        pl.col("policy_version").unique().sort().alias("policy_versions"),
        pl.len().cast(pl.Int64).alias("steps"),
        pl.col("loss").first(),
        pl.col("train_step").first(),
        pl.col("recorded_at").max(),
        *weighted_figures(),
    )
    worst_steps = (
        steps.filter(pl.col("tokens_compared") > 0)
        .select("step_key", "policy_version", *BATCH_KEYS, *FIGURES)
        .sort(["mean_abs_diff", "step_key"], descending=[True, False])
        .head(worst)
    )
    return FeedbackReport(
        dataset,
        consumer,
        mismatch_of(steps, band),
        per_version.sort("policy_version"),
        per_batch.sort(BATCH_KEYS),
        worst_steps,
    )


def feedback_report(
    lake: Lake,
    dataset: str,
    consumer: str | None = None,
    band: tuple[float, float] = FEEDBACK_BAND,
    worst: int = WORST_STEPS,
) -> FeedbackReport:
    """`Dataset.feedback_report`: the mismatch over the feedback on record for `dataset`
    (of one consumer when given), from the steps' recorded figures; against another band
    than theirs, from their log-prob lists again."""
    band = check_band(band)
    if worst < 0:
        raise ValueError(f"worst must be at least 0, not {worst}")
    steps = recorded(lake, dataset, consumer)
    same_band = (steps["band_low"] == band[0]) & (steps["band_high"] == band[1])
    if not same_band.fill_null(False).all():
        steps = step_figures(recorded(lake, dataset, consumer, columns=None), band)
    return mismatch_report(steps, dataset, consumer, band, worst)

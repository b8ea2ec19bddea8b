"""Re-scoring stored steps with a versioned judge, without re-running anything.

A judge is a Python reward function with a name and a version:

    def judge(steps: polars.DataFrame) -> polars.Series: ...

`steps` has one row per step to score: `step_key`, `trajectory_uid`, `step_index`, `tenant`,
`prompt_ids`, `response_ids` (list<int32>, as silver stores them); the answer is one reward
per row, in row order (float; null: no opinion, nothing recorded). `claw rescore --judge
module:function` loads one (its version from `--judge-version`, else the function's
`judge_version` attribute); `exact-match` is built in: the demo's arithmetic verifier.

Every reward becomes a fact appended to bronze (a `feedback` record: `kind: reward`,
`source: judge`, `judge`, `judge_version`, the step as target), with an event id derived
from (judge, version, step): a rerun scores only the steps that judge version has not
scored, and a fact can never be recorded twice. Nothing is overwritten; the default reward
rule ignores judges' facts, a curation spec that names a judge (`reward_judge`) resolves
rewards from its facts (claw_pipelines.transforms.feedback).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    BRONZE_EVENTS_SPEC,
    SCHEMA_VERSION,
    SILVER_STEPS,
)
from claw_pipelines.gold import curated, source_versions
from claw_pipelines.lake import Lake
from claw_pipelines.silver import silver_state
from claw_pipelines.tokenization import IM_END, IM_START, encode, token_bytes

JudgeFunction = Callable[[pl.DataFrame], pl.Series]
RESCORE_WRITER = "rescore"  # the bronze `gateway_id` of judges' facts
# what a judge is given of each step
JUDGE_INPUT_COLUMNS = [
    "step_key",
    "trajectory_uid",
    "step_index",
    "tenant",
    "prompt_ids",
    "response_ids",
]


class JudgeError(ValueError):
    """A judge that cannot be loaded or answered wrongly (one line, names the judge)."""


@dataclass(frozen=True)
class Judge:
    """A named, versioned reward function."""

    name: str
    version: str
    score: JudgeFunction


@dataclass(frozen=True)
class RescoreRun:
    """What one re-scoring run did."""

    judge: str
    version: str
    candidates: int  # steps in scope
    already_scored: int
    scored: int  # steps given a reward now
    abstained: int  # steps the judge had no opinion on
    bronze_version: int | None
    seconds: float

    def summary(self) -> dict[str, Any]:
        """The run as a flat dict (for logs and the CLI)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# -- the built-in judge -------------------------------------------------------------------


@lru_cache(maxsize=1)
def _token_table() -> pa.Array:
    return pa.array(token_bytes(), pa.binary())


def decode_ids(ids: pa.ListArray | pa.ChunkedArray) -> pl.Series:
    """Texts of token-id lists with the bundled tokenizer (vectorized: byte lookup + join)."""
    table = _token_table()
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    pieces = pa.ListArray.from_arrays(ids.offsets, pc.take(table, ids.values))
    return pl.from_arrow(pc.binary_join(pieces, b"").cast(pa.large_string()))


SCAN_CHUNK = 1 << 20  # tokens compared per pass: a small buffer, reused (fresh pages cost)


def _positions(flat: np.ndarray, token: int) -> np.ndarray:
    """Where `token` occurs in `flat`."""
    hits = np.empty(min(len(flat), SCAN_CHUNK), dtype=bool)
    found = []
    for begin in range(0, len(flat), SCAN_CHUNK):
        chunk = flat[begin : begin + SCAN_CHUNK]
        found.append(np.flatnonzero(np.equal(chunk, token, out=hits[: len(chunk)])) + begin)
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def last_user_turns(prompts: pa.ListArray | pa.ChunkedArray) -> pa.ListArray:
    """Each prompt's last ChatML user turn (from `<|im_start|>user` to its `<|im_end|>`, or
    to the prompt's end), as token ids; empty when it has none. Found on the ids (numpy), so
    only those few tokens are decoded."""
    if isinstance(prompts, pa.ChunkedArray):
        prompts = prompts.combine_chunks()
    (start_id,), (user_id,), (end_id,) = encode(IM_START), encode("user"), encode(IM_END)
    flat = prompts.values.to_numpy(zero_copy_only=False)
    offsets = prompts.offsets.to_numpy()
    rows = len(offsets) - 1
    starts, ends = _positions(flat, start_id), _positions(flat, end_id)
    follows = starts + 1 < len(flat)
    opens = starts[follows][flat[starts[follows] + 1] == user_id]
    # each row's last opening with both its tokens inside the row (-1: none)
    last = np.full(rows, -1, np.int64)
    if len(opens):
        before_end = np.searchsorted(opens, offsets[1:] - 1, side="left") - 1
        candidate = opens[np.maximum(before_end, 0)]
        last = np.where((before_end >= 0) & (candidate >= offsets[:-1]), candidate, -1)
    begin = np.where(last >= 0, last, offsets[1:])
    after = np.searchsorted(ends, begin)
    stop = np.where(after < len(ends), ends[np.minimum(after, len(ends) - 1)] + 1, len(flat))
    stop = np.minimum(stop, offsets[1:])
    lengths = np.where(last >= 0, stop - begin, 0)
    index = np.repeat(begin - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
    new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(new_offsets), pa.array(flat[index], pa.int32()))


_QUESTION = r"What is (-?\d+) ([-+*]) (-?\d+)\?"


def exact_match(steps: pl.DataFrame) -> pl.Series:
    """The demo's arithmetic verifier: 1.0 when the last number of the response is the value
    of the `What is a op b?` in the step's last user turn, 0.0 when it is not, null when that
    turn asks no such question."""
    question = decode_ids(last_user_turns(steps["prompt_ids"].to_arrow()))
    answer = decode_ids(steps["response_ids"].to_arrow())
    parts = pl.DataFrame({"q": question, "a": answer}).select(
        a=pl.col("q").str.extract(_QUESTION, 1).cast(pl.Int64, strict=False),
        op=pl.col("q").str.extract(_QUESTION, 2),
        b=pl.col("q").str.extract(_QUESTION, 3).cast(pl.Int64, strict=False),
        said=pl.col("a").str.extract_all(r"-?\d+").list.last().cast(pl.Int64, strict=False),
    )
    expected = (
        pl.when(pl.col("op") == "+")
        .then(pl.col("a") + pl.col("b"))
        .when(pl.col("op") == "-")
        .then(pl.col("a") - pl.col("b"))
        .when(pl.col("op") == "*")
        .then(pl.col("a") * pl.col("b"))
    )
    rewards = parts.select(
        pl.when(expected.is_null())
        .then(None)
        .otherwise((pl.col("said") == expected).fill_null(False).cast(pl.Float64))
    )
    return rewards.to_series().alias("reward")


exact_match.judge_version = "1"  # type: ignore[attr-defined]
BUILTIN_JUDGES: dict[str, JudgeFunction] = {"exact-match": exact_match}


def load_judge(name: str, version: str | None = None) -> Judge:
    """A built-in judge by name, or `module:function` (its version: `version`, else the
    function's `judge_version`)."""
    if name in BUILTIN_JUDGES:
        score = BUILTIN_JUDGES[name]
    else:
        module_name, _, attribute = name.partition(":")
        if not attribute:
            known = ", ".join(sorted(BUILTIN_JUDGES))
            raise JudgeError(f"judge {name!r}: not built in ({known}); give module:function")
        try:
            score = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise JudgeError(f"judge {name!r}: cannot be loaded ({exc})") from None
    version = version or getattr(score, "judge_version", None)
    if not version:
        raise JudgeError(f"judge {name!r}: no version (pass --judge-version)")
    return Judge(name, str(version), score)


# -- re-scoring ---------------------------------------------------------------------------


def fact_id_prefix(judge: Judge) -> str:
    """What the event ids of one judge version's facts start with."""
    named = f"{judge.name}\x00{judge.version}".encode()
    return "judge-" + hashlib.blake2b(named, digest_size=8).hexdigest() + "-"


def fact_event_ids(judge: Judge, step_keys: pl.Series) -> pl.Series:
    """The event id of the judge version's fact about each step (the same on every rerun):
    the judge version's prefix, then the step key."""
    return (fact_id_prefix(judge) + step_keys).alias("event_id")


def scored_steps(lake: Lake, judge: Judge) -> pl.Series:
    """The step keys this judge version has a fact about in bronze (read off the facts'
    event ids: no payload is parsed)."""
    if not lake.exists(BRONZE_EVENTS):
        return pl.Series("step_key", [], dtype=pl.String)
    prefix = fact_id_prefix(judge)
    facts = lake.read(
        BRONZE_EVENTS,
        columns=["event_id"],
        where=(pl.col("gateway_id") == RESCORE_WRITER) & pl.col("event_id").str.starts_with(prefix),
    )
    return facts["event_id"].str.strip_prefix(prefix).alias("step_key")


def _step_rows(lake: Lake, version: int, wanted: pl.Series, everything: bool) -> pl.DataFrame:
    """The judge's columns of the `wanted` steps, read from only the files that hold them
    (new steps live in new files: an incremental run reads little)."""
    table = lake.open(SILVER_STEPS, version)
    files = table.file_uris()
    options = lake.storage_options or None
    if everything or not files:
        return lake.read(SILVER_STEPS, version, columns=JUDGE_INPUT_COLUMNS)
    where = pl.scan_parquet(files, include_file_paths="file", storage_options=options)
    holding = where.select("step_key", "file").filter(pl.col("step_key").is_in(wanted.implode()))
    needed = holding.select("file").unique().collect()["file"].to_list()
    if not needed:
        return pl.DataFrame(schema={c: pl.String for c in JUDGE_INPUT_COLUMNS}).head(0)
    rows = pl.scan_parquet(needed, storage_options=options)
    return (
        rows.select(JUDGE_INPUT_COLUMNS)
        .filter(pl.col("step_key").is_in(wanted.implode()))
        .collect()
    )


def _bronze_rows(judge: Judge, scored: pl.DataFrame, now: dt.datetime) -> pa.Table:
    """The judge's facts as `bronze/events` rows (`feedback` records, payload as the gateway
    would store a `POST /v1/feedback` of them)."""
    created = now.isoformat().replace("+00:00", "Z")
    payload = scored.select(
        pl.struct(
            target=pl.struct(step_key="step_key"),
            kind=pl.lit("reward"),
            value="reward",
            source=pl.lit("judge"),
            annotator=pl.lit(judge.name),
            judge=pl.lit(judge.name),
            judge_version=pl.lit(judge.version),
            created_at=pl.lit(created),
            metadata=pl.struct(rescored=pl.lit(True)),
            event_id="event_id",
        )
        .struct.json_encode()
        .alias("payload")
    )["payload"]
    count = scored.height
    rows = {
        "event_id": scored["event_id"].to_arrow(),
        "kind": pa.array(["feedback"] * count, pa.string()),
        "tenant": scored["tenant"].fill_null("default").to_arrow(),
        "received_at": pa.array([now] * count, pa.timestamp("us", tz="UTC")),
        "ingest_date": pa.array([now.date()] * count, pa.date32()),
        "gateway_id": pa.array([RESCORE_WRITER] * count, pa.string()),
        "batch_seq": pa.array(np.zeros(count, np.int64)),
        "schema_version": pa.array(np.full(count, SCHEMA_VERSION, np.int32)),
        "payload": payload.to_arrow(),
    }
    return pa.table(rows)


def rescore(
    lake: Lake,
    judge: Judge,
    spec: CurationSpec | None = None,
    now: dt.datetime | None = None,
) -> RescoreRun:
    """Score the steps in scope (a spec's kept steps, else every silver step) that this judge
    version has not scored yet; append their facts to bronze in one commit."""
    started = time.perf_counter()
    steps_version = silver_state(lake).versions.get(SILVER_STEPS)
    if steps_version is None:
        raise JudgeError("the lake has no silver steps yet: materialize silver first")
    keys = lake.read(SILVER_STEPS, steps_version, columns=["step_key"])["step_key"]
    if spec is not None:
        keys = curated(lake, spec, source_versions(lake))["step_key"]
    done = scored_steps(lake, judge)
    todo = keys.filter(~keys.is_in(done.implode())) if done.len() else keys
    todo = pl.DataFrame({"step_key": todo, "event_id": fact_event_ids(judge, todo)})
    everything = todo.height == keys.len() and spec is None
    steps = _step_rows(lake, steps_version, todo["step_key"], everything)
    steps = steps.join(todo, on="step_key", how="inner", maintain_order="left")
    empty = pl.Series([], dtype=pl.Float64)
    rewards = judge.score(steps.drop("event_id")) if steps.height else empty
    if len(rewards) != steps.height:
        raise JudgeError(f"judge {judge.name!r}: {len(rewards)} rewards for {steps.height} steps")
    scored = steps.select("step_key", "tenant", "event_id").with_columns(
        reward=pl.Series(rewards).cast(pl.Float64, strict=False)
    )
    finite = scored.filter(pl.col("reward").is_not_null() & pl.col("reward").is_finite())
    version = None
    if finite.height:
        now = now or dt.datetime.now(dt.UTC)
        metadata = {"rescore": judge.name, "judge_version": judge.version, "facts": finite.height}
        rows = _bronze_rows(judge, finite, now)
        version = lake.append(BRONZE_EVENTS_SPEC, rows, metadata=metadata)
    return RescoreRun(
        judge=judge.name,
        version=judge.version,
        candidates=keys.len(),
        already_scored=keys.len() - todo.height,
        scored=finite.height,
        abstained=steps.height - finite.height,
        bronze_version=version,
        seconds=round(time.perf_counter() - started, 3),
    )

"""Re-scoring stored steps with a versioned judge, without re-running anything.

A judge is a Python reward function with a name and a version:

    def judge(steps: polars.DataFrame) -> polars.Series: ...

`steps` has one row per step to score: `step_key`, `trajectory_uid`, `step_index`, `tenant`,
`prompt_ids`, `response_ids` (list<int32>, as silver stores them), `tokenizer` (the
fingerprint of the tokenizer the ids belong to) and, decoded with that tokenizer,
`last_user` (the text of the prompt's last user turn) and `reply` (the response's text, its
end-of-turn token dropped); the answer is one reward per row, in row order (float; null: no
opinion, nothing recorded). A step whose tokenizer is unknown (and no `--tokenizer` names it)
or that cannot be read is refused in one line, before anything is scored. `claw rescore --judge
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
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.errors import JudgeError
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    BRONZE_EVENTS_SPEC,
    SCHEMA_VERSION,
    SILVER_STEPS,
)
from claw_pipelines.lake.decoding import decode_steps, recorded_requests, resolver
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import prompt_columns, with_prompts
from claw_pipelines.lake.tokenizers import bundled_fingerprint
from claw_pipelines.materialize.gold import curated, source_versions
from claw_pipelines.materialize.silver import silver_state
from claw_pipelines.tokenization import IM_END, IM_START, decode_lists, encode

JudgeFunction = Callable[[pl.DataFrame], pl.Series]
RESCORE_WRITER = "rescore"  # the bronze `gateway_id` of judges' facts
# what a judge is given of each step
JUDGE_SCHEMA = {
    "step_key": pl.String,
    "trajectory_uid": pl.String,
    "step_index": pl.Int64,
    "tenant": pl.String,
    "prompt_ids": pl.List(pl.Int32),
    "response_ids": pl.List(pl.Int32),
    "tokenizer": pl.String,
}
JUDGE_INPUT_COLUMNS = list(JUDGE_SCHEMA)
# what is read of silver for them: prompts are stored relative to earlier steps (§18)
JUDGE_READ_COLUMNS = prompt_columns(JUDGE_INPUT_COLUMNS, SILVER_STEPS)


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
    incremental: bool  # only the steps silver added since the last run were looked at
    candidates: int  # steps looked at: in scope, or added since the last run
    already_scored: int
    scored: int  # steps given a reward now
    abstained: int  # steps the judge had no opinion on
    bronze_version: int | None
    seconds: float

    def summary(self) -> dict[str, Any]:
        """The run as a flat dict (for logs and the CLI)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# -- the built-in judge -------------------------------------------------------------------


SCAN_CHUNK = 1 << 20  # tokens compared per pass: a small buffer, reused (fresh pages cost)
TAIL_TOKENS = 64  # each prompt's last user turn is looked for in its last tokens first


def _positions(flat: np.ndarray, token: int) -> np.ndarray:
    """Where `token` occurs in `flat`."""
    hits = np.empty(min(len(flat), SCAN_CHUNK), dtype=bool)
    found = []
    for begin in range(0, len(flat), SCAN_CHUNK):
        chunk = flat[begin : begin + SCAN_CHUNK]
        found.append(np.flatnonzero(np.equal(chunk, token, out=hits[: len(chunk)])) + begin)
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _chatml_ids() -> tuple[int, int, int]:
    (start_id,), (user_id,), (end_id,) = encode(IM_START), encode("user"), encode(IM_END)
    return start_id, user_id, end_id


def _scanned_turns(flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(begin, stop) of each row's last user turn in `flat`, scanning every token (begin =
    stop: none)."""
    start_id, user_id, end_id = _chatml_ids()
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
    return begin, np.where(last >= 0, np.minimum(stop, offsets[1:]), begin)


def _first_hits(flat: np.ndarray, at: np.ndarray, bound: np.ndarray, step: int, wanted):
    """For each start position in `at`, the first position stepping by `step` (+1 or -1,
    all rows at once, TAIL_TOKENS steps at most) before `bound` is passed where `wanted(at)`
    holds: (positions, found, the rows still looking after TAIL_TOKENS steps)."""
    hits, found = np.zeros(len(at), np.int64), np.zeros(len(at), bool)
    pending, at, bound = np.arange(len(at)), at.astype(np.int64), bound.astype(np.int64)
    for _ in range(TAIL_TOKENS):
        inside = at >= bound if step < 0 else at < bound
        if not inside.all():
            pending, at, bound = pending[inside], at[inside], bound[inside]
        if not len(pending):
            break
        hit = np.flatnonzero(wanted(at))
        if len(hit):
            hits[pending[hit]], found[pending[hit]] = at[hit], True
            rest = np.ones(len(pending), bool)
            rest[hit] = False
            pending, at, bound = pending[rest], at[rest], bound[rest]
        at += step
    return hits, found, pending


def _tail_turns(flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(begin, stop, settled) from each row's last TAIL_TOKENS tokens: settled where the turn
    was found there or the row's start was reached."""
    start_id, user_id, end_id = _chatml_ids()
    row_start, row_end = offsets[:-1].astype(np.int64), offsets[1:].astype(np.int64)

    def opens(at: np.ndarray) -> np.ndarray:
        maybe = flat[at] == start_id
        maybe[maybe] = flat[at[maybe] + 1] == user_id
        return maybe

    begin, found, unsettled = _first_hits(flat, row_end - 2, row_start, -1, opens)
    settled = np.ones(len(row_end), bool)
    settled[unsettled] = False
    begin = np.where(found, begin, row_end)
    rows = np.flatnonzero(found)  # each turn runs to its <|im_end|>, else to the row's end
    closes = lambda at: flat[at] == end_id  # noqa: E731
    close, closed, _ = _first_hits(flat, begin[rows] + 2, row_end[rows], 1, closes)
    stop = begin.copy()
    stop[rows] = np.where(closed, close + 1, row_end[rows])
    return begin, stop, settled


def last_user_turns(prompts: pa.ListArray | pa.ChunkedArray) -> pa.ListArray:
    """Each prompt's last ChatML user turn (from `<|im_start|>user` to its `<|im_end|>`, or
    to the prompt's end), as token ids; empty when it has none. Found on the ids (numpy):
    in each prompt's tail, and by a scan of only the prompts whose tail holds none."""
    if isinstance(prompts, pa.ChunkedArray):
        prompts = prompts.combine_chunks()
    flat = prompts.values.to_numpy(zero_copy_only=False)
    offsets = prompts.offsets.to_numpy()
    begin, stop, settled = _tail_turns(flat, offsets)
    if not settled.all():  # e.g. tool turns after the question: scan just those prompts
        rows = np.flatnonzero(~settled)
        subset = prompts.take(pa.array(rows))
        sub_offsets = subset.offsets.to_numpy()
        sub_begin, sub_stop = _scanned_turns(subset.values.to_numpy(), sub_offsets)
        shift = offsets[rows] - sub_offsets[:-1]
        begin[rows], stop[rows] = sub_begin + shift, sub_stop + shift
    lengths = stop - begin
    index = np.repeat(begin - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum())
    new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(new_offsets), pa.array(flat[index], pa.int32()))


_QUESTION = r"What is (-?\d+) ([-+*]) (-?\d+)\?"
_LAST_NUMBER = r"(-?\d+)\D*$"


def exact_match(steps: pl.DataFrame) -> pl.Series:
    """The demo's arithmetic verifier: 1.0 when the last number of the reply is the value of
    the `What is a op b?` in the step's last user turn, 0.0 when it is not, null when that
    turn asks no such question."""
    question, answer = steps["last_user"], steps["reply"]
    asked = pl.col("q").str.extract_groups(_QUESTION).struct
    parts = pl.DataFrame({"q": question, "a": answer}).select(
        a=asked.field("1").cast(pl.Int64, strict=False),
        op=asked.field("2"),
        b=asked.field("3").cast(pl.Int64, strict=False),
        said=pl.col("a").str.extract(_LAST_NUMBER, 1).cast(pl.Int64, strict=False),
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


def judge_texts(lake: Lake, steps: pl.DataFrame, fallback: str | None = None) -> pl.DataFrame:
    """The steps with `last_user` and `reply` decoded with each step's tokenizer (the lake's
    copy; `fallback` for steps naming none): the bundled tokenizer's ChatML by scanning the
    ids for the last user turn (vectorized), others through claw_pipelines.lake.decoding.
    Undecodable names the first step that cannot be read."""
    resolve = resolver(lake, fallback)
    bundled = bundled_fingerprint()
    fingerprints = steps["tokenizer"]
    if fallback is not None:
        given = resolve(None)
        fingerprints = fingerprints.fill_null(given.fingerprint if given else None)
    steps = steps.with_columns(tokenizer=fingerprints)
    parts = []
    for (fingerprint,), group in steps.with_row_index("row").group_by(
        "tokenizer", maintain_order=True
    ):
        if fingerprint == bundled:
            texts = group.with_columns(
                last_user=decode_lists(last_user_turns(group["prompt_ids"].to_arrow())),
                reply=decode_lists(group["response_ids"].to_arrow()).str.strip_suffix(IM_END),
            )
        else:
            decoded = decode_steps(group, resolve, recorded_requests(lake, group))
            last = decoded.select(
                "step_key",
                last_user=pl.col("prompt_messages")
                .list.eval(pl.element().filter(pl.element().struct.field("role") == "user").last())
                .list.first()
                .struct.field("content"),
                reply=pl.col("reply").struct.field("content"),
            )
            texts = group.join(last, on="step_key", how="left", maintain_order="left")
        parts.append(texts)
    if not parts:
        return steps.with_columns(last_user=pl.lit(None, pl.String), reply=pl.lit(None, pl.String))
    return pl.concat(parts).sort("row").drop("row")


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


@dataclass(frozen=True)
class Watermark:
    """Where a judge version's last whole-silver run left off: every step in silver at
    `silver_version` was put to it; `bronze_version` is bronze's version when that run began
    (a run that saw later steps began after it, so its facts commit after that version), and
    `own_commit` the version of that run's own facts, if it had any."""

    silver_version: int
    bronze_version: int
    own_commit: int | None = None


def watermark_path(judge: Judge) -> str:
    """The lake file holding a judge version's watermark."""
    return f"rescore/{fact_id_prefix(judge).removesuffix('-')}.json"


def read_watermark(lake: Lake, judge: Judge) -> Watermark | None:
    """The judge version's watermark, if a run left one."""
    text = lake.read_text(watermark_path(judge))
    if text is None:
        return None
    mark = json.loads(text)
    return Watermark(mark["silver_version"], mark["bronze_version"], mark.get("own_commit"))


def _write_watermark(lake: Lake, judge: Judge, mark: Watermark) -> None:
    known = read_watermark(lake, judge)
    if known is not None and known.silver_version >= mark.silver_version:
        return  # a run that saw more of silver got here first
    text = {"judge": judge.name, "judge_version": judge.version, **asdict(mark)}
    lake.write_text(watermark_path(judge), json.dumps(text))


def _new_steps(lake: Lake, mark: Watermark, steps_version: int) -> pl.DataFrame | None:
    """The judge's columns of the steps silver added after the watermark (its change feed),
    or None when that range is not append-only (a repair rewrote silver, the log was
    cleaned up): then every step is looked at."""
    if steps_version < mark.silver_version:
        return None  # silver was rebuilt from scratch
    if steps_version == mark.silver_version:
        return pl.DataFrame(schema=JUDGE_SCHEMA)
    added = lake.changes(SILVER_STEPS, mark.silver_version, steps_version, JUDGE_READ_COLUMNS)
    if added is None:
        return None
    frame = pl.from_arrow(added).select(JUDGE_READ_COLUMNS)
    assert isinstance(frame, pl.DataFrame)
    return _whole_prompts(lake, steps_version, frame)


def _whole_prompts(lake: Lake, version: int, rows: pl.DataFrame) -> pl.DataFrame:
    """The judge's columns of silver `rows` (JUDGE_READ_COLUMNS) with whole prompts."""
    return with_prompts(lake, SILVER_STEPS, version, rows).select(JUDGE_INPUT_COLUMNS)


def _scored_since(lake: Lake, judge: Judge, mark: Watermark) -> pl.Series:
    """Steps this judge version scored in runs other than the watermark's that committed
    after it began (another process's run, or one whose watermark was lost): read only when
    such a commit exists."""
    empty = pl.Series("step_key", [], dtype=pl.String)
    if lake.version(BRONZE_EVENTS) is None:
        return empty
    for version, metadata in lake.commits_after(BRONZE_EVENTS, mark.bronze_version):
        ours = (metadata.get("rescore"), metadata.get("judge_version")) == (
            judge.name,
            judge.version,
        )
        if ours and version != mark.own_commit:
            return scored_steps(lake, judge)
    return empty


def _step_rows(lake: Lake, version: int, wanted: pl.Series) -> pl.DataFrame:
    """The judge's columns of the `wanted` steps, read from only the files that hold them
    (new steps live in new files: a run after a few new steps reads little)."""
    table = lake.open(SILVER_STEPS, version)
    files = table.file_uris()
    options = lake.storage_options or None
    if not files:
        return pl.DataFrame(schema=JUDGE_SCHEMA)
    where = pl.scan_parquet(files, include_file_paths="file", storage_options=options)
    holding = where.select("step_key", "file").filter(pl.col("step_key").is_in(wanted.implode()))
    needed = holding.select("file").unique().collect()["file"].to_list()
    if not needed:
        return pl.DataFrame(schema=JUDGE_SCHEMA)
    rows = pl.scan_parquet(needed, storage_options=options, missing_columns="insert")
    have = set(rows.collect_schema().names())
    found = (
        rows.select(c for c in JUDGE_READ_COLUMNS if c in have)
        .filter(pl.col("step_key").is_in(wanted.implode()))
        .collect()
    )
    return _whole_prompts(lake, version, found)


def _bronze_rows(judge: Judge, scored: pl.DataFrame, now: dt.datetime) -> pa.Table:
    """The judge's facts as `bronze/events` rows (`feedback` records, payload as the gateway
    would store a `POST /v1/feedback` of them)."""
    created = now.isoformat().replace("+00:00", "Z")
    rows = scored.select(
        "event_id",
        kind=pl.lit("feedback"),
        tenant=pl.col("tenant").fill_null("default"),
        received_at=pl.lit(now, pl.Datetime("us", "UTC")),
        ingest_date=pl.lit(now.date(), pl.Date),
        gateway_id=pl.lit(RESCORE_WRITER),
        batch_seq=pl.lit(0, pl.Int64),
        schema_version=pl.lit(SCHEMA_VERSION, pl.Int32),
        payload=_payload(judge, created),
    )
    return rows.to_arrow()


def _payload(judge: Judge, created: str) -> pl.Expr:
    """A fact's payload as JSON text: the judge's constant fields written once, the step key
    and event id JSON-encoded per row (a whole-struct encode costs twice as much)."""
    constant = {
        "kind": "reward",
        "source": "judge",
        "annotator": judge.name,
        "judge": judge.name,
        "judge_version": judge.version,
        "created_at": created,
        "metadata": {"rescored": True},
    }
    fields = json.dumps(constant, separators=(",", ":"))[1:-1]
    event_id = pl.struct("event_id").struct.json_encode().str.strip_prefix("{")
    return pl.concat_str(
        pl.lit('{"target":'),
        pl.struct("step_key").struct.json_encode(),
        pl.lit(',"value":'),
        pl.col("reward").cast(pl.String),
        pl.lit(f",{fields},"),
        event_id.str.strip_suffix("}"),
        pl.lit("}"),
    )


def _score(
    lake: Lake,
    judge: Judge,
    steps: pl.DataFrame,
    now: dt.datetime | None,
    tokenizer: str | None = None,
):
    """Put `steps` (the judge's columns and each fact's event_id) to the judge, with their
    texts decoded (`judge_texts`); append the rewards it gave as facts in one commit.
    (facts, abstentions, bronze version or None)."""
    empty = pl.Series([], dtype=pl.Float64)
    if steps.height:
        steps = judge_texts(lake, steps, tokenizer)
    rewards = judge.score(steps.drop("event_id")) if steps.height else empty
    if len(rewards) != steps.height:
        raise JudgeError(f"judge {judge.name!r}: {len(rewards)} rewards for {steps.height} steps")
    scored = steps.select("step_key", "tenant", "event_id").with_columns(
        reward=pl.Series(rewards).cast(pl.Float64, strict=False)
    )
    finite = scored.filter(pl.col("reward").is_not_null() & pl.col("reward").is_finite())
    if not finite.height:
        return 0, steps.height, None
    now = now or dt.datetime.now(dt.UTC)
    metadata = {"rescore": judge.name, "judge_version": judge.version, "facts": finite.height}
    version = lake.append(BRONZE_EVENTS_SPEC, _bronze_rows(judge, finite, now), metadata=metadata)
    return finite.height, steps.height - finite.height, version


def rescore(
    lake: Lake,
    judge: Judge,
    spec: CurationSpec | None = None,
    now: dt.datetime | None = None,
    full: bool = False,
    tokenizer: str | None = None,
) -> RescoreRun:
    """Score the steps in scope (a spec's kept steps, else every silver step) that this judge
    version has not scored yet; append their facts to bronze in one commit (`tokenizer`:
    the folder decoding steps that name none).

    Over all of silver, a run leaves a watermark and the next one reads only the steps added
    since (silver's change feed; `full` looks at every step again, e.g. to re-ask those the
    judge had no opinion on)."""
    started = time.perf_counter()
    bronze_began = lake.version(BRONZE_EVENTS) or 0
    steps_version = silver_state(lake).versions.get(SILVER_STEPS)
    if steps_version is None:
        raise JudgeError("the lake has no silver steps yet: materialize silver first")
    mark = None if spec is not None or full else read_watermark(lake, judge)
    new = None if mark is None else _new_steps(lake, mark, steps_version)
    if new is not None:  # only what silver added since the last run
        candidates = new.height
        done = _scored_since(lake, judge, mark) if new.height else None
        if done is not None and done.len():
            new = new.filter(~pl.col("step_key").is_in(done.implode()))
        steps = new.with_columns(event_id=fact_event_ids(judge, new["step_key"]))
    else:
        done = scored_steps(lake, judge)
        if not done.len() and spec is None:  # nothing scored yet: every step, as stored
            steps = lake.read(SILVER_STEPS, steps_version, columns=JUDGE_READ_COLUMNS)
            steps = _whole_prompts(lake, steps_version, steps)
            candidates = steps.height
        else:
            if spec is None:
                keys = lake.read(SILVER_STEPS, steps_version, columns=["step_key"])["step_key"]
            else:
                keys = curated(lake, spec, source_versions(lake))["step_key"]
            candidates = keys.len()
            steps = _step_rows(lake, steps_version, keys.filter(~keys.is_in(done.implode())))
        steps = steps.with_columns(event_id=fact_event_ids(judge, steps["step_key"]))
    scored, abstained, version = _score(lake, judge, steps, now, tokenizer)
    if spec is None:
        _write_watermark(lake, judge, Watermark(steps_version, bronze_began, version))
    return RescoreRun(
        judge=judge.name,
        version=judge.version,
        incremental=new is not None,
        candidates=candidates,
        already_scored=candidates - steps.height,
        scored=scored,
        abstained=abstained,
        bronze_version=version,
        seconds=round(time.perf_counter() - started, 3),
    )

"""Check a lake for inconsistencies, and repair them without losing an acknowledged record.

`check_lake` only reads: keys held twice in silver or gold, a silver watermark ahead of its
data, stored prefix trees that do not match their dataset's steps, and silver rows that fail
a blocking check. `repair_lake` keeps the first landing of every silver key (a later copy
with other tokens becomes a conflict), reads bronze again when the watermark cannot be
trusted, and rebuilds the affected gold partitions, whose lineage rows say what was repaired.
Every write goes through the same guarded commits as the pipelines, so a repair may run
beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import polars as pl

from claw_pipelines.consume.dataset import BATCH_STEP_COLUMNS, Dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_LINEAGE,
    SHARD_LEASES,
    SILVER_FEEDBACK,
    SILVER_STEP_CONFLICTS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    gold_dataset_table,
    gold_tree_table,
)
from claw_pipelines.lake.catalog import gold_datasets
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import prompt_columns, scope_of, with_prompts
from claw_pipelines.lake.specs import SpecError, load_spec
from claw_pipelines.materialize.gold import Curations, build_partition, policy_versions
from claw_pipelines.materialize.silver import (
    SILVER_TABLES,
    SilverOptions,
    build_silver,
    dedupe_silver,
    silver_state,
)
from claw_pipelines.ops.shards import shard_problems
from claw_pipelines.transforms.hashing import content_hashes
from claw_pipelines.transforms.quality import (
    Finding,
    inconsistent_lengths,
    rewards_are_finite,
    step_keys_are_unique,
)

Kind = Literal["duplicates", "watermark", "trees", "bad_rows", "shards"]
SILVER_KEYS = {
    SILVER_STEPS: "step_key",
    SILVER_FEEDBACK: "feedback_id",
    SILVER_STEP_CONFLICTS: "event_id",
    SILVER_STEP_REWARDS: "step_key",
    SILVER_TRAJECTORIES: "trajectory_uid",
}
CHECK_TRAJECTORIES = 20_000  # trajectories decoded at a time when silver's prompts are checked
REPAIR_HINT = "`claw check` lists the lake's problems; `claw repair` fixes them"


@dataclass(frozen=True)
class Problem:
    """One inconsistency: where, what kind, how many rows and a few of their keys."""

    table: str
    kind: Kind
    what: str
    count: int = 0
    sample: list[str] = field(default_factory=list)
    dataset: str | None = None

    def __str__(self) -> str:
        shown = f"; e.g. {', '.join(self.sample[:3])}" if self.sample else ""
        counted = f" ({self.count}{shown})" if self.count else ""
        return f"{self.table}: {self.what}{counted}"


@dataclass
class RepairReport:
    """What a repair found, did, and what is still wrong after it (nothing, normally)."""

    found: list[Problem]
    silver_removed: dict[str, int] = field(default_factory=dict)
    bronze_reread: bool = False
    rebuilt: list[tuple[str, int]] = field(default_factory=list)
    remaining: list[Problem] = field(default_factory=list)


def _from(finding: Finding, table: str, kind: Kind, what: str, **extra) -> list[Problem]:
    if finding.passed:
        return []
    return [Problem(table, kind, what, finding.failures, finding.sample, **extra)]


def check_lake(lake: Lake) -> list[Problem]:
    """Every inconsistency in the lake's silver and gold tables, and every shard of its split
    that is not well (an empty list: none)."""
    shards = [Problem(SHARD_LEASES, "shards", line) for line in shard_problems(lake)]
    return [*_silver_problems(lake), *_gold_problems(lake), *shards]


def _silver_problems(lake: Lake) -> list[Problem]:
    if not lake.exists(SILVER_STEPS):
        return []
    problems = []
    for table, key in SILVER_KEYS.items():
        if lake.exists(table):
            keys = lake.read(table, columns=[key])[key]
            problems += _from(step_keys_are_unique(keys), table, "duplicates", f"{key} held twice")
    events = lake.read(SILVER_STEPS, columns=["event_id"])["event_id"]
    problems += _from(
        step_keys_are_unique(events.drop_nulls()), SILVER_STEPS, "duplicates", "event_id held twice"
    )
    state, bronze = silver_state(lake), lake.version(BRONZE_EVENTS)
    if state.bronze_version is not None and (bronze is None or state.bronze_version > bronze):
        what = f"silver has read up to bronze v{state.bronze_version}, but bronze is at v{bronze}"
        problems.append(Problem(BRONZE_EVENTS, "watermark", what))
    for table in SILVER_TABLES:
        pinned, current = state.versions.get(table), lake.version(table)
        if pinned is not None and (current is None or pinned > current):
            what = f"the last silver run recorded v{pinned}, but the table is at v{current}"
            problems.append(Problem(table, "watermark", what))
    bad = lake.scan(SILVER_STEPS).filter(inconsistent_lengths()).select("step_key").collect()
    problems += _from(
        Finding.of(bad["step_key"], 0),
        SILVER_STEPS,
        "bad_rows",
        "log-probs or masks of another length than the response (not repairable: fix the writer)",
    )
    problems += _prompt_problems(lake, SILVER_STEPS)
    problems += _from(
        rewards_are_finite(lake.read(SILVER_FEEDBACK)),
        SILVER_FEEDBACK,
        "bad_rows",
        "rewards that are not finite numbers (not repairable: fix the writer)",
    )
    return problems


def _gold_problems(lake: Lake) -> list[Problem]:
    problems = []
    for name in gold_datasets(lake):
        dataset = Dataset(lake, name)
        steps = lake.read(gold_dataset_table(name), columns=[*BATCH_STEP_COLUMNS, "policy_version"])
        problems += _from(
            step_keys_are_unique(steps["step_key"]),
            gold_dataset_table(name),
            "duplicates",
            "step_key held twice",
            dataset=name,
        )
        problems += _prompt_problems(lake, gold_dataset_table(name), dataset=name)
        for (version,), partition in steps.group_by("policy_version"):
            if dataset.stored_trees(int(version), partition) is None:
                what = f"the stored trees of policy version {version} do not match its steps"
                problems.append(Problem(gold_tree_table(name), "trees", what, dataset=name))
    return problems


def _prompt_problems(lake: Lake, table: str, dataset: str | None = None) -> list[Problem]:
    """Steps whose stored prompt does not decode (docs/DESIGN.md §18): a reference to a step
    not there, of another trajectory (silver) or tree (gold), to more tokens than it has, or
    a length that does not add up; in silver, also any decoded prompt whose content id is not
    its `prompt_id` (read a bounded number of trajectories at a time)."""
    scope = scope_of(table)
    if "prefix_step_key" not in lake.scan(table).collect_schema().names():
        return []  # a table written before the layout: its prompts are whole
    steps = (
        lake.scan(table)
        .select(
            "step_key",
            "prompt_len",
            "response_len",
            "prefix_step_key",
            "prefix_len",
            *scope,
            suffix=pl.col("prompt_suffix_ids").list.len(),
        )
        .collect()
    )
    targets = steps.select(
        prefix_step_key="step_key",
        target_len=pl.col("prompt_len") + pl.col("response_len"),
        **{f"target_{c}": c for c in scope},
    )
    twice = steps.filter(pl.col("step_key").is_duplicated())["step_key"].unique()
    linked = steps.filter(  # a key held twice is ambiguous: the duplicates check reports it
        pl.col("prefix_step_key").is_not_null() & ~pl.col("prefix_step_key").is_in(twice.implode())
    ).join(targets, on="prefix_step_key", how="left")
    same = pl.all_horizontal(pl.col(c).eq_missing(pl.col(f"target_{c}")) for c in scope)
    broken = linked.filter(
        pl.col("target_len").is_null()
        | ~same
        | (pl.col("prefix_len") <= 0)
        | (pl.col("prefix_len") > pl.col("target_len"))
    )["step_key"]
    adds_up = pl.col("prefix_len").fill_null(0) + pl.col("suffix") == pl.col("prompt_len")
    short = steps.filter(pl.col("suffix").is_not_null() & ~adds_up)["step_key"]
    wrong = pl.concat([broken, short]).unique()
    if table == SILVER_STEPS and wrong.is_empty() and twice.is_empty():
        wrong = _prompts_not_their_ids(lake, steps["trajectory_uid"].unique())
    what = "prompts that do not decode to the stored prompt (a reference missing or wrong)" + (
        "" if dataset else "; not repairable: fix the writer"
    )
    extra = {"dataset": dataset} if dataset else {}
    return _from(Finding.of(wrong, steps.height), table, "bad_rows", what, **extra)


def _prompts_not_their_ids(lake: Lake, trajectories: pl.Series) -> pl.Series:
    """Silver steps whose decoded prompt's content id is not their `prompt_id`, read a range
    of trajectories at a time (rows are sorted by key, so a range's row groups are few)."""
    wrong = []
    columns = prompt_columns(
        ["step_key", "prompt_id", "prompt_ids", "trajectory_uid"], SILVER_STEPS
    )
    ordered = trajectories.drop_nulls().sort()
    for first in range(0, ordered.len(), CHECK_TRAJECTORIES):
        chunk = ordered.slice(first, CHECK_TRAJECTORIES)
        within = pl.col("trajectory_uid").is_between(pl.lit(chunk[0]), pl.lit(chunk[-1]))
        rows = with_prompts(
            lake, SILVER_STEPS, None, lake.read(SILVER_STEPS, None, columns, within)
        )
        ids = pl.Series(content_hashes(rows["prompt_ids"].to_arrow()), dtype=pl.String)
        wrong.append(rows.filter(ids.ne_missing(rows["prompt_id"]))["step_key"])
    return pl.concat(wrong) if wrong else pl.Series("step_key", [], pl.String)


def _spec_of(lake: Lake, name: str) -> CurationSpec:
    """The dataset's spec; the one its last build recorded when the file is gone or broken."""
    try:
        return load_spec(lake, name)
    except SpecError:
        recorded = (
            lake.scan(GOLD_LINEAGE)
            .filter(pl.col("dataset") == name)
            .sort("written_at")
            .select("spec_json")
            .collect()
        )
        return CurationSpec.model_validate_json(recorded["spec_json"][-1])


def repair_lake(
    lake: Lake,
    options: SilverOptions | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> RepairReport:
    """Repair what `check_lake` finds (see the module doc); the report says what was done."""
    report = RepairReport(found=check_lake(lake))
    silver_wrong = [p for p in report.found if p.table.startswith("silver/")]
    if any(p.kind == "duplicates" for p in silver_wrong):
        progress("keeping the first landing of every silver key")
        report.silver_removed = dedupe_silver(lake, options)
    if any(p.kind == "watermark" for p in report.found):
        progress("reading all of bronze again (what silver holds is recognised and kept once)")
        build_silver(lake, options, full=True)
        report.bronze_reread = True
    silver_changed = bool(report.silver_removed) or report.bronze_reread
    broken = {p.dataset for p in report.found if p.dataset is not None}
    reason = "repair: " + "; ".join(str(p) for p in report.found if p.kind != "bad_rows")
    for name in gold_datasets(lake):
        if silver_changed or name in broken:
            spec, curations = _spec_of(lake, name), Curations()
            for version in policy_versions(lake):
                progress(f"rebuilding {name} policy version {version}")
                build_partition(lake, spec, version, reason[:2000], curations)
                report.rebuilt.append((name, version))
    report.remaining = check_lake(lake)
    return report

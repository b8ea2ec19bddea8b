"""The contract report of a batch: the checks it satisfies, computed as it is handed out.

Every batch `Dataset.batches` / `next_batch` / `replay` returns carries `batch.contract`: the
dataset's spec hash, and one `ContractCheck` per promise, with the step keys that break it:
- `spec_hash`: every step was curated by the spec its partition's lineage names;
- `staleness`: no step is older than the spec's `max_policy_staleness` allows now;
- `group_completeness`: every step is of a complete trajectory in a group that met the
  spec's waiting rules (not one released incomplete at its deadline);
- `turns_nest`: step t+1 of a trajectory extends step t's prompt + response token for token
  (a turn that does not is forked, or drifted when an agent's history was re-rendered);
- `masks`: every step's token indices rebuild a sequence of its length, its positions count
  0..n-1 and its parents chain along it (trees and flat alike);
- `filters`: every step passes each of the spec's filters now (with how many steps each
  reason left out of the partitions, from gold/rejections).
A spec lists in `blocking` the checks a batch must pass: one that fails is refused
(`ContractViolation`, naming the rows), never returned: `batches` records nothing, and
`next_batch` records the refusal (kind `refused`), so the next call moves on to other groups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import polars as pl

from claw_pipelines.contracts.specs import CONTRACT_CHECKS, CurationSpec
from claw_pipelines.transforms.curation import step_checks

SHOWN_ROWS = 20
# the gold/datasets columns the checks read (beside the batch's own)
CONTRACT_COLUMNS = [
    "step_key",
    "trajectory_uid",
    "step_index",
    "policy_version",
    "prompt_len",
    "response_len",
    "spec_hash",
    "trajectory_status",
    "admission",
    "reward",
    "reward_status",
    "rating",
    "labels",
    "token_source",
    "finish_reason",
    "source_kind",
    "tenant",
    "trajectory_return",
]


@dataclass(frozen=True)
class ContractCheck:
    """One promise about a batch: whether it holds, in words, and the rows that break it."""

    name: str
    passed: bool
    detail: str
    failures: int = 0
    rows: list[str] = field(default_factory=list)  # the first SHOWN_ROWS offending step keys
    blocking: bool = False


@dataclass(frozen=True)
class ContractReport:
    """The checks one batch satisfies, and the spec they were judged against."""

    dataset: str
    dataset_version: int
    spec_hash: str | None
    checks: list[ContractCheck]
    left_out: dict[str, int] = field(default_factory=dict)  # steps per rejection reason

    @property
    def passed(self) -> bool:
        """Whether every check holds."""
        return all(check.passed for check in self.checks)

    def check(self, name: str) -> ContractCheck:
        """One check by name."""
        return next(c for c in self.checks if c.name == name)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values (for a trainer's logs)."""
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"contract of {self.dataset} v{self.dataset_version} (spec {self.spec_hash})"]
        for c in self.checks:
            mark = "ok  " if c.passed else ("FAIL" if c.blocking else "warn")
            lines.append(f"  {mark} {c.name}: {c.detail}")
        return "\n".join(lines)


class ContractViolation(RuntimeError):
    """A batch that breaks a check its spec makes blocking; names the checks and rows."""

    def __init__(self, report: ContractReport, failed: list[ContractCheck]) -> None:
        self.report, self.failed = report, failed
        parts = [
            f"{c.name} ({c.detail}; rows: {', '.join(c.rows)}"
            + (", ..." if c.failures > len(c.rows) else "")
            + ")"
            for c in failed
        ]
        super().__init__(
            f"batch of {report.dataset} v{report.dataset_version} refused: " + "; ".join(parts)
        )


def _check(name: str, offending: pl.Series, detail: str, blocking: set[str]) -> ContractCheck:
    keys = offending.to_list()
    return ContractCheck(name, not keys, detail, len(keys), keys[:SHOWN_ROWS], name in blocking)


def nesting_breaks(rows: pl.DataFrame, index: dict[str, np.ndarray], input_ids: np.ndarray):
    """(pairs of consecutive turns in the batch, the later step keys of those that do not
    nest): step t+1's first n tokens equal step t's n tokens."""
    turns = rows.select("step_key", "trajectory_uid", "step_index").sort(
        "trajectory_uid", "step_index"
    )
    pairs = turns.with_columns(
        before=pl.col("step_key").shift(1).over("trajectory_uid"),
        gap=pl.col("step_index").diff().over("trajectory_uid"),
    ).filter(pl.col("gap") == 1)
    if pairs.is_empty():
        return 0, pl.Series("step_key", [], pl.String)
    earlier = [index[k] for k in pairs["before"]]
    later = [index[k] for k in pairs["step_key"]]
    sizes = np.array([len(e) for e in earlier], dtype=np.int64)
    fits = np.array([len(lt) >= len(e) for e, lt in zip(earlier, later, strict=True)])
    sizes = np.where(fits, sizes, 0)  # a later turn shorter than the earlier one: forked
    a = np.concatenate([e[:n] for e, n in zip(earlier, sizes, strict=True)])
    b = np.concatenate([lt[:n] for lt, n in zip(later, sizes, strict=True)])
    owner = np.repeat(np.arange(len(sizes)), sizes)
    mismatches = np.bincount(owner, weights=input_ids[a] != input_ids[b], minlength=len(sizes))
    nests = fits & (mismatches == 0)
    return pairs.height, pairs["step_key"].filter(pl.Series(~nests))


def mask_breaks(
    rows: pl.DataFrame, index: dict[str, np.ndarray], position_ids: np.ndarray, parent: np.ndarray
) -> pl.Series:
    """Step keys whose token indices do not rebuild a sequence of their length, whose
    positions do not count 0..n-1 or whose parents do not chain along it."""
    keys = rows["step_key"].to_list()
    want = (rows["prompt_len"] + rows["response_len"]).to_numpy()
    got = np.array([len(index[k]) for k in keys], dtype=np.int64)
    flat = np.concatenate([index[k] for k in keys] or [np.zeros(0, int)]).astype(np.int64)
    starts = np.r_[0, np.cumsum(got)[:-1]].astype(np.int64)
    along = np.arange(len(flat)) - np.repeat(starts, got)
    owner = np.repeat(np.arange(len(keys)), got)
    wrong_position = position_ids[flat] != along
    chained = np.where(along == 0, -1, np.r_[-1, flat[:-1]])
    wrong_parent = parent[flat] != chained
    broken = np.zeros(len(keys), dtype=bool)
    np.logical_or.at(broken, owner, wrong_position | wrong_parent)
    broken |= got != want
    return rows["step_key"].filter(pl.Series(broken))


def contract_report(
    dataset: str,
    dataset_version: int,
    spec: CurationSpec | None,
    partition_hashes: dict[int, str],
    rows: pl.DataFrame,
    batch: Any,
    floor: int | None,
    left_out: dict[str, int],
) -> ContractReport:
    """The report of `batch` (a consume.Batch) over its steps' gold rows (`rows`:
    CONTRACT_COLUMNS), against the spec its lineage names (`partition_hashes`: the spec hash
    per policy version), the staleness floor now, and the partitions' rejection counts."""
    blocking = set(spec.blocking) if spec is not None else set()
    index = dict(zip(batch.step_keys, batch.step_token_index, strict=True))
    rows = rows.filter(pl.col("step_key").is_in(list(index)))
    expected = rows["policy_version"].replace_strict(partition_hashes, default=None)
    wrong_spec = rows["step_key"].filter(rows["spec_hash"].ne_missing(expected))
    stale = rows["step_key"].filter(
        pl.Series([False] * rows.height) if floor is None else rows["policy_version"] < floor
    )
    incomplete = rows.filter(
        (pl.col("trajectory_status") != "complete").fill_null(True)
        | (pl.col("admission") == "deadline").fill_null(False)
    )["step_key"]
    pairs, forked = nesting_breaks(rows, index, batch.input_ids)
    masks = mask_breaks(rows, index, batch.position_ids, batch.parent)
    failing = pl.Series("step_key", [], pl.String)
    filters: list[str] = []
    if spec is not None and rows.height:
        top = int(rows["policy_version"].max())
        checks = step_checks(spec, top)
        checks.pop("superseded")  # not a gold column (gold keeps no retry orphans)
        checks.pop("stale")  # the staleness check's, against the floor now
        verdict = rows.select("step_key", ok=pl.all_horizontal(list(checks.values())))
        failing = verdict.filter(~pl.col("ok"))["step_key"]
        filters = list(checks)
    trajectories = rows["trajectory_uid"].n_unique()
    left = ", ".join(f"{reason} {n}" for reason, n in sorted(left_out.items())) or "none"
    checks_out = [
        _check(
            "spec_hash",
            wrong_spec,
            f"{rows.height - wrong_spec.len()} of {rows.height} steps curated by spec "
            f"{', '.join(sorted(set(partition_hashes.values()))) or '(no lineage)'}",
            blocking,
        ),
        _check(
            "staleness",
            stale,
            "no staleness bound" if floor is None else f"policy versions >= {floor} only",
            blocking,
        ),
        _check(
            "group_completeness",
            incomplete,
            f"{incomplete.len()} steps (of {trajectories} trajectories) incomplete or released "
            "at their deadline",
            blocking,
        ),
        _check(
            "turns_nest",
            forked,
            f"{pairs - forked.len()} of {pairs} consecutive turns nest, {forked.len()} forked",
            blocking,
        ),
        _check("masks", masks, f"{rows.height - masks.len()} of {rows.height} steps", blocking),
        _check(
            "filters",
            failing,
            f"{rows.height - failing.len()} of {rows.height} steps pass "
            f"{', '.join(filters) or 'no filter'}; left out of these partitions: {left}",
            blocking,
        ),
    ]
    assert [c.name for c in checks_out] == list(CONTRACT_CHECKS)
    return ContractReport(
        dataset, dataset_version, spec.spec_hash if spec else None, checks_out, left_out
    )


def blocking_failures(report: ContractReport) -> list[ContractCheck]:
    """The checks the batch fails that its spec makes blocking (refuse it if any)."""
    return [c for c in report.checks if c.blocking and not c.passed]

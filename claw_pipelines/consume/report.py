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
  reason left out of the partitions, from gold/rejections);
- `exact_ids`: every step's token ids are exactly what the model saw and sampled (token
  source `upstream`, `client`, or `local` confirmed by the server's counts), with the
  batch's steps per token source.
A spec lists in `blocking` the checks a batch must pass: one that fails is refused
(`ContractViolation`, naming the rows), never returned: `batches` records nothing, and
`next_batch` records the refusal (kind `refused`), so the next call moves on to other groups.

Once its trainer fed the batch back (`Dataset.record_feedback`; `replay` finds what was
recorded), the report also carries `feedback`: the `Mismatch` between the behaviour policy's
log-probs and the trainer's on the batch's tokens (`consume.feedback` computes it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import polars as pl

from claw_pipelines.contracts.specs import CONTRACT_CHECKS, EXACT_TOKEN_SOURCES, CurationSpec
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
    "has_log_probs",
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
class Mismatch:
    """Behaviour vs trainer log-probs over `tokens_compared` response tokens that carry both
    (b, t; r = exp(t - b)): mean |b - t|, the KL estimates k1 = mean(b - t) and k3 =
    mean(r - 1 - log r), and the share of ratios r outside `band` (None: no token compared)."""

    tokens_compared: int
    mean_abs_diff: float | None
    k1: float | None
    k3: float | None
    outside_band: float | None
    band: tuple[float, float]

    def __str__(self) -> str:
        if not self.tokens_compared:
            return "no token carries both log-probs"
        low, high = self.band
        return (
            f"{self.tokens_compared:,} tokens, mean |b - t| {self.mean_abs_diff:.4g}, "
            f"k1 {self.k1:.4g}, k3 {self.k3:.4g}, "
            f"{self.outside_band:.1%} of ratios outside [{low}, {high}]"
        )


@dataclass(frozen=True)
class ContractReport:
    """The checks one batch satisfies, and the spec they were judged against."""

    dataset: str
    dataset_version: int
    spec_hash: str | None
    checks: list[ContractCheck]
    left_out: dict[str, int] = field(default_factory=dict)  # steps per rejection reason
    feedback: Mismatch | None = None  # once its trainer fed it back (module doc)

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
        if self.feedback is not None:
            lines.append(f"  trainer feedback: {self.feedback}")
        return "\n".join(lines)


def nesting_breaks(rows: pl.DataFrame, index: dict[str, np.ndarray], input_ids: np.ndarray):
    """(the later step keys of every pair of consecutive turns in `rows`, those of the pairs
    that do not nest): step t+1's first n tokens equal step t's n tokens. In a prefix tree a
    token stands for its whole prefix, so a pair whose n-th tokens are one token nests; only
    the others (flat layouts, forks) are compared token by token."""
    turns = rows.select("step_key", "trajectory_uid", "step_index").sort(
        "trajectory_uid", "step_index"
    )
    pairs = turns.with_columns(
        before=pl.col("step_key").shift(1).over("trajectory_uid"),
        gap=pl.col("step_index").diff().over("trajectory_uid"),
    ).filter(pl.col("gap") == 1)
    if pairs.is_empty():
        return set(), set()
    earlier = [index[k] for k in pairs["before"]]
    later = [index[k] for k in pairs["step_key"]]
    sizes = np.fromiter((len(e) for e in earlier), dtype=np.int64, count=len(earlier))
    fits = np.fromiter(
        (len(lt) >= len(e) > 0 for e, lt in zip(earlier, later, strict=True)),
        dtype=bool,
        count=len(earlier),
    )
    same_node = np.fromiter(
        (ok and lt[len(e) - 1] == e[-1] for e, lt, ok in zip(earlier, later, fits, strict=True)),
        dtype=bool,
        count=len(earlier),
    )
    compare = np.flatnonzero(fits & ~same_node)
    nests = same_node.copy()
    if len(compare):
        a = np.concatenate([earlier[i] for i in compare])
        b = np.concatenate([later[i][: sizes[i]] for i in compare])
        owner = np.repeat(np.arange(len(compare)), sizes[compare])
        mismatches = np.bincount(
            owner, weights=input_ids[a] != input_ids[b], minlength=len(compare)
        )
        nests[compare] = mismatches == 0
    return set(pairs["step_key"]), set(pairs["step_key"].filter(pl.Series(~nests)))


def mask_breaks(
    rows: pl.DataFrame, index: dict[str, np.ndarray], position_ids: np.ndarray, parent: np.ndarray
) -> set[str]:
    """Step keys whose sequence is not laid out right: a step's token indices must number
    its length, run from a root to a token at position length - 1, and every token's
    position must be its parent's plus one (0 at a root), so positions count 0..n-1 along
    each step's path. O(tokens laid out + steps)."""
    keys = rows["step_key"].to_list()
    want = (rows["prompt_len"] + rows["response_len"]).to_numpy()
    pieces = [index[k] for k in keys]
    got = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    first = np.fromiter((p[0] if len(p) else -1 for p in pieces), dtype=np.int64, count=len(keys))
    last = np.fromiter((p[-1] if len(p) else -1 for p in pieces), dtype=np.int64, count=len(keys))
    expected = position_ids[parent] + 1  # a root (-1) reads the last token: set to 0 next
    expected[parent < 0] = 0
    bad_token = np.flatnonzero(position_ids != expected)
    empty = got == 0
    safe_first, safe_last = np.maximum(first, 0), np.maximum(last, 0)
    broken = (got != want) | (
        ~empty & ((parent[safe_first] >= 0) | (position_ids[safe_last] != got - 1))
    )
    if len(bad_token):  # the steps whose path holds a badly placed token
        bad = set(bad_token.tolist())
        broken |= np.fromiter(
            (not bad.isdisjoint(p.tolist()) for p in pieces), dtype=bool, count=len(keys)
        )
    return set(rows["step_key"].filter(pl.Series(broken)))


@dataclass
class Verdicts:
    """Per check, the step keys that break it, over some steps (a partition laid out for
    training, or one batch); `report` reads off any batch of them."""

    spec: CurationSpec | None
    partition_hashes: dict[int, str]
    floor: int | None
    left_out: dict[str, int]
    failing: dict[str, set[str]]
    turn_pairs: set[str]  # the later step of every pair of consecutive turns
    filters: list[str]
    trajectory_of: dict[str, str]
    token_source_of: dict[str, str | None]

    def report(self, dataset: str, dataset_version: int, step_keys: list[str]) -> ContractReport:
        """The contract report of a batch of these steps."""
        blocking = set(self.spec.blocking) if self.spec is not None else set()
        n = len(step_keys)

        def check(name: str, detail: str) -> ContractCheck:
            broken = [k for k in step_keys if k in self.failing[name]] if self.failing[name] else []
            return ContractCheck(
                name, not broken, detail, len(broken), broken[:SHOWN_ROWS], name in blocking
            )

        def failures(name: str) -> int:
            return sum(k in self.failing[name] for k in step_keys) if self.failing[name] else 0

        hashes = ", ".join(sorted(set(self.partition_hashes.values()))) or "(no lineage)"
        pairs = sum(k in self.turn_pairs for k in step_keys)
        forked = failures("turns_nest")
        trajectories = len({self.trajectory_of.get(k) for k in step_keys})
        left = ", ".join(f"{r} {c}" for r, c in sorted(self.left_out.items())) or "none"
        filters = ", ".join(self.filters) or "no filter"
        checks = [
            check(
                "spec_hash", f"{n - failures('spec_hash')} of {n} steps curated by spec {hashes}"
            ),
            check(
                "staleness",
                "no staleness bound"
                if self.floor is None
                else f"policy versions >= {self.floor} only",
            ),
            check(
                "group_completeness",
                f"{failures('group_completeness')} steps (of {trajectories} trajectories) "
                "incomplete or released at their deadline",
            ),
            check(
                "turns_nest", f"{pairs - forked} of {pairs} consecutive turns nest, {forked} forked"
            ),
            check("masks", f"{n - failures('masks')} of {n} steps"),
            check(
                "filters",
                f"{n - failures('filters')} of {n} steps pass {filters}; left out of these "
                f"partitions: {left}",
            ),
            check(
                "exact_ids",
                f"{n - failures('exact_ids')} of {n} steps have exact token ids "
                f"({self.token_sources(step_keys)})",
            ),
        ]
        return ContractReport(dataset, dataset_version, self.spec_hash, checks, self.left_out)

    def token_sources(self, step_keys: list[str]) -> str:
        """Steps per token source among `step_keys`, e.g. `upstream 60, local_unverified 4`."""
        counts: dict[str, int] = {}
        for key in step_keys:
            source = self.token_source_of.get(key) or "unknown"
            counts[source] = counts.get(source, 0) + 1
        return ", ".join(f"{s} {c}" for s, c in sorted(counts.items())) or "no steps"

    @cached_property
    def spec_hash(self) -> str | None:
        """The spec's hash (computed once)."""
        return self.spec.spec_hash if self.spec else None


def verdicts(
    spec: CurationSpec | None,
    partition_hashes: dict[int, str],
    rows: pl.DataFrame,
    laid_out: Any,
    floor: int | None,
    left_out: dict[str, int],
) -> Verdicts:
    """Judge the steps of `rows` (gold rows: CONTRACT_COLUMNS) as `laid_out` lays them out
    (a consume.Batch, or a whole packed partition: `step_keys`, per step its token indices,
    `input_ids`, `position_ids`, `parent`) against the spec its lineage names
    (`partition_hashes`: the spec hash per policy version), the staleness floor now, and the
    partitions' rejection counts."""
    keys = laid_out.step_keys
    batch = hasattr(laid_out, "step_token_index")
    token_of = laid_out.step_token_index if batch else laid_out.token_of
    index = dict(zip(keys, token_of, strict=True))
    rows = rows.filter(pl.col("step_key").is_in(keys))
    expected = rows["policy_version"].replace_strict(partition_hashes, default=None)

    def offending(mask: pl.Series | pl.Expr) -> set[str]:
        return set(rows.filter(mask)["step_key"])

    failing = {
        "spec_hash": offending(rows["spec_hash"].ne_missing(expected)),
        "staleness": set() if floor is None else offending(pl.col("policy_version") < floor),
        "group_completeness": offending(
            (pl.col("trajectory_status") != "complete").fill_null(True)
            | (pl.col("admission") == "deadline").fill_null(False)
        ),
        "masks": mask_breaks(rows, index, laid_out.position_ids, laid_out.parent),
        "filters": set(),
        "exact_ids": offending(~pl.col("token_source").is_in(EXACT_TOKEN_SOURCES).fill_null(False)),
    }
    turn_pairs, failing["turns_nest"] = nesting_breaks(rows, index, laid_out.input_ids)
    filters: list[str] = []
    if spec is not None and rows.height:
        checks = step_checks(spec, int(rows["policy_version"].max()))
        checks.pop("superseded")  # not a gold column (gold keeps no retry orphans)
        checks.pop("stale")  # the staleness check's, against the floor now
        failing["filters"] = offending(~pl.all_horizontal(list(checks.values())))
        filters = list(checks)
    assert set(failing) == set(CONTRACT_CHECKS)
    trajectory_of = dict(zip(rows["step_key"], rows["trajectory_uid"], strict=True))
    token_source_of = dict(zip(rows["step_key"], rows["token_source"], strict=True))
    return Verdicts(
        spec,
        partition_hashes,
        floor,
        left_out,
        failing,
        turn_pairs,
        filters,
        trajectory_of,
        token_source_of,
    )


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
    """The report of one `batch` (a consume.Batch) over its steps' gold rows (`verdicts`)."""
    judged = verdicts(spec, partition_hashes, rows, batch, floor, left_out)
    return judged.report(dataset, dataset_version, batch.step_keys)


def blocking_failures(report: ContractReport) -> list[ContractCheck]:
    """The checks the batch fails that its spec makes blocking (refuse it if any)."""
    return [c for c in report.checks if c.blocking and not c.passed]

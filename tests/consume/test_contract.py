"""The contract report on every batch: what it checks, and a spec that makes a check blocking
refuses a bad batch naming its rows, before anything is recorded."""

from __future__ import annotations

import polars as pl
import pytest

from claw_pipelines.consume.dataset import BATCH_READ_COLUMNS, open_dataset
from claw_pipelines.consume.report import contract_report
from claw_pipelines.contracts.errors import ContractViolation
from claw_pipelines.contracts.specs import CONTRACT_CHECKS, CurationSpec
from claw_pipelines.contracts.tables import GOLD_CONSUMPTION
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import publish_policy_version
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import completion, drifted, group_of, land, step

SPEC = CurationSpec(
    name="grpo",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    drop_zero_variance_groups=True,
    merge="prompt_group",
    advantage="grpo",
)


@pytest.fixture
def lake(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    rows = group_of("g", [1, 2, 3], [1.0, 0.0, 0.5], turns=2)
    rows += group_of("flat", [4], [1.0, 1.0])  # left out: zero variance
    rows += drifted()
    land(lake, rows)
    build_silver(lake)
    return lake


def build(lake: Lake, spec: CurationSpec) -> None:
    save_spec(lake, spec)
    build_partition(lake, spec, 1)


def test_every_batch_says_which_checks_it_satisfies(lake):
    build(lake, SPEC)
    dataset = open_dataset("grpo", lake.uri)
    for layout in ("tree", "flat"):
        (batch,) = dataset.batches(1, batch_size=100, layout=layout)
        report = batch.contract
        assert [c.name for c in report.checks] == list(CONTRACT_CHECKS)
        assert report.spec_hash == SPEC.spec_hash and report.dataset_version == dataset.version
        passed = {c.name: c.passed for c in report.checks}
        assert passed == dict.fromkeys(CONTRACT_CHECKS, True) | {"turns_nest": False}
        nesting = report.check("turns_nest")
        assert nesting.rows == ["drift:1"] and nesting.failures == 1
        assert nesting.detail == "3 of 4 consecutive turns nest, 1 forked"
        assert report.left_out == {"zero_variance": 2}
        assert "left out of these partitions: zero_variance 2" in report.check("filters").detail
        assert "warn turns_nest" in str(report) and not nesting.blocking


def test_a_blocking_check_refuses_the_batch_naming_the_rows(lake):
    build(lake, SPEC.model_copy(update={"blocking": ["turns_nest"]}))
    dataset = open_dataset("grpo", lake.uri)
    with pytest.raises(ContractViolation, match=r"refused: turns_nest \(.*rows: drift:1\)"):
        next(dataset.batches(1, batch_size=100, consumer="trainer"))
    assert not lake.exists(GOLD_CONSUMPTION)  # never recorded, never shipped
    # live delivery records the refusal, so the next call moves on to the other groups
    shipped, refusals = [], []
    for _ in range(4):
        try:
            batch = dataset.next_batch(consumer="live", timeout=0)
        except ContractViolation as exc:
            refusals.append(str(exc))
            continue
        if batch is None:
            break
        assert batch.contract.passed
        shipped += batch.groups
    assert shipped == ["1:g"] and len(refusals) == 1 and "rows: drift:1" in refusals[0]
    record = lake.read(GOLD_CONSUMPTION).select("kind", "groups").sort("kind").to_dicts()
    assert record == [{"kind": "next", "groups": ["1:g"]}, {"kind": "refused", "groups": ["1:d"]}]
    assert [b.groups for b in dataset.replay("live")] == [["1:g"]]  # only what shipped


def test_staleness_blocks_at_consumption_time(lake):
    spec = SPEC.model_copy(update={"max_policy_staleness": 0, "blocking": ["staleness"]})
    build(lake, spec)
    dataset = open_dataset("grpo", lake.uri)
    assert next(dataset.batches(1, batch_size=2)).contract.check("staleness").passed
    publish_policy_version(lake, 2)  # the trainer moved on: version 1 is now too old
    with pytest.raises(ContractViolation, match=r"staleness \(policy versions >= 2 only; rows: "):
        next(dataset.batches(1, batch_size=2, consumer="trainer"))
    with pytest.raises(ContractViolation, match=r"staleness"):
        dataset.next_batch(consumer="live", min_policy_version=0, timeout=0)
    assert lake.read(GOLD_CONSUMPTION)["kind"].to_list() == ["refused"]


def test_incomplete_groups_and_broken_masks_and_filters_are_named(lake):
    land(lake, [step("late-r0", 0, [6], [6], group="late"), completion("late-r0", 1.0)])
    land(lake, [step("late-r1", 0, [6], [5], group="late")])  # never completes
    build_silver(lake)
    released = SPEC.model_copy(
        update={
            "trajectory_status": None,
            "drop_zero_variance_groups": False,
            "reward_status": ["final", "missing", "pending"],
        }
    )
    build(lake, released)
    dataset = open_dataset("grpo", lake.uri)
    (batch,) = dataset.batches(1, batch_size=100)
    incomplete = batch.contract.check("group_completeness")
    assert not incomplete.passed and incomplete.rows == ["late-r1:0"]

    rows = dataset.steps(1).select(BATCH_READ_COLUMNS)
    hashes = {1: released.spec_hash}
    broken = batch.position_ids.copy()
    victim = batch.step_keys.index("g-r1:1")
    broken[batch.step_token_index[victim][-1]] += 1
    batch.position_ids = broken
    report = contract_report("grpo", 0, released, hashes, rows, batch, None, {})
    assert report.check("masks").rows == ["g-r1:1"]
    pickier = released.model_copy(update={"reward_min": 0.9})
    report = contract_report("grpo", 0, pickier, hashes, rows, batch, None, {})
    assert not report.check("filters").passed
    assert set(report.check("filters").rows) == set(
        rows.filter(~(pl.col("reward") >= 0.9).fill_null(False))["step_key"]
    )
    other = contract_report("grpo", 0, released, {1: "0" * 16}, rows, batch, None, {})
    assert other.check("spec_hash").failures == rows.height  # lineage names another spec

"""Keep-everything admission: every step a spec leaves out lands in gold/rejections/<name>
with its reason, another spec can re-admit exactly those, the built-in SFT and preference
specs pick from a group, and the waste ledger adds up to its inputs."""

from __future__ import annotations

import polars as pl
import pytest

from claw_pipelines.app.cli import main
from claw_pipelines.contracts.specs import (
    PREFERENCE_PAIRS_SPEC,
    SFT_SUCCESSES_SPEC,
    CurationSpec,
    Readmission,
)
from claw_pipelines.contracts.tables import (
    SILVER_STEPS,
    gold_dataset_table,
    gold_rejection_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import SpecError, load_spec, save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.increments import update_dataset
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.ops.ledger import waste_ledger
from tests.support.lakes import group_of, land, step

GRPO = CurationSpec(
    name="grpo",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    drop_zero_variance_groups=True,
    max_policy_staleness=0,
    max_response_tokens=2,
    merge="prompt_group",
    advantage="grpo",
)
EVERYTHING = {"reward_status": ["final", "missing", "pending"]}  # no filter of its own


def _timed(rows: list[dict], ms: float) -> list[dict]:
    """The rows' steps, each saying it took `ms` to generate."""
    for row in rows:
        if row["kind"] == "step":
            row["payload"] = row["payload"].replace(
                '"metadata": {}', f'"metadata": {{"generation_ms": {ms}}}'
            )
    return rows


@pytest.fixture
def lake(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    rows = _timed(group_of("win", [1, 2], [1.0, 0.0, 1.0], turns=2), 40.0)
    rows += _timed(group_of("flat", [3], [1.0, 1.0]), 25.0)  # zero variance
    rows += group_of("lose", [4], [0.0, 0.0])
    rows += group_of("old", [5], [1.0, 0.0], version=0)  # stale under GRPO
    rows += [step("open", 0, [6], [7])]  # still running: pending reward, open
    rows += [step("long", 0, [8], [9, 9, 9], reward=1.0, is_last=True)]  # response too long
    land(lake, rows)
    build_silver(lake)
    return lake


def build_all(lake: Lake, spec: CurationSpec) -> None:
    save_spec(lake, spec)
    for version in (0, 1):
        build_partition(lake, spec, version)


def keys(lake: Lake, table: str, version: int | None = None) -> set[str]:
    rows = lake.read(table, columns=["step_key", "policy_version"])
    if version is not None:
        rows = rows.filter(pl.col("policy_version") == version)
    return set(rows["step_key"])


def test_every_step_is_admitted_or_kept_with_its_reason(lake):
    build_all(lake, GRPO)
    for version in (0, 1):
        silver = lake.read(SILVER_STEPS).filter(pl.col("policy_version") == version)
        admitted = keys(lake, gold_dataset_table("grpo"), version)
        rejected = keys(lake, gold_rejection_table("grpo"), version)
        assert admitted.isdisjoint(rejected)
        assert admitted | rejected == set(silver["step_key"])
    rows = lake.read(gold_rejection_table("grpo"))
    reason = dict(zip(rows["step_key"], rows["reason"], strict=True))
    assert {k for k, r in reason.items() if r == "zero_variance"} == {
        "flat-r0:0",
        "flat-r1:0",
        "lose-r0:0",
        "lose-r1:0",
    }
    assert {k for k, r in reason.items() if r == "stale"} == {"old-r0:0", "old-r1:0"}
    assert reason["long:0"] == "length"
    everything = dict(zip(rows["step_key"], rows["reasons"].to_list(), strict=True))
    # pending, still open, and alone in its group (no return to compare)
    assert everything["open:0"] == ["reward", "incomplete", "zero_variance"]
    assert set(rows["spec_hash"]) == {GRPO.spec_hash}
    assert keys(lake, gold_dataset_table("grpo")) == {
        f"win-r{n}:{t}" for n in range(3) for t in range(2)
    }


def test_a_readmitting_spec_gets_exactly_the_rejected_steps(lake):
    build_all(lake, GRPO)
    again = CurationSpec(name="again", readmit=Readmission(dataset="grpo"), **EVERYTHING)
    build_all(lake, again)
    for version in (0, 1):
        assert keys(lake, gold_dataset_table("again"), version) == keys(
            lake, gold_rejection_table("grpo"), version
        )
    flat = CurationSpec(
        name="flat-only",
        readmit=Readmission(dataset="grpo", reasons=["zero_variance"]),
        **EVERYTHING,
    )
    build_all(lake, flat)
    rejected = lake.read(gold_rejection_table("grpo")).filter(pl.col("reason") == "zero_variance")
    assert keys(lake, gold_dataset_table("flat-only")) == set(rejected["step_key"])
    lineage = build_partition(lake, flat, 1).lineage
    assert f'"spec:grpo": "{GRPO.spec_hash}"' in lineage["source_versions"]

    # SFT on the groups GRPO drops for zero variance: their best trajectory, if a success
    sft = SFT_SUCCESSES_SPEC.model_copy(
        update={
            "name": "sft-flat",
            "readmit": Readmission(dataset="grpo", reasons=["zero_variance"]),
        }
    )
    build_all(lake, sft)
    assert keys(lake, gold_dataset_table("sft-flat")) == {"flat-r0:0"}  # lose has no success


def test_readmission_errors_name_the_spec(lake):
    with pytest.raises(ValueError, match="cannot re-admit its own rejections"):
        CurationSpec(name="me", readmit=Readmission(dataset="me"))
    save_spec(lake, CurationSpec(name="a", readmit=Readmission(dataset="b")))
    save_spec(lake, CurationSpec(name="b", readmit=Readmission(dataset="a")))
    with pytest.raises(SpecError, match=r"^readmit: a -> b -> a is a cycle"):
        build_partition(lake, load_spec(lake, "a"), 1)
    lonely = CurationSpec(name="lonely", readmit=Readmission(dataset="nowhere"))
    with pytest.raises(SpecError, match=r"^readmit: no spec named 'nowhere'"):
        build_partition(lake, lonely, 1)


def test_sft_successes_and_preference_pairs_pick_from_each_group(lake):
    build_all(lake, SFT_SUCCESSES_SPEC)
    sft = keys(lake, gold_dataset_table("sft-successes"))
    # the best trajectory (ties: the smallest uid) of each group whose best return is >= 1
    assert sft == {"win-r0:0", "win-r0:1", "flat-r0:0", "old-r0:0", "long:0"}
    reasons = lake.read(gold_rejection_table("sft-successes"))
    reason = dict(zip(reasons["step_key"], reasons["reason"], strict=True))
    assert reason["win-r2:0"] == "not_selected" and reason["win-r1:0"] == "reward"

    build_all(lake, PREFERENCE_PAIRS_SPEC)
    pairs = lake.read(gold_dataset_table("preference-pairs"))
    chosen = pairs.group_by("prompt_uid").agg(pl.col("trajectory_uid").unique().sort())
    assert dict(chosen.iter_rows()) == {
        "win": ["win-r0", "win-r1"],
        "old": ["old-r0", "old-r1"],
    }
    left_out = lake.read(gold_rejection_table("preference-pairs"))
    reason = dict(zip(left_out["step_key"], left_out["reason"], strict=True))
    assert reason["flat-r0:0"] == reason["lose-r1:0"] == "zero_variance"
    assert reason["win-r2:1"] == "not_selected"


def test_the_waste_ledger_adds_up_to_its_inputs(lake):
    build_all(lake, GRPO)
    build_all(lake, CurationSpec(name="again", readmit=Readmission(dataset="grpo"), **EVERYTHING))
    ledger = waste_ledger(lake)
    silver = lake.read(SILVER_STEPS).with_columns(
        tokens=pl.col("prompt_len") + pl.col("response_len"),
        generation=pl.col("metadata").str.json_path_match("$.generation_ms").cast(pl.Float64),
    )
    per_version = silver.group_by("policy_version").agg(
        steps=pl.len(), tokens=pl.col("tokens").sum(), generation=pl.col("generation").sum() / 1000
    )
    grpo = ledger.filter(pl.col("dataset") == "grpo")
    totals = grpo.group_by("policy_version").agg(
        pl.col("steps").sum(), pl.col("tokens").sum(), generation=pl.col("generation_s").sum()
    )
    assert totals.sort("policy_version").to_dicts() == per_version.sort("policy_version").to_dicts()
    rejected = grpo.filter(pl.col("outcome") == "rejected")
    # everything GRPO left out, `again` admitted
    assert rejected["readmitted_steps"].to_list() == rejected["steps"].to_list()
    assert rejected["readmitted_tokens"].to_list() == rejected["tokens"].to_list()
    assert set(rejected["readmitted_by"].explode()) == {"again"}
    zero = grpo.filter(pl.col("reason") == "zero_variance").row(0, named=True)
    assert (zero["steps"], zero["tokens"], zero["generation_s"]) == (4, 12, 0.05)
    # `again` looks only at what GRPO left out, and keeps it all
    again = ledger.filter(pl.col("dataset") == "again")
    assert again["outcome"].unique().to_list() == ["admitted"]
    assert again["steps"].sum() == rejected["steps"].sum()


def test_increments_keep_the_same_rejections_as_full_builds(lake, tmp_path):
    save_spec(lake, GRPO)
    first = update_dataset(lake, GRPO)
    assert first.rejected == [0, 1]
    assert not update_dataset(lake, GRPO).changed  # nothing new: nothing written
    land(lake, group_of("late", [7], [0.5, 0.5]))  # zero variance too
    build_silver(lake)
    assert update_dataset(lake, GRPO).rejected == [1]
    incremental = lake.read(gold_rejection_table("grpo")).drop("landed_at").sort("step_key")
    for version in (0, 1):
        build_partition(lake, GRPO, version)
    full = lake.read(gold_rejection_table("grpo")).drop("landed_at").sort("step_key")
    assert incremental.equals(full, null_equal=True)
    assert {"late-r0:0", "late-r1:0"} <= set(
        full.filter(pl.col("reason") == "zero_variance")["step_key"]
    )


def test_the_cli_adds_builtin_specs_and_prints_the_ledger(lake, capsys):
    assert main(["spec", "list", "--lake", lake.uri]) == 0
    listed = capsys.readouterr().out
    assert "sft-successes" in listed and "built in, not added" in listed
    assert main(["spec", "add", "sft-successes", "--lake", lake.uri]) == 0
    assert load_spec(lake, "sft-successes") == SFT_SUCCESSES_SPEC
    assert main(["spec", "add", "nope", "--lake", lake.uri]) == 1
    assert "no built-in spec named 'nope'" in capsys.readouterr().err
    build_all(lake, SFT_SUCCESSES_SPEC)
    assert main(["ledger", "--lake", lake.uri]) == 0
    out = capsys.readouterr().out
    assert "sft-successes" in out and "not_selected" in out

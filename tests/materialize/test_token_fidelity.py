"""Token fidelity downstream of the gateway: silver says which steps' ids are not exact and
which carry no log-probs; the built-in specs keep only exact ids (rejection reason
`tokens`), a spec may require log-probs (reason `log_probs`), the waste ledger counts both,
and every batch's contract report gives its steps per token source (`exact_ids`)."""

from __future__ import annotations

import polars as pl
import pytest

from claw_pipelines import ContractViolation, open_dataset
from claw_pipelines.contracts.specs import DEFAULT_SPEC, CurationSpec
from claw_pipelines.contracts.tables import SILVER_STEPS, gold_rejection_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver, silver_findings
from claw_pipelines.ops.ledger import waste_ledger
from tests.support.lakes import completion, land, step


def proxied(trajectory: str, source: str, log_probs: bool = True) -> list[dict]:
    """A one-step trajectory whose ids came from `source`, and its completion (reward 1)."""
    row = step(trajectory, 0, [1, 2, 3], [4, 5], group=f"g-{trajectory}")
    row["token_source"] = source
    if not log_probs:
        row["rollout_log_probs"] = None
    return [row, completion(trajectory, 1.0)]


@pytest.fixture
def lake(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    rows = proxied("server", "upstream") + proxied("checked", "local", log_probs=False)
    rows += proxied("flagged", "local_unverified", log_probs=False)
    rows += proxied("white", "client")
    land(lake, rows)
    run = build_silver(lake)
    assert not silver_findings(lake, run)["token_ids_are_exact"].passed
    return lake


def test_silver_names_inexact_ids_and_missing_log_probs(lake):
    steps = lake.read(SILVER_STEPS, columns=["trajectory_uid", "token_source", "has_log_probs"])
    by_trajectory = {r["trajectory_uid"]: r for r in steps.to_dicts()}
    assert by_trajectory["flagged"]["token_source"] == "local_unverified"
    assert [by_trajectory[t]["has_log_probs"] for t in ("server", "checked", "white")] == [
        True,
        False,
        True,
    ]
    finding = silver_findings(lake, build_silver(lake))  # a no-op run: nothing new to judge
    assert finding["token_ids_are_exact"].passed


def test_builtin_specs_keep_exact_ids_and_a_spec_may_require_log_probs(lake):
    build_partition(lake, DEFAULT_SPEC, 1)
    kept = set(open_dataset("default", lake.uri).steps(1)["trajectory_uid"])
    assert kept == {"server", "checked", "white"}
    rejected = lake.read(gold_rejection_table("default")).to_dicts()
    assert [(r["trajectory_uid"], r["reason"]) for r in rejected] == [("flagged", "tokens")]

    off_policy = CurationSpec(
        name="off-policy", reward_status=["final", "missing"], require_log_probs=True
    )
    save_spec(lake, off_policy)
    build_partition(lake, off_policy, 1)
    reasons = {
        r["trajectory_uid"]: r["reasons"]
        for r in lake.read(gold_rejection_table("off-policy")).to_dicts()
    }
    assert reasons == {"checked": ["log_probs"], "flagged": ["log_probs"]}

    ledger = waste_ledger(lake).filter(pl.col("outcome") == "rejected")
    counted = {(r["dataset"], r["reason"]): r["steps"] for r in ledger.to_dicts()}
    assert counted == {("default", "tokens"): 1, ("off-policy", "log_probs"): 2}


def test_the_contract_report_counts_token_sources_and_can_block_on_them(lake):
    anything = CurationSpec(name="anything", reward_status=["final", "missing"])
    save_spec(lake, anything)
    build_partition(lake, anything, 1)
    (batch,) = open_dataset("anything", lake.uri).batches(1, batch_size=10)
    check = batch.contract.check("exact_ids")
    assert not check.passed and check.rows == ["flagged:0"] and not check.blocking
    assert check.detail == (
        "3 of 4 steps have exact token ids (client 1, local 1, local_unverified 1, upstream 1)"
    )

    strict = CurationSpec(name="strict", reward_status=["final", "missing"], blocking=["exact_ids"])
    save_spec(lake, strict)
    build_partition(lake, strict, 1)
    with pytest.raises(ContractViolation, match=r"exact_ids .*rows: flagged:0"):
        list(open_dataset("strict", lake.uri).batches(1, batch_size=10))


def test_steps_of_different_tokenizers_never_share_a_prefix_tree(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    rows = []
    for trajectory, tokenizer in (("a", "fp-one"), ("b", "fp-one"), ("c", "fp-two")):
        rows.append(step(trajectory, 0, [1, 2, 3], [4], group="g", tokenizer=tokenizer))
        rows.append(completion(trajectory, 1.0))
    land(lake, rows)
    build_silver(lake)
    spec = CurationSpec(name="grouped", reward_status=["final", "missing"], merge="prompt_group")
    save_spec(lake, spec)
    build_partition(lake, spec, 1)
    steps = open_dataset("grouped", lake.uri).steps(1)
    trees = dict(zip(steps["trajectory_uid"], steps["tree_id"], strict=True))
    assert trees == {"a": "g@fp-one", "b": "g@fp-one", "c": "g@fp-two"}  # same prompt, apart
    assert dict(zip(steps["trajectory_uid"], steps["tokenizer"], strict=True))["c"] == "fp-two"

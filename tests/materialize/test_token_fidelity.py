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
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver, silver_findings
from claw_pipelines.ops.integrity import check_lake
from claw_pipelines.ops.ledger import waste_ledger
from tests.support.lakes import completion, land, partial_rollout, step


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


def agent_turns() -> tuple[list[dict], list[dict]]:
    """Two landings of one prompt group: a trajectory that forks (a call with two choices,
    the next turn going on from the second), one that compacts its history then truncates it,
    and one whose second turn is a partial rollout resumed under the next policy version, then
    a turn after it; the second landing continues all three (their earlier steps stored)."""
    system, task = [1, 2, 3], [10, 11]
    fork = [step("fork", 0, [*system, *task], [20, 21], group="g")]
    fork.append(step("fork", 1, [*system, *task, 20, 21, 30], [40, 41], group="g"))
    fork.append(step("fork", 2, [*system, *task, 20, 21, 30], [42], group="g"))  # choice 2
    compact = [step("cmp", 0, [*system, *task], [50], group="g")]
    compact.append(step("cmp", 1, [*system, *task, 50, 51], [52, 53], group="g"))
    compact.append(step("cmp", 2, [*system, 99, 98], [54], group="g"))  # history rewritten
    partial = [step("part", 0, [*system, *task], [60], group="g")]
    partial += partial_rollout(
        "part", [*system, *task, 60, 61], [[70, 71], [72, 73]], [1, 2], first_index=1, group="g"
    )
    first = fork + compact + partial
    second = [
        step("fork", 3, [*system, *task, 20, 21, 30, 42, 31], [43], group="g"),
        step("cmp", 3, [*system, *task, 50, 51, 52, 53, 55], [56], group="g"),  # truncated
        step("part", 3, [*system, *task, 60, 61, 70, 71, 72, 73, 62], [63], group="g", version=2),
        *(completion(t, 1.0) for t in ("fork", "cmp", "part")),
    ]
    return first, second


def test_forks_compaction_and_partial_rollouts_read_back_exactly(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    first, second = agent_turns()
    land(lake, first)
    build_silver(lake)
    land(lake, second)
    build_silver(lake)  # the second landing's prompts refer to stored steps
    silver = lake.read(SILVER_STEPS)
    assert silver["prompt_ids"].null_count() == silver.height
    refs = dict(zip(silver["step_key"], silver["prefix_step_key"], strict=True))
    assert refs["fork:3"] == "fork:2" and refs["fork:2"] == "fork:1"  # a choice: its sibling
    assert refs["cmp:2"] is None and refs["cmp:3"] is None  # rewritten, truncated
    assert refs["part:2"] == "part:0" and refs["part:3"] == "part:2"  # the joined step
    stored = silver["prompt_suffix_ids"].list.len().sum() + silver["response_len"].sum()
    assert stored < (silver["prompt_len"] + silver["response_len"]).sum()

    whole = read_steps(lake, SILVER_STEPS).sort("step_key")
    sent = {
        f"{r['trajectory_uid']}:{r['step_index']}": (r["prompt_ids"], r["response_ids"])
        for r in first + second
        if r["kind"] == "step"
    }
    for row in whole.to_dicts():
        prompt, response = sent[row["step_key"]]
        if row["step_key"] == "part:2":  # the partial joined: its first part's prompt
            prompt, response = sent["part:1"][0], [70, 71, 72, 73]
        assert (row["prompt_ids"], row["response_ids"]) == (prompt, response), row["step_key"]
    for key, prompt in zip(whole["step_key"], whole["prompt_ids"].to_list(), strict=True):
        one = read_steps(lake, SILVER_STEPS, where=pl.col("step_key") == key)  # fetched alone
        assert one["prompt_ids"].to_list() == [prompt]

    spec = CurationSpec(name="agents", reward_status=["final", "missing"], merge="prompt_group")
    for version in (1, 2):
        build_partition(lake, spec, version)
    gold = open_dataset("agents", lake.uri).steps().sort("step_key")
    expected = whole.filter(pl.col("step_key").is_in(gold["step_key"].implode()))
    assert gold["prompt_ids"].to_list() == expected["prompt_ids"].to_list()
    assert gold["response_ids"].to_list() == expected["response_ids"].to_list()
    assert check_lake(lake) == []


def test_a_lake_written_before_the_layout_reads_right_and_new_turns_refer_to_it(tmp_path):
    """Rows stored whole (`prompt_ids`, no reference: silver as written before docs/DESIGN.md §18)
    read as they are, and the next turns landing after refer to them."""
    lake = Lake(str(tmp_path / "lake"))
    first, second = agent_turns()
    land(lake, first)
    build_silver(lake)
    whole = read_steps(lake, SILVER_STEPS)
    versions = whole["policy_version"].unique().to_list()
    for version in versions:  # rewritten as the layout before wrote them
        rows = whole.filter(pl.col("policy_version") == version)
        lake.overwrite(SILVER_STEPS, rows.to_arrow(), where=f"policy_version = {version}")
    stored = lake.read(SILVER_STEPS)
    assert stored["prompt_suffix_ids"].null_count() == stored.height
    assert stored["prompt_ids"].null_count() == 0
    land(lake, second)
    build_silver(lake)
    silver = lake.read(SILVER_STEPS)
    refs = dict(zip(silver["step_key"], silver["prefix_step_key"], strict=True))
    assert refs["fork:3"] == "fork:2" and refs["part:3"] == "part:2"  # to rows stored whole
    sent = {
        f"{r['trajectory_uid']}:{r['step_index']}": r["prompt_ids"]
        for r in first + second
        if r["kind"] == "step"
    }
    sent["part:2"] = sent.pop("part:1")  # the joined partial: its first part's prompt
    read = read_steps(lake, SILVER_STEPS)
    assert dict(zip(read["step_key"], read["prompt_ids"].to_list(), strict=True)) == sent
    assert check_lake(lake) == []

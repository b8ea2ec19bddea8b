"""Re-scoring stored steps with versioned judges: facts appended, never overwritten, only for
steps a judge version has not scored; the default reward rule ignores them; a spec that
names a judge resolves its rewards (and records it in lineage)."""

from __future__ import annotations

import json
import subprocess
import sys

import polars as pl
import pytest

from claw_pipelines.contracts.specs import CurationSpec, JudgeRef
from claw_pipelines.contracts.tables import (
    GOLD_LINEAGE,
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.lake.tokenizers import bundled_fingerprint
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.rescore import (
    JudgeError,
    exact_match,
    judge_texts,
    load_judge,
    rescore,
    watermark_path,
)
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.tokenization import encode, encode_chat
from claw_pipelines.transforms.judges import judge_agreement, judge_rewards
from tests.support.lakes import arithmetic_steps, completion, land, step
from tests.support.servers import REPO

BUNDLED = bundled_fingerprint()  # the arithmetic steps' ids are the bundled tokenizer's


@pytest.fixture
def lake(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "lake"))
    hello = encode_chat([{"role": "user", "content": "Hello!"}])
    chatter = step("chat-1", 0, hello, encode("Hi."), tokenizer=BUNDLED)
    land(lake, [*arithmetic_steps(), chatter, completion("chat-1")])
    build_silver(lake)
    return lake


def test_the_arithmetic_verifier_checks_the_last_number_against_the_question(lake):
    steps = judge_texts(lake, read_steps(lake, SILVER_STEPS).sort("step_key"))
    rewards = dict(zip(steps["step_key"], exact_match(steps).to_list(), strict=True))
    assert rewards == {
        "chat-1:0": None,  # no question: no opinion
        "math-0:0": 0.0,  # a tool call states no answer ("+7"... the last number is 7)
        "math-0:1": 1.0,
        "math-1:0": 0.0,
        "math-1:1": 0.0,  # said 8 for 3 + 4
        "math-2:0": 0.0,
        "math-2:1": 1.0,
    }


def test_rescoring_appends_facts_once_per_judge_version_and_only_for_new_steps(lake):
    judge = load_judge("exact-match")
    first = rescore(lake, judge)
    assert (first.candidates, first.scored, first.abstained) == (7, 6, 1)
    again = rescore(lake, judge)  # silver added nothing since: nothing is looked at
    assert (again.incremental, again.candidates, again.scored, again.bronze_version) == (
        True,
        0,
        0,
        None,
    )
    build_silver(lake)
    facts = lake.read(SILVER_FEEDBACK).filter(pl.col("judge") == "exact-match")
    assert facts.height == 6 and set(facts["judge_version"]) == {"1"}
    assert set(facts["source"]) == {"judge"}
    land(lake, arithmetic_steps(offset=10)[:2])  # one more trajectory's two steps
    build_silver(lake)
    later = rescore(lake, judge)  # only the two steps silver added since the last run
    assert (later.incremental, later.candidates, later.scored) == (True, 2, 2)
    every = rescore(lake, judge, full=True)  # all 9 again: only the abstention is re-asked
    assert (every.incremental, every.candidates, every.already_scored) == (False, 9, 8)
    assert (every.scored, every.abstained, every.bronze_version) == (0, 1, None)
    # another version of the judge scores everything again, beside the first one's facts
    second = rescore(lake, load_judge("exact-match", "2"))
    assert second.scored == 8
    build_silver(lake)
    versions = lake.read(SILVER_FEEDBACK).filter(pl.col("judge") == "exact-match")
    assert versions.group_by("judge_version").len().sort("judge_version")["len"].to_list() == [8, 8]


def test_an_incremental_run_never_records_a_fact_twice_nor_misses_a_rewritten_silver(lake):
    judge = load_judge("exact-match")
    rescore(lake, judge)
    first_mark = lake.read_text(watermark_path(judge))
    land(lake, arithmetic_steps(offset=10))
    build_silver(lake)
    assert rescore(lake, judge).scored == 6  # math-10..12, two steps each...
    # ...then its watermark is lost (a crash after the facts committed, or a slower run
    # that saw less of silver writing last): the next run sees those facts and skips them
    lake.write_text(watermark_path(judge), first_mark)
    after_loss = rescore(lake, judge)
    assert (after_loss.incremental, after_loss.candidates) == (True, 6)
    assert (after_loss.scored, after_loss.already_scored) == (0, 6)
    # silver rewritten (a repair): its change feed no longer says what is new, all is looked at
    steps = lake.read(SILVER_STEPS)
    lake.overwrite(SILVER_STEPS, steps.to_arrow(), metadata={"bronze_version": 0})
    build_silver(lake)
    rewritten = rescore(lake, judge)
    assert (rewritten.incremental, rewritten.scored, rewritten.already_scored) == (False, 0, 12)
    build_silver(lake)
    facts = lake.read(SILVER_FEEDBACK).filter(pl.col("judge") == "exact-match")
    assert facts.height == facts["step_key"].n_unique() == 12


def test_the_default_rule_ignores_judges_and_a_spec_that_names_one_resolves_it(lake):
    before = lake.read(SILVER_STEP_REWARDS).sort("step_key")
    rescore(lake, load_judge("exact-match"))
    build_silver(lake)
    after = lake.read(SILVER_STEP_REWARDS).sort("step_key")
    assert after.select("step_key", "reward", "reward_status").equals(
        before.select("step_key", "reward", "reward_status")
    )
    assert after["reward"].is_null().all()

    judged = CurationSpec(
        name="judged",
        reward_status=["final"],
        reward_min=1.0,
        reward_judge=JudgeRef(name="exact-match", version="1"),
    )
    part = build_partition(lake, judged, 1)
    assert sorted(part.steps["step_key"]) == ["math-0:1", "math-2:1"]
    lineage = lake.read(GOLD_LINEAGE).filter(pl.col("dataset") == "judged")
    assert json.loads(lineage["spec_json"][-1])["reward_judge"] == {
        "name": "exact-match",
        "version": "1",
    }
    plain = CurationSpec(name="plain", reward_status=["final"])
    assert build_partition(lake, plain, 1).steps.is_empty()  # no default-rule rewards
    assert "reward_judge" not in plain.canonical_json()  # older specs keep their hash


def response_length(steps: pl.DataFrame) -> pl.Series:
    """A judge for the test: the response's length."""
    return steps["response_ids"].list.len().cast(pl.Float64)


response_length.judge_version = "7"


def test_a_judge_is_any_module_function_and_bad_ones_fail_in_one_line(lake):
    judge = load_judge("tests.materialize.test_rescore:response_length")
    assert judge.version == "7"
    assert rescore(lake, judge).scored == 7
    with pytest.raises(JudgeError, match="not built in"):
        load_judge("nonsense")
    with pytest.raises(JudgeError, match="cannot be loaded"):
        load_judge("tests.materialize.test_rescore:missing")
    with pytest.raises(JudgeError, match="no version"):
        load_judge("tests.materialize.test_rescore:arithmetic_steps")


def test_claw_rescore_scores_and_runs_silver(lake):
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "rescore", "--lake", lake.uri]
    done = subprocess.run(
        [*command, "--judge", "exact-match"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "scored 6 steps, 0 already scored, no opinion on 1 (of 7 in scope)" in done.stdout
    assert lake.read(SILVER_FEEDBACK).filter(pl.col("judge") == "exact-match").height == 6
    full = subprocess.run(
        [*command, "--judge", "exact-match", "--full"], cwd=REPO, capture_output=True, text=True
    )
    assert "scored 0 steps, 6 already scored, no opinion on 1 (of 7 in scope)" in full.stdout
    bad = subprocess.run([*command, "--judge", "nope"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "nope" in bad.stderr


def test_judges_side_by_side_and_their_agreement(lake):
    rescore(lake, load_judge("exact-match"))
    rescore(lake, load_judge("exact-match", "2"))
    rescore(lake, load_judge("tests.materialize.test_rescore:response_length"))
    build_silver(lake)
    facts = lake.read(SILVER_FEEDBACK)
    rewards = judge_rewards(facts).filter(pl.col("step_key") == "math-0:1")
    assert dict(zip(rewards["judge_label"], rewards["reward"], strict=True)) == {
        "exact-match v1": 1.0,
        "exact-match v2": 1.0,
        "tests.materialize.test_rescore:response_length v7": 6.0,
    }
    agreement = {
        (row["judge_a"], row["judge_b"]): (row["common_steps"], row["agreement"])
        for row in judge_agreement(facts).iter_rows(named=True)
    }
    assert agreement[("exact-match v1", "exact-match v2")] == (6, 1.0)
    assert (
        agreement[("exact-match v1", "tests.materialize.test_rescore:response_length v7")][1] == 0.0
    )


def test_judges_read_each_steps_text_with_its_own_tokenizer(tmp_path):
    from claw_pipelines.interop.chat_logs import import_chat_log
    from claw_pipelines.simulation.model_folders import tokenizer_folder
    from claw_pipelines.tokenization import load_chat_tokenizer

    llama = load_chat_tokenizer(str(tokenizer_folder(tmp_path / "llama3", "llama3")))
    question = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = llama.encode("It is 5.") + llama.encode(llama.eos_token)
    response = {"prompt_token_ids": llama.prompt_ids(question), "choices": [{"token_ids": reply}]}
    log = tmp_path / "calls.jsonl"
    log.write_text(json.dumps({"trajectory_uid": "llama-1", "response": response}) + "\n")
    lake = Lake(str(tmp_path / "lake"))
    import_chat_log(lake, log, tokenizer=llama)
    land(lake, [step("anon", 0, encode_chat(question), encode("5"))])  # names no tokenizer
    build_silver(lake)
    judge = load_judge("exact-match")
    with pytest.raises(LookupError, match=r"^step anon:0 names no tokenizer"):
        rescore(lake, judge)
    run = rescore(lake, judge, tokenizer="bundled")  # its ids are the bundled tokenizer's
    assert run.scored == 2
    build_silver(lake)
    facts = lake.read(SILVER_FEEDBACK).filter(pl.col("judge") == "exact-match")
    assert dict(zip(facts["step_key"], facts["value_number"], strict=True)) == {
        "llama-1:0": 1.0,  # read with Llama 3's template: the question, then "It is 5."
        "anon:0": 1.0,
    }

"""Rounds of records that exercise every late and incremental path of silver and gold (the
script the increment-equality tests land), the specs they curate, and how two builds are
compared."""

from __future__ import annotations

import json

import polars as pl

from claw_pipelines.contracts.specs import CurationSpec, JudgeRef, Readmission
from claw_pipelines.contracts.tables import GOLD_LINEAGE
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import SilverOptions
from tests.support.lakes import LIVE, completion, feedback, group_of, partial_rollout, step

OPTIONS = SilverOptions(idle_timeout_s=0.04)  # a round is ~20 ms of data time
SPECS = [
    LIVE,
    LIVE.model_copy(update={"name": "fresh", "max_policy_staleness": 1}),
    LIVE.model_copy(update={"name": "late", "group_deadline_s": 0.03, "min_group_size": 3}),
    CurationSpec(name="all", merge="trajectory"),
    CurationSpec(name="again", readmit=Readmission(dataset="live"), merge="none"),
    CurationSpec(name="judged", reward_judge=JudgeRef(name="exact", version="1")),
]


def unscoped(conversation: str, turn: int, prompt: list[int], response: list[int]) -> dict:
    """A proxied call without a scope: the gateway's own key, stitched by content in silver."""
    row = step(f"u-{conversation}-{turn}", 0, prompt, response, version=1)
    payload = row["payload"].replace('"metadata": {}', '"metadata": {"scoped": "false"}')
    return row | {"kind": "chat_completion", "payload": payload, "token_source": "upstream"}


def script(round_: int) -> list[dict]:
    """The records of one round: new groups (one finishing a round later), late facts,
    a stitched conversation growing, a policy bump every third round."""
    version = 1 + round_ // 3
    rows = group_of(f"g{round_}", [round_, 5], [1.0, 0.0, float(round_ % 2)], version, turns=2)
    half = f"h{round_}"
    rows += [step(f"{half}-r{n}", 0, [7, round_], [n], group=half, version=version) for n in (0, 1)]
    if round_:
        previous = f"h{round_ - 1}"
        rows += [completion(f"{previous}-r0", 1.0), completion(f"{previous}-r1", 0.0)]
        rows += [feedback({"trajectory_uid": f"g{round_ - 1}-r1"}, "reward", 0.5)]
        rows += [feedback({"step_key": f"g{round_ - 1}-r0:1"}, "label", "good")]
        judged = feedback({"step_key": f"g{round_ - 1}-r2:0"}, "reward", 1.0, source="judge")
        payload = json.loads(judged["payload"]) | {"judge": "exact", "judge_version": "1"}
        rows += [judged | {"payload": json.dumps(payload)}]  # a judge scores a step late
    history = [9, 9] + [t for turn in range(round_) for t in (100 + turn, 200 + turn)]
    rows += [unscoped("c", round_, history, [100 + round_])]
    rows += [step("cmp", round_, compacting_prompt(round_), [300 + round_], version=version)]
    rows += [step(f"idle-{round_}", 0, [4, round_], [4], group=f"i{round_}", version=version)]
    # a generation the next round's policy bump aborts, resumed (and joined) in that round
    partial = partial_rollout("p", [8, 8], [[50, 51], [52, 53, 54]], [1, 2], group="pg")
    if round_ == 2:
        rows += partial[:1]
    elif round_ == 3:
        rows += [*partial[1:], completion("p", 1.0)]
    return rows


COMPACTS_AT = 3  # the round whose turn replaces the compacting agent's earlier turns


def compacting_prompt(round_: int) -> list[int]:
    """The prompt of turn `round_` of an agent that summarizes its history at COMPACTS_AT:
    the turns before it are replaced by one summary token (77), later turns extend that."""
    start, head = (0, [8, 8]) if round_ < COMPACTS_AT else (COMPACTS_AT, [8, 8, 77])
    return head + [t for turn in range(start, round_) for t in (300 + turn, 400 + turn)]


def same(mine: pl.DataFrame, theirs: pl.DataFrame, order: list[str]) -> None:
    mine, theirs = mine.sort(order), theirs.sort(order)
    assert mine.columns == theirs.columns
    assert mine.height == theirs.height
    assert mine.equals(theirs, null_equal=True)


def latest_totals(lake: Lake, dataset: str) -> pl.DataFrame:
    """Per partition of `dataset` holding steps, the totals its newest lineage row records
    (a build from nothing also records the empty ones, increments only those they wrote)."""
    totals = ["steps", "trees", "raw_tokens", "tree_tokens", "saved_tokens"]
    rows = lake.read(GOLD_LINEAGE).filter(pl.col("dataset") == dataset)
    newest = rows.sort("dataset_version").group_by("policy_version").agg(pl.all().last())
    return newest.select("policy_version", *totals).filter(pl.col("steps") > 0)

"""Simulated agents that compact their context, through a real gateway proxying a real
`claw sim-llm` (the official openai SDK calling it), then silver and gold: one trajectory of
several fragments with their reasons, token-in never splicing a rewritten history, trees that
share only true prefixes, returns over the whole trajectory; unscoped, each fragment stitches
on its own and nothing is stitched where it does not belong. And the bulk simulation's share
of compacting rollouts."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass

import dagster as dg
import numpy as np
import polars as pl
import pytest

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import SILVER_STEPS, gold_tree_table
from claw_pipelines.definitions import defs
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.materialize.gold import build_partition, partition_findings
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.simulation.agents import Tally, Task, black_box_rollout, compacted
from claw_pipelines.simulation.bulk import BulkShape, write_bulk_bronze
from tests.support.servers import GatewayProcess, bronze, wait_until
from tests.support.upstreams import SimProcess, proxy_env

KEY = "compaction-key"
TENANT = "tenant-compaction"
TURNS, EVERY = 6, 2  # six calls, the history compacted after every second one
SPEC = CurationSpec(
    name="whole",
    reward_status=["final", "missing"],
    merge="trajectory",
    advantage="grpo",
)


@dataclass(frozen=True)
class Agents:
    """The lake the agents filled, and their trajectories (the unscoped one: its first)."""

    lake: Lake
    compacting: str
    plain: str
    unscoped: str


@pytest.fixture(scope="module")
def agents(tmp_path_factory) -> Agents:
    """A GRPO group of two scoped agents (one compacting), and one unscoped compacting agent,
    through a gateway with token-in on for scoped calls; silver materialized by Dagster."""
    root = tmp_path_factory.mktemp("compaction")
    with (
        SimProcess(root) as sim,
        GatewayProcess(
            root / "lake", **proxy_env(sim.url, KEY, TENANT, CLAW_TOKEN_IN="auto")
        ) as gw,
    ):
        tally, task = Tally(), Task.random(random.Random(3))
        scoped = [
            black_box_rollout(gw.url, KEY, task, "grp", 1, tally, max_turns=TURNS, seed=1,
                              compact_every=EVERY),
            black_box_rollout(gw.url, KEY, task, "grp", 1, tally, max_turns=TURNS, seed=2),
        ]  # fmt: skip
        unscoped = black_box_rollout(
            gw.url, KEY, task, "solo", 1, tally, max_turns=TURNS, scoped=False, seed=4,
            compact_every=EVERY,
        )  # fmt: skip

        def landed() -> bool:
            frame = bronze(gw.lake)
            kinds = frame["kind"].to_list() if "kind" in frame.columns else []
            return kinds.count("chat_completion") == tally.steps and kinds.count(
                "trajectory_complete"
            ) == len(tally.event_ids)

        wait_until(landed, 30, interval=0.1, what=f"{tally.steps} proxied steps in bronze")
    result = dg.materialize(
        defs.assets,
        selection=dg.AssetSelection.groups("silver"),
        resources={"claw": ClawLake(lake_uri=str(root / "lake"))},
    )
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert checks["turns_nest"].passed, checks["turns_nest"].metadata  # compaction is no drift
    return Agents(Lake(str(root / "lake")), scoped[0], scoped[1], unscoped)


def trajectory(lake: Lake, uid: str) -> pl.DataFrame:
    steps = read_steps(lake, SILVER_STEPS).filter(pl.col("trajectory_uid") == uid)
    return steps.sort("step_index")


def token_in(steps: pl.DataFrame) -> list[dict]:
    """Each step's `metadata.token_in`."""
    return [json.loads(m)["token_in"] for m in steps["metadata"]]


def nests(earlier: dict, later: dict) -> bool:
    whole = [*earlier["prompt_ids"], *earlier["response_ids"]]
    return list(later["prompt_ids"][: len(whole)]) == whole


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens two sequences share."""
    same = np.asarray(a[: len(b)]) == np.asarray(b[: len(a)])
    return int(same.argmin()) if not same.all() else int(same.size)


def shared_depth(trees: pl.DataFrame, a: str, b: str) -> int:
    """How many first tokens the gold tree stores once for steps `a` and `b` (one tree):
    where their paths from the root part."""
    rows = {r["segment"]: r for r in trees.to_dicts()}
    path = {r["step_key"]: r["path"] for r in rows.values()}
    first, second = path[a], path[b]
    common = next(
        (k for k, (x, y) in enumerate(zip(first, second, strict=False)) if x != y),
        min(len(first), len(second)),
    )
    if common == 0:
        return 0
    below = [rows[p[common]]["start_depth"] for p in (first, second) if len(p) > common]
    return min(below) if below else rows[first[-1]]["end_depth"]


@pytest.mark.slow
def test_a_compacting_agent_is_one_trajectory_of_fragments_with_their_reasons(agents):
    steps = trajectory(agents.lake, agents.compacting)
    assert steps.height == TURNS  # one trajectory: every call of the agent
    assert steps["fragment"].to_list() == [0, 0, 1, 1, 2, 2]
    assert steps["fragment_reason"].to_list() == [
        None, None, "history_rewritten", None, "history_rewritten", None
    ]  # fmt: skip
    rows = steps.to_dicts()
    for before, after in itertools.pairwise(rows):
        assert nests(before, after) == (after["fragment_reason"] is None)
    plain = trajectory(agents.lake, agents.plain)
    assert set(plain["fragment"]) == {0} and plain["fragment_reason"].null_count() == plain.height


@pytest.mark.slow
def test_token_in_sends_a_compacted_turn_as_text_and_says_so(agents):
    modes = [
        (t["mode"], t["parent_step"], t["sent_as"])
        for t in token_in(trajectory(agents.lake, agents.compacting))
    ]
    assert modes == [
        ("start", None, "text"),
        ("extend", 0, "ids"),
        ("fork", None, "text"),  # its history matches no recorded turn: not spliced
        ("extend", 2, "ids"),  # the next turn continues the compacted one, by its ids
        ("fork", None, "text"),
        ("extend", 4, "ids"),
    ]


@pytest.mark.slow
def test_trees_share_only_true_prefixes_and_returns_cover_every_fragment(agents):
    lake, compacting = agents.lake, agents.compacting
    part = build_partition(lake, SPEC, 1)
    assert all(f.passed for f in partition_findings(lake, part).values())
    trees = lake.read(gold_tree_table(SPEC.name)).filter(
        pl.col("step_key").str.starts_with(compacting)
    )
    steps = trajectory(lake, compacting)
    for start in (2, 4):  # a fragment shares with the turn before it its true prefix only
        before, after = steps.row(start - 1, named=True), steps.row(start, named=True)
        lcp = common_prefix(
            [*before["prompt_ids"], *before["response_ids"]],
            [*after["prompt_ids"], *after["response_ids"]],
        )
        assert 0 < lcp < before["prompt_len"]  # it diverges inside the dropped history
        assert shared_depth(trees, f"{compacting}:{start - 1}", f"{compacting}:{start}") == lcp
    group = part.steps.filter(pl.col("trajectory_uid").is_in([compacting, agents.plain]))
    whole = group.group_by("trajectory_uid").agg(
        pl.len(), pl.col("trajectory_return").n_unique(), pl.col("advantage").n_unique()
    )
    sizes = dict(zip(whole["trajectory_uid"], whole["len"], strict=True))
    assert sizes[compacting] == TURNS and sizes[agents.plain] >= 1  # every step kept
    assert whole["trajectory_return"].to_list() == [1, 1]  # one return per trajectory
    assert whole["advantage"].to_list() == [1, 1]  # one advantage over all its fragments
    returns = group.filter(pl.col("trajectory_uid") == compacting)["trajectory_return"]
    assert returns.null_count() == 0


@pytest.mark.slow
def test_unscoped_fragments_stitch_on_their_own_and_never_onto_the_old_history(agents):
    steps = read_steps(agents.lake, SILVER_STEPS)
    stitched = steps.filter(pl.col("origin_step_key").is_not_null()).sort("step_index")
    assert stitched.height == TURNS  # every unscoped call, once
    groups = {uid: rows for (uid,), rows in stitched.group_by("trajectory_uid")}
    # a compacted call continues nothing the gateway saw: each fragment is a trajectory of its
    # own, its later turns stitched onto it; the first is the one the agent completed
    assert sorted(rows.height for rows in groups.values()) == [EVERY] * (TURNS // EVERY)
    assert agents.unscoped in groups
    assert set(stitched["fragment"]) == {0}
    for rows in groups.values():
        turns = rows.sort("step_index").to_dicts()
        assert all(nests(a, b) for a, b in itertools.pairwise(turns))


def test_compacted_keeps_the_head_and_summarizes_the_rest():
    messages = [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And now: What is 4 * 4?"},
    ]
    short = compacted(messages)
    assert short[:2] == messages[:2] and short[-1] == messages[-1] and len(short) == 4
    assert (
        "a tool returned 5" in short[2]["content"]
        and "you answered: It is 5." in short[2]["content"]
    )
    after_tool = compacted(messages[:4])
    assert after_tool[-1] == {"role": "user", "content": "The calculator returned 5."}
    assert json.dumps(compacted(messages[:2])) == json.dumps(messages[:2])


def test_the_bulk_simulation_compacts_a_share_of_its_rollouts(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    shape = BulkShape(rollouts=4, turns=5, compacting=0.5, compact_every=2)
    write_bulk_bronze(lake, 4 * 5 * 3, shape, batch=40)
    build_silver(lake)
    steps = read_steps(lake, SILVER_STEPS).sort("trajectory_uid", "step_index")
    per = steps.group_by("trajectory_uid", maintain_order=True).agg("fragment", "fragment_reason")
    rollout = per["trajectory_uid"].str.extract(r"-r(\d+)$").cast(pl.Int64)
    for fragments, reasons, compacts in zip(
        per["fragment"], per["fragment_reason"], rollout < 2, strict=True
    ):
        if compacts:  # the first half of each group summarizes before turns 2 and 4
            assert fragments.to_list() == [0, 0, 1, 1, 2]
            assert reasons.to_list() == [None, None, "history_rewritten", None, "history_rewritten"]
        else:
            assert fragments.to_list() == [0] * 5 and reasons.null_count() == 5

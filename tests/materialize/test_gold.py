"""Gold: curation specs, every filter, GRPO advantages, prefix trees (property-tested),
partition rewrites, lineage and time travel, and the Dagster partitions and sensor."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time

import dagster as dg
import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from claw_pipelines.contracts.specs import DEFAULT_SPEC, CurationSpec
from claw_pipelines.contracts.tables import GOLD_LINEAGE, gold_dataset_table, gold_tree_table
from claw_pipelines.definitions import defs
from claw_pipelines.defs.gold import (
    DATASETS,
    MAX_GOLD_RUNS_IN_FLIGHT,
    POLICY_VERSIONS,
    gold_partitions_sensor,
)
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.defs.runs import RETRY_TAG
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.lake.specs import (
    SpecError,
    load_spec,
    load_specs,
    parse_spec,
    read_specs,
    save_spec,
)
from claw_pipelines.materialize.failing import SENSORS, FailingBuild, failing_builds
from claw_pipelines.materialize.gold import build_partition, partition_findings, source_versions
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.transforms.prefix_tree import build_forest
from claw_pipelines.transforms.quality import (
    Finding,
    steps_in_one_partition,
    trees_are_minimal,
    trees_rebuild_steps,
)
from tests.support.dagster_runs import materialize_gold_partition
from tests.support.lakes import completion, feedback, group_of, land, rebuilt_sequences, step


@pytest.fixture
def lake(tmp_path) -> Lake:
    return Lake(str(tmp_path / "lake"))


def keys_kept(lake: Lake, spec: CurationSpec, version: int = 1) -> list[str]:
    return sorted(build_partition(lake, spec, version).steps["step_key"].to_list())


# -- specs ------------------------------------------------------------------------------------


def test_specs_validate_naming_the_field_and_hash_their_canonical_json(lake):
    with pytest.raises(SpecError, match=r"^reward_min: Input should be a valid number"):
        parse_spec("name: mine\nreward_min: lots\n")
    with pytest.raises(SpecError, match=r"^merge: Input should be"):
        parse_spec("name: mine\nmerge: forest\n")
    with pytest.raises(SpecError, match=r"^colour: Extra inputs are not permitted"):
        parse_spec("name: mine\ncolour: red\n")
    with pytest.raises(SpecError, match=r"min_prompt_tokens \(9\) is above max_prompt_tokens"):
        parse_spec("name: mine\nmin_prompt_tokens: 9\nmax_prompt_tokens: 3\n")
    a = parse_spec("name: mine\nreward_min: 0.5\nmerge: prompt_group\n")
    b = parse_spec("merge: prompt_group\nreward_min: 0.5\nname: mine\n")
    assert a.spec_hash == b.spec_hash and a.canonical_json() == b.canonical_json()
    assert parse_spec("name: mine\nreward_min: 0.6\n").spec_hash != a.spec_hash

    save_spec(lake, a)
    assert load_spec(lake, "mine") == a
    assert set(load_specs(lake)) == {"default", "mine"}
    assert load_specs(lake)["default"] == DEFAULT_SPEC
    lake.write_text("specs/other.yaml", "name: not-other\n")
    with pytest.raises(SpecError, match=r"^specs/other\.yaml: name: .* does not match its file"):
        load_spec(lake, "other")
    shelf = read_specs(lake)
    assert set(shelf.specs) == {"default", "mine"}  # the bad file hides nothing else
    assert str(shelf.errors["other"]).startswith("specs/other.yaml: name: ")


# -- curation -----------------------------------------------------------------------------------


def mixed_lake(lake: Lake) -> None:
    """Steps that each filter tells apart."""
    land(
        lake,
        [
            step("a", 0, [1, 2], [3], reward=1.0, is_last=True, finish_reason="stop"),
            step("b", 0, [1, 2, 3, 4, 5], [6, 7, 8], reward=0.2, is_last=True),
            step("c", 0, [9], [9], reward=None),  # open trajectory, no reward: pending
            step("d", 0, [1], [2], reward=-1.0, is_last=True, tenant="other"),
            step("e", 0, [4, 4], [4], reward=0.5, is_last=True, finish_reason="length"),
            step("old", 0, [1], [1], reward=1.0, is_last=True, version=0),
            feedback({"step_key": "a:0"}, "label", "helpful"),
            feedback({"step_key": "a:0"}, "rating", 5),
            feedback({"step_key": "b:0"}, "label", "toxic"),
            feedback({"step_key": "b:0"}, "rating", 2),
        ],
    )
    build_silver(lake)


FILTERS = [
    ({}, ["a:0", "b:0", "d:0", "e:0"]),  # reward_status defaults to final
    ({"reward_status": ["pending"]}, ["c:0"]),
    ({"reward_min": 0.3}, ["a:0", "e:0"]),
    ({"reward_max": 0.3}, ["b:0", "d:0"]),
    ({"require_labels": ["helpful"]}, ["a:0"]),
    ({"exclude_labels": ["toxic"]}, ["a:0", "d:0", "e:0"]),
    ({"min_rating": 3}, ["a:0"]),
    ({"finish_reasons": ["length"]}, ["e:0"]),
    ({"token_sources": ["upstream"]}, []),
    ({"min_prompt_tokens": 2, "max_prompt_tokens": 2}, ["a:0", "e:0"]),
    ({"min_response_tokens": 3}, ["b:0"]),
    ({"trajectory_status": ["open"], "reward_status": ["pending"]}, ["c:0"]),
    ({"tenants": ["other"]}, ["d:0"]),
    ({"sources": ["proxy"]}, []),
    ({"policy_versions": [0]}, []),
]


@pytest.mark.parametrize(("fields", "expected"), FILTERS)
def test_each_step_filter(lake, fields, expected):
    mixed_lake(lake)
    assert keys_kept(lake, CurationSpec(name="f", **fields)) == expected


def test_policy_staleness_and_explicit_versions(lake):
    land(lake, [step(f"v{v}", 0, [v], [v], reward=1.0, is_last=True, version=v) for v in range(5)])
    build_silver(lake)
    spec = CurationSpec(name="fresh", max_policy_staleness=1)
    assert [keys_kept(lake, spec, v) for v in range(5)] == [[], [], [], ["v3:0"], ["v4:0"]]
    pinned = CurationSpec(name="pinned", policy_versions=[1])
    assert keys_kept(lake, pinned, 1) == ["v1:0"] and keys_kept(lake, pinned, 2) == []
    stale = build_partition(lake, spec, 0)
    assert partition_findings(lake, stale)["partition_within_staleness"].passed


def test_group_filters_and_grpo_advantages_on_known_numbers(lake):
    land(
        lake,
        [
            *group_of("g1", [5, 6], [1.0, 0.0, 0.0, 1.0]),
            *group_of("flat", [7, 8], [1.0, 1.0]),
            step("g2-r0", 0, [9], [9], group="g2"),
            completion("g2-r0", 1.0),
            step("g2-r1", 0, [9], [8], group="g2"),  # still open: g2 is incomplete
        ],
    )
    build_silver(lake)
    spec = CurationSpec(name="grpo", reward_status=["final", "pending"], advantage="grpo")
    steps = build_partition(lake, spec, 1).steps
    advantage = dict(zip(steps["step_key"], steps["advantage"], strict=True))
    std = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    assert advantage["g1-r0:0"] == pytest.approx(0.5 / (std + 1e-6))
    assert advantage["g1-r1:0"] == pytest.approx(-0.5 / (std + 1e-6))
    assert advantage["flat-r0:0"] == 0.0  # zero variance: no signal
    assert advantage["g2-r0:0"] is None  # the group is not complete
    complete = CurationSpec(name="c", reward_status=["final", "pending"], complete_groups_only=True)
    assert not any(k.startswith("g2") for k in keys_kept(lake, complete))
    assert partition_findings(lake, build_partition(lake, complete, 1))[
        "groups_are_complete"
    ].passed
    varied = CurationSpec(name="v", drop_zero_variance_groups=True, min_group_size=3)
    assert {k.split("-")[0] for k in keys_kept(lake, varied)} == {"g1"}


# -- prefix trees -----------------------------------------------------------------------------


def distinct_prefixes(sequences: list[list[int]], trees: list[int]) -> int:
    return len(
        {
            (t, tuple(s[:k]))
            for s, t in zip(sequences, trees, strict=True)
            for k in range(1, len(s) + 1)
        }
    )


sequences_with_shared_prefixes = st.lists(
    st.tuples(
        st.integers(0, 2),  # tree
        st.integers(0, 5),  # which earlier sequence to extend (if any)
        st.floats(0, 1),  # how much of it to keep
        st.lists(st.integers(0, 3), max_size=6),  # new tail
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(sequences_with_shared_prefixes)
def test_forest_rebuilds_every_sequence_and_holds_exactly_u_tokens(plan):
    sequences, trees = [], []
    for tree, base, keep, tail in plan:
        prefix = sequences[base % len(sequences)] if sequences else []
        sequences.append(prefix[: int(len(prefix) * keep)] + tail)
        trees.append(tree)
    forest = build_forest(np.array(trees), pa.array(sequences, pa.list_(pa.int32())))
    assert forest.tree_tokens == distinct_prefixes(sequences, trees)
    assert forest.raw_tokens == sum(len(s) for s in sequences)
    offsets, tokens = forest.sequences()
    assert [tokens[a:b].tolist() for a, b in itertools.pairwise(offsets)] == sequences
    assert trees_are_minimal(forest).passed


def test_the_minimality_check_catches_a_token_stored_twice():
    forest = build_forest(np.zeros(2, np.int64), pa.array([[1, 2], [1, 3]], pa.list_(pa.int32())))
    assert trees_are_minimal(forest).passed
    # store the second sequence whole, as its own root: token 1 twice at depth 0
    broken = forest.__class__(
        row=forest.row,
        tree=forest.tree,
        parent=np.array([-1, -1]),
        start=np.array([0, 0]),
        length=forest.length,
        offsets=np.array([0, 2, 4]),
        tokens=np.array([1, 2, 1, 3], dtype=np.int32),
    )
    assert not trees_are_minimal(broken).passed


def test_the_rebuild_check_names_the_steps_a_tree_does_not_hold():
    prompts = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 9], [7] * 3_000]
    responses = [[4], [6], [], [8] * 2_500]  # the last one long: compared in place
    steps = pl.DataFrame(
        {"step_key": ["a", "b", "c", "d"], "prompt_ids": prompts, "response_ids": responses},
        schema_overrides={"prompt_ids": pl.List(pl.Int32), "response_ids": pl.List(pl.Int32)},
    )
    sequences = pa.array(
        [p + r for p, r in zip(prompts, responses, strict=True)], pa.list_(pa.int32())
    )
    forest = build_forest(np.array([0, 0, 0, 1]), sequences)
    assert trees_rebuild_steps(forest, steps) == Finding(True, checked=4)
    # a stored token changed: every step whose path runs through it is named
    shared = int(np.flatnonzero(forest.tokens == 2)[0])
    tokens = forest.tokens.copy()
    tokens[shared] = 99
    corrupted = dataclasses.replace(forest, tokens=tokens)
    assert trees_rebuild_steps(corrupted, steps).sample == ["a", "b", "c"]
    tokens = forest.tokens.copy()
    tokens[-1] = 0  # the long response's last token
    assert trees_rebuild_steps(dataclasses.replace(forest, tokens=tokens), steps).sample == ["d"]
    # a step whose tokens differ from the tree's (its response one token longer)
    longer = steps.with_columns(
        pl.when(pl.col("step_key") == "b")
        .then(pl.col("response_ids").list.concat(pl.lit([6], dtype=pl.List(pl.Int32))))
        .otherwise(pl.col("response_ids"))
        .alias("response_ids")
    )
    assert trees_rebuild_steps(forest, longer).sample == ["b"]


def test_the_partition_check_names_its_steps_held_twice_in_the_dataset():
    dataset = pl.Series("step_key", ["a", "b", "c", "x", "b", "y", "y"])
    assert steps_in_one_partition(dataset, pl.Series("step_key", ["a", "c"])) == Finding(
        True, checked=2
    )
    # "b" is also in another partition; "y" twice in another one is that one's finding
    found = steps_in_one_partition(dataset, pl.Series("step_key", ["a", "b"]))
    assert (found.passed, found.failures, found.sample, found.checked) == (False, 1, ["b"], 2)


def test_trees_follow_the_merge_scope_and_rebuild_from_the_table(lake):
    land(lake, group_of("g", [5, 6, 7], [1.0, 0.0], turns=3))
    build_silver(lake)
    tokens = {}
    for merge in ("trajectory", "prompt_group", "none"):
        spec = CurationSpec(
            name=merge.replace("_", "-"), reward_status=["final", "missing"], merge=merge
        )
        part = build_partition(lake, spec, 1)
        tokens[merge] = part.tree_tokens
        assert part.raw_tokens == sum(
            len(p) + len(r)
            for p, r in zip(part.steps["prompt_ids"], part.steps["response_ids"], strict=True)
        )
        assert all(f.passed for f in partition_findings(lake, part).values())
    # turns nest: a trajectory tree holds its last turn; a group also shares the prompt
    assert tokens["none"] > tokens["trajectory"] > tokens["prompt_group"]
    rows = lake.read(gold_tree_table("prompt-group")).sort("segment")
    stored = rows.to_dicts()
    for row, sequence in zip(stored, rebuilt_sequences(stored), strict=True):
        assert len(sequence) == row["end_depth"]  # rebuilt from the stored rows alone
    dataset = read_steps(lake, gold_dataset_table("prompt-group"))
    rebuilt_lengths = dict(zip(rows["step_key"], rows["end_depth"], strict=True))
    for key, prompt, response in dataset.select(
        "step_key", "prompt_ids", "response_ids"
    ).iter_rows():
        assert rebuilt_lengths[key] == len(prompt) + len(response)


def test_a_compacted_trajectory_merges_only_true_prefixes_and_keeps_one_return(lake):
    head = [5, 6, 7]  # the system prompt and the task
    rows, history = [], list(head)
    for turn in range(5):  # r0 summarizes its history before turn 3
        if turn == 3:
            history = [*head, 90, 91]  # earlier turns replaced by a summary
        response = [1000 + turn, 1100 + turn]
        rows.append(step("c-r0", turn, history, response, group="c"))
        history = [*history, *response, 3000 + turn]
    history = list(head)
    for turn in range(3):  # r1 never compacts
        rows.append(step("c-r1", turn, history, [2000 + turn], group="c"))
        history = [*history, 2000 + turn, 4000 + turn]
    rows += [completion("c-r0", 1.0), completion("c-r1", 0.0)]
    land(lake, rows)
    build_silver(lake)
    steps = lake.read("silver/steps").sort("trajectory_uid", "step_index")
    assert steps["fragment"].to_list() == [0, 0, 0, 1, 1, 0, 0, 0]
    assert steps["fragment_reason"].to_list()[3] == "history_rewritten"
    for merge in ("trajectory", "prompt_group"):
        spec = CurationSpec(
            name=merge.replace("_", "-"),
            reward_status=["final", "missing"],
            merge=merge,
            advantage="grpo",
        )
        part = build_partition(lake, spec, 1)
        assert all(f.passed for f in partition_findings(lake, part).values())
        # the trees hold exactly the distinct prefixes: the compacted turn shares the head it
        # really repeats and nothing of the history it dropped
        kept = part.steps.sort("step_key")
        sequences = [
            [*p, *r]
            for p, r in zip(
                kept["prompt_ids"].to_list(), kept["response_ids"].to_list(), strict=True
            )
        ]
        assert part.tree_tokens == distinct_prefixes(sequences, kept["tree_id"].to_list())
        trees = lake.read(gold_tree_table(spec.name)).filter(
            pl.col("step_key").str.starts_with("c-r0")
        )
        segment = dict(zip(trees["step_key"], trees["segment"], strict=True))
        path = trees.filter(pl.col("step_key") == "c-r0:3")["path"].to_list()[0]
        assert not {segment["c-r0:1"], segment["c-r0:2"]} & set(path)
        # returns and advantages cover the whole trajectory, every fragment alike
        whole = (
            kept.group_by("trajectory_uid")
            .agg(pl.col("trajectory_return").unique(), pl.col("advantage").unique())
            .sort("trajectory_uid")
        )
        assert whole["trajectory_return"].to_list() == [[1.0], [0.0]]
        std = math.sqrt(0.5)  # sample std of [1, 0]
        assert whole["advantage"].to_list()[0] == [pytest.approx(0.5 / (std + 1e-6))]
        assert kept.filter(pl.col("trajectory_uid") == "c-r0")["fragment"].to_list() == [
            0, 0, 0, 1, 1
        ]  # fmt: skip


# -- partitions, lineage, time travel -----------------------------------------------------------


def test_a_partition_rewrite_touches_only_its_partition_and_lineage_tells_what_was_read(lake):
    land(
        lake,
        [
            *group_of("one", [1], [1.0, 0.0], version=1),
            *group_of("two", [2], [0.0, 1.0], version=2),
        ],
    )
    build_silver(lake)
    spec = CurationSpec(name="ds", advantage="grpo")
    first = build_partition(lake, spec, 1)
    build_partition(lake, spec, 2)
    table = gold_dataset_table("ds")
    v2_files = {f for f in lake.open(table).file_uris() if "policy_version=2" in f}
    before = lake.read(table)

    land(lake, group_of("more", [3], [1.0, 0.5], version=1))
    build_silver(lake)
    again = build_partition(lake, spec, 1)
    after = lake.read(table)
    assert {f for f in lake.open(table).file_uris() if "policy_version=2" in f} == v2_files
    assert (
        after.filter(pl.col("policy_version") == 2)
        .sort("step_key")
        .equals(before.filter(pl.col("policy_version") == 2).sort("step_key"))
    )
    assert after.filter(pl.col("policy_version") == 1).height == 4
    # time travel: the dataset version of the first write reads back exactly
    old = lake.read(table, version=first.dataset_version).filter(pl.col("policy_version") == 1)
    assert old.sort("step_key").equals(
        before.filter(pl.col("policy_version") == 1).sort("step_key")
    )

    lineage = lake.read(GOLD_LINEAGE).filter(pl.col("dataset_version") == again.dataset_version)
    row = lineage.to_dicts()[0]
    assert row["spec_hash"] == spec.spec_hash and json.loads(row["spec_json"])["name"] == "ds"
    assert json.loads(row["source_versions"]) == source_versions(lake)
    assert row["steps"] == 4 and row["policy_version"] == 1
    assert (row["raw_tokens"], row["tree_tokens"]) == (again.raw_tokens, again.tree_tokens)
    assert row["saved_tokens"] == row["raw_tokens"] - row["tree_tokens"]
    meta = lake.commit_metadata(table, again.dataset_version)
    assert meta["spec_hash"] == spec.spec_hash and meta["source_versions"] == row["source_versions"]
    assert row["code_version"].startswith("0.1.0")


# -- Dagster --------------------------------------------------------------------------------------


def test_sensor_adds_partitions_and_requests_changed_ones_then_dagster_builds_them(lake):
    land(
        lake,
        [
            *group_of("one", [1], [1.0, 0.0], version=1),
            *group_of("two", [2], [0.0, 1.0], version=3),
        ],
    )
    build_silver(lake)
    save_spec(lake, CurationSpec(name="mine", merge="trajectory"))
    instance = dg.DagsterInstance.ephemeral()
    resources = {"claw": ClawLake(lake_uri=lake.uri)}
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        result = gold_partitions_sensor(context)
        wanted = sorted(str(r.partition_key) for r in result.run_requests)
        assert wanted == ["default|1", "default|3", "mine|1", "mine|3"]
        added = {
            r.partitions_def_name: sorted(r.partition_keys)
            for r in result.dynamic_partitions_requests
        }
        assert added == {DATASETS.name: ["default", "mine"], POLICY_VERSIONS.name: ["1", "3"]}
        assert not gold_partitions_sensor(context).run_requests  # nothing changed since
        land(lake, [feedback({"trajectory_uid": "two-r0"}, "reward", 0.25)])
        build_silver(lake)
        changed = sorted(str(r.partition_key) for r in gold_partitions_sensor(context).run_requests)
        assert changed == ["default|3", "mine|3"]  # only version 3 read something new

    run = materialize_gold_partition(instance, resources, "mine", 3)
    assert run.success
    assert all(c.passed for c in run.get_asset_check_evaluations())
    assert len(run.get_asset_check_evaluations()) == 5
    assert lake.read(gold_dataset_table("mine"))["policy_version"].unique().to_list() == [3]


def test_sensor_asks_nothing_for_partitions_in_flight_and_new_specs_go_first(lake):
    for version in range(1, 12):
        land(lake, group_of(f"v{version}", [version], [1.0, 0.0], version=version))
    build_silver(lake)
    instance = dg.DagsterInstance.ephemeral()
    resources = {"claw": ClawLake(lake_uri=lake.uri)}
    gold_job = defs.resolve_job_def("gold_job")
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        first = gold_partitions_sensor(context).run_requests
        assert len(first) == MAX_GOLD_RUNS_IN_FLIGHT  # a bounded queue, newest versions first
        assert [str(r.partition_key) for r in first[:2]] == ["default|11", "default|10"]
        assert all(r.tags.get("dagster/priority") == "1" for r in first)  # never built
        for request in first:  # as if the daemon had launched them
            tags = {"dagster/partition": str(request.partition_key)}
            instance.create_run_for_job(gold_job, status=dg.DagsterRunStatus.STARTED, tags=tags)
        assert not gold_partitions_sensor(context).run_requests  # all slots taken

        save_spec(lake, CurationSpec(name="fresh", merge="trajectory"))
        land(lake, [feedback({"trajectory_uid": "v11-r0"}, "reward", 0.25)])
        build_silver(lake)
        for run in instance.get_runs():
            instance.report_run_failed(run)  # the slots free up
        again = [str(r.partition_key) for r in gold_partitions_sensor(context).run_requests]
    assert len(again) == MAX_GOLD_RUNS_IN_FLIGHT
    assert again == [f"fresh|{11 - i}" for i in range(MAX_GOLD_RUNS_IN_FLIGHT)]  # new first


def test_a_failed_partition_run_is_asked_for_again_with_backoff_then_given_up(lake, monkeypatch):
    """A run key starts one run ever: the sensor retries a failed partition under a new key
    after its backoff, CLAW_RUN_RETRIES times for the same inputs, reporting it failing
    meanwhile; then gives up until the inputs change (a first try again)."""
    monkeypatch.setenv("CLAW_RUN_RETRY_FIRST_S", "0.3")
    monkeypatch.setenv("CLAW_RUN_RETRIES", "2")
    land(lake, group_of("g", [1, 2], [1.0, 0.0]))
    build_silver(lake)
    instance = dg.DagsterInstance.ephemeral()
    resources = {"claw": ClawLake(lake_uri=lake.uri)}
    gold_job = defs.resolve_job_def("gold_job")

    def launched_and_failed(request: dg.RunRequest) -> None:
        tags = {**request.tags, "dagster/partition": str(request.partition_key)}
        run = instance.create_run_for_job(gold_job, status=dg.DagsterRunStatus.STARTED, tags=tags)
        instance.report_run_failed(run)

    def reported() -> dict[str, FailingBuild]:
        return {build.what: build for build in failing_builds(lake)}

    assert gold_partitions_sensor.name in SENSORS  # where the dashboard looks
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        (first,) = gold_partitions_sensor(context).run_requests
        assert str(first.partition_key) == "default|1" and RETRY_TAG not in first.tags
        launched_and_failed(first)
        assert not gold_partitions_sensor(context).run_requests  # within its backoff
        assert reported()["default|1"].retrying and reported()["default|1"].attempts == 1
        for attempt in (1, 2):
            time.sleep(0.3 * 2 ** (attempt - 1) + 0.05)
            (retry,) = gold_partitions_sensor(context).run_requests
            assert retry.tags[RETRY_TAG] == str(attempt)
            assert retry.run_key.endswith(f"|retry{attempt}")
            assert retry.tags["claw/inputs"] == first.tags["claw/inputs"]
            launched_and_failed(retry)
        time.sleep(1.3)
        assert not gold_partitions_sensor(context).run_requests  # given up
        given_up = reported()["default|1"]
        assert not given_up.retrying and given_up.attempts == 3
        assert "given up until its inputs change" in given_up.line()

        land(lake, [feedback({"trajectory_uid": "g-r0"}, "reward", 0.5)])  # new inputs
        build_silver(lake)
        (fresh,) = gold_partitions_sensor(context).run_requests
        assert (
            RETRY_TAG not in fresh.tags and fresh.tags["claw/inputs"] != first.tags["claw/inputs"]
        )
        tags = {**fresh.tags, "dagster/partition": "default|1"}
        instance.create_run_for_job(gold_job, status=dg.DagsterRunStatus.SUCCESS, tags=tags)
        assert not gold_partitions_sensor(context).run_requests
        assert "default|1" not in reported()  # no longer failing

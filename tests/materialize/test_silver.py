"""Silver on a lake fed through a real gateway (proxying a real `claw sim-llm`), materialized
with Dagster in-process and with `claw materialize`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import dagster as dg
import httpx
import openai
import polars as pl
import pytest
from deltalake import write_deltalake

from claw_pipelines.contracts.specs import DEFAULT_SPEC
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEP_CONFLICTS, SILVER_STEPS
from claw_pipelines.definitions import defs
from claw_pipelines.defs.automation import bronze_version_sensor
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver, watermark
from tests.support.lakes import completion, land, step
from tests.support.servers import REPO, GatewayProcess, bronze, wait_landed, wait_until
from tests.support.upstreams import SimProcess, proxy_env

KEY = "silver-test-key"
TENANT = "tenant-silver"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with SimProcess(tmp_path_factory.mktemp("sim")) as server:
        yield server


@pytest.fixture(scope="module")
def gw(sim, tmp_path_factory):
    lake = tmp_path_factory.mktemp("silver") / "lake"
    with GatewayProcess(lake, **proxy_env(sim.url, KEY, TENANT)) as server:
        yield server


def materialize(lake_path) -> dg.ExecuteInProcessResult:
    """The silver assets, in-process, on `lake_path`."""
    return dg.materialize(
        defs.assets,
        selection=dg.AssetSelection.groups("silver"),
        resources={"claw": ClawLake(lake_uri=str(lake_path))},
    )


def checks(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {e.check_name: e for e in result.get_asset_check_evaluations()}


def silver(lake_path, table: str = "steps") -> pl.DataFrame:
    return pl.read_delta(str(lake_path / "silver" / table))


def post(gw, path: str, body: dict, **headers: str) -> list[str]:
    response = httpx.post(gw.url + path, json=body, headers=AUTH | headers, timeout=10)
    assert response.status_code == 200, response.text
    return response.json()["event_ids"]


def white_box(trajectory: str, index: int, prompt, response, **extra) -> dict:
    return {
        "trajectory_uid": trajectory,
        "step_index": index,
        "prompt_ids": prompt,
        "response_ids": response,
        "policy_version": 1,
        **extra,
    }


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_definitions_load_with_layered_asset_keys_descriptions_and_automation():
    graph = defs.resolve_asset_graph()
    keys = sorted(k.to_user_string() for k in graph.get_all_asset_keys())
    assert keys == [
        "bronze/events",
        "gold/datasets",
        "gold/lineage",
        "gold/rejections",
        "gold/trees",
        "silver/feedback",
        "silver/step_conflicts",
        "silver/step_rewards",
        "silver/steps",
        "silver/trajectories",
    ]
    for key in graph.get_all_asset_keys():
        assert graph.get(key).description, key
    checks_of = {c.name for c in graph.asset_check_keys}
    assert {
        "step_keys_are_unique",
        "lengths_are_consistent",
        "turns_nest",
        "rewards_are_finite",
    } <= checks_of
    assert {j.name for j in defs.resolve_all_job_defs()} >= {"silver_job", "maintenance_job"}
    for name in ("bronze_version_sensor", "gold_partitions_sensor"):
        assert defs.resolve_sensor_def(name).default_status == dg.DefaultSensorStatus.RUNNING
    assert [s.job.name for s in defs.schedules] == ["maintenance_job"]
    assert (REPO / "workspace.yaml").read_text().count("claw_pipelines.definitions") == 1


def test_the_workspace_loads_in_dagster(tmp_path):
    """What `dagster dev -w workspace.yaml` loads: the code location validates."""
    (tmp_path / "dagster.yaml").write_text("")
    dagster = Path(sys.executable).with_name("dagster")
    done = subprocess.run(
        [str(dagster), "definitions", "validate", "-w", "workspace.yaml"],
        cwd=REPO,
        env={**os.environ, "DAGSTER_HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Validation successful for code location claw_pipelines.definitions" in (
        done.stdout + done.stderr
    )


def chat(client: openai.OpenAI, messages: list[dict]) -> tuple[str, dict]:
    """One unscoped call: (the step key the gateway gave it, the assistant message)."""
    raw = client.chat.completions.with_raw_response.create(model="claw-sim-llm", messages=messages)
    message = raw.parse().choices[0].message.model_dump(exclude_none=True)
    return raw.headers["x-claw-step-keys"], message


def test_unscoped_conversations_are_stitched_into_trajectories_across_runs(gw):
    questions = {"x": f"What is 17 + {uuid.uuid4().int % 90}?", "y": "Name a prime below 10."}
    talks = {name: [{"role": "user", "content": q}] for name, q in questions.items()}
    seen: dict[str, list[str]] = {"x": [], "y": []}
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as client:
        for turns, name in [(0, "x"), (0, "y"), (1, "x"), (1, "y"), (2, "x")]:
            key, message = chat(client, talks[name])
            seen[name].append(key)
            talks[name] += [message, {"role": "user", "content": f"And then? ({turns})"}]
            if (turns, name) == (0, "y"):  # a first run places the opening turns
                _wait_steps(gw, seen["x"] + seen["y"])
                assert materialize(gw.lake).success
        # two rollouts of one prompt (GRPO-style), each its own trajectory, one group
        rollouts = [
            chat(client, [{"role": "user", "content": "Toss a coin."}])[0] for _ in range(2)
        ]
    _wait_steps(gw, seen["x"] + seen["y"] + rollouts)
    result = materialize(gw.lake)
    assert result.success
    assert all(c.passed for c in checks(result).values())

    steps = silver(gw.lake).filter(pl.col("origin_step_key").is_not_null())
    placed = {r["origin_step_key"]: r for r in steps.to_dicts()}
    for name, keys in seen.items():
        rows = [placed[k] for k in keys]
        assert {r["trajectory_uid"] for r in rows} == {keys[0].rsplit(":", 1)[0]}, name
        assert [r["step_index"] for r in rows] == list(range(len(keys)))
        assert len({r["prompt_uid"] for r in rows}) == 1
        assert rows[0]["source_kind"] == "proxy" and rows[0]["token_source"] == "upstream"
    assert placed[seen["x"][0]]["trajectory_uid"] != placed[seen["y"][0]]["trajectory_uid"]
    a, b = (placed[k] for k in rollouts)
    assert a["trajectory_uid"] != b["trajectory_uid"] and a["step_index"] == b["step_index"] == 0
    assert a["prompt_uid"] == b["prompt_uid"] != placed[seen["x"][0]]["prompt_uid"]
    trajectories = silver(gw.lake, "trajectories")
    x = trajectories.filter(pl.col("trajectory_uid") == seen["x"][0].rsplit(":", 1)[0])
    assert x["num_steps"].to_list() == [3] and x["status"].to_list() == ["open"]


def _wait_steps(gw, origin_keys: list[str]) -> None:
    """Wait until the proxied calls with these gateway step keys are in bronze."""
    wanted = {k.rsplit(":", 1)[0] for k in origin_keys}

    def landed():
        frame = bronze(gw.lake)
        return (
            set(frame["trajectory_uid"].drop_nulls().to_list()) >= wanted if frame.height else False
        )

    wait_until(landed, 20, interval=0.1, what="proxied steps in bronze")


def test_duplicates_dropped_conflicts_kept_out_and_reported(gw):
    trajectory = uid("dup")
    first = post(gw, "/v1/steps", {"steps": [white_box(trajectory, 0, [1, 2, 3], [4, 5])]})
    same = post(gw, "/v1/steps", {"steps": [white_box(trajectory, 0, [1, 2, 3], [4, 5])]})
    other = post(gw, "/v1/steps", {"steps": [white_box(trajectory, 0, [1, 2, 3], [9, 9])]})
    landed = wait_landed(gw.lake, first + same + other)
    # a second gateway replica landing the same event again (same event_id)
    Lake(str(gw.lake)).append(
        BRONZE_EVENTS, landed.filter(pl.col("event_id") == first[0]).to_arrow()
    )
    result = materialize(gw.lake)
    assert result.success  # a conflict is reported, not blocking
    steps = silver(gw.lake).filter(pl.col("trajectory_uid") == trajectory)
    assert steps["event_id"].to_list() == first
    assert steps["response_ids"].to_list() == [[4, 5]]
    conflicts = silver(gw.lake, "step_conflicts").filter(pl.col("step_key") == f"{trajectory}:0")
    assert conflicts["event_id"].to_list() == other
    assert conflicts["kept_event_id"].to_list() == first
    found = checks(result)["steps_have_no_conflicts"]
    assert not found.passed and f"{trajectory}:0" in found.metadata["sample"].value
    assert checks(result)["step_keys_are_unique"].passed


def test_late_feedback_flips_reward_status(gw):
    trajectory = uid("late")
    post(
        gw,
        "/v1/steps",
        {"steps": [white_box(trajectory, i, [1] * (i + 1), [2]) for i in range(2)]},
    )
    key0, key1 = f"{trajectory}:0", f"{trajectory}:1"

    def statuses():
        materialize(gw.lake)
        rewards = silver(gw.lake, "step_rewards").filter(pl.col("trajectory_uid") == trajectory)
        return dict(zip(rewards["step_key"], rewards["reward_status"], strict=True)), rewards

    _wait_trajectory(gw, trajectory)
    assert statuses()[0] == {key0: "pending", key1: "pending"}
    done = post(gw, f"/v1/trajectories/{trajectory}/complete", {})
    wait_landed(gw.lake, done)
    assert statuses()[0] == {key0: "missing", key1: "missing"}
    late = post(
        gw,
        "/v1/feedback",
        {
            "target": {"trajectory_uid": trajectory},
            "kind": "reward",
            "value": 0.5,
            "source": "human",
        },
    )
    wait_landed(gw.lake, late)
    status, rewards = statuses()
    assert status == {key0: "missing", key1: "final"}
    assert rewards.filter(pl.col("step_key") == key1)["reward"].to_list() == [0.5]
    trajectories = silver(gw.lake, "trajectories").filter(pl.col("trajectory_uid") == trajectory)
    assert trajectories["status"].to_list() == ["complete"]
    assert trajectories["resolved_return"].to_list() == [0.5]


def _wait_trajectory(gw, trajectory: str) -> None:
    wait_until(
        lambda: trajectory in set(bronze(gw.lake)["trajectory_uid"].drop_nulls().to_list()),
        20,
        interval=0.1,
        what=f"{trajectory} in bronze",
    )


def test_rerun_is_a_noop_and_compaction_between_runs_adds_nothing(gw):
    lake = Lake(str(gw.lake))
    assert materialize(gw.lake).success
    versions = {t: lake.version(f"silver/{t}") for t in ("steps", "feedback", "trajectories")}
    assert materialize(gw.lake).success
    assert versions == {t: lake.version(f"silver/{t}") for t in versions}
    before = silver(gw.lake).height

    trajectory = uid("compact")
    turns = [white_box(trajectory, i, [7, i], [8]) for i in range(5)]
    for part in (turns[:3], turns[3:]):  # two commits at least: something to compact
        wait_landed(gw.lake, post(gw, "/v1/steps", {"steps": part}))
    compacted = lake.maintain(BRONZE_EVENTS)
    assert compacted["files_removed"] > 1
    result = materialize(gw.lake)
    meta = result.get_asset_materialization_events()[0].materialization.metadata
    assert meta["read_mode"].value == "changes" and meta["steps_added"].value == 5
    steps = silver(gw.lake)
    assert steps.height == before + 5 and steps["step_key"].n_unique() == steps.height
    assert watermark(lake) == lake.version(BRONZE_EVENTS)


def test_turns_that_do_not_nest_are_reported_by_step_key(gw):
    trajectory = uid("drift")
    steps = [white_box(trajectory, 0, [1, 2], [3]), white_box(trajectory, 1, [1, 2, 4], [5])]
    wait_landed(gw.lake, post(gw, "/v1/steps", {"steps": steps}))
    found = checks(materialize(gw.lake))["turns_nest"]
    assert not found.passed and found.metadata["sample"].value == [f"{trajectory}:1"]


def test_sensor_requests_one_run_at_a_time_for_new_bronze_versions(gw):
    lake = Lake(str(gw.lake))
    wait_landed(gw.lake, post(gw, "/v1/steps", {"steps": [white_box(uid("s"), 0, [1], [2])]}))
    version = lake.version(BRONZE_EVENTS)
    resources = {"claw": ClawLake(lake_uri=str(gw.lake))}
    instance = dg.DagsterInstance.ephemeral()
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        result = bronze_version_sensor(context)
        assert [r.run_key for r in result.run_requests] == [f"bronze-v{version}"]
        assert result.run_requests[0].run_config["ops"]["silver"]["config"] == {
            "bronze_version": -1  # the newest when the run starts: one run catches up
        }
        assert context.cursor == str(version)
        running = instance.create_run_for_job(
            defs.resolve_job_def("silver_job"), status=dg.DagsterRunStatus.STARTED
        )
        wait_landed(gw.lake, post(gw, "/v1/steps", {"steps": [white_box(uid("s"), 0, [1], [2])]}))
        coalesced = bronze_version_sensor(context)
        assert not coalesced.run_requests
        assert running.run_id[:8] in coalesced.skip_reason.skip_message
        assert context.cursor == str(lake.version(BRONZE_EVENTS))  # observed all the same
        instance.report_run_failed(running)
        newest = bronze_version_sensor(context)  # it ended: one run for the newest
        assert [r.run_key for r in newest.run_requests] == [
            f"bronze-v{lake.version(BRONZE_EVENTS)}"
        ]
    materialize(gw.lake)
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        caught_up = bronze_version_sensor(context)
        assert not caught_up.run_requests  # silver has read this version already


def test_claw_materialize_runs_in_process_and_fails_in_one_line(gw):
    command = [
        sys.executable,
        "-m",
        "claw_pipelines.app.cli",
        "materialize",
        "--lake",
        str(gw.lake),
    ]
    done = subprocess.run([*command, "--select", "silver/steps"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "materialized silver/steps" in done.stdout
    assert "materialized silver/trajectories" in done.stdout  # one multi-asset: all of it
    assert "check silver/steps:step_keys_are_unique: passed" in done.stdout
    bad = subprocess.run([*command, "--select", "nope/none"], capture_output=True, text=True)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_bad_lengths_fail_a_blocking_check(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    frame = pl.DataFrame(
        {
            "event_id": ["e-bad"],
            "kind": ["step"],
            "tenant": ["t"],
            "gateway_id": ["writer-with-a-bug"],
            "batch_seq": [0],
            "schema_version": [1],
            "payload": ['{"metadata": {}}'],
            "trajectory_uid": ["bad"],
            "step_index": [0],
            "prompt_ids": [[1, 2]],
            "response_ids": [[3, 4]],
            "rollout_log_probs": [[-0.1]],
        }
    ).with_columns(
        received_at=pl.lit("2026-11-30T00:00:00Z").str.to_datetime(time_zone="UTC"),
        ingest_date=pl.date(2026, 11, 30),
    )
    lake.append(BRONZE_EVENTS, frame.to_arrow())
    result = dg.materialize(
        defs.assets,
        selection=dg.AssetSelection.groups("silver"),
        resources={"claw": ClawLake(lake_uri=lake.uri)},
        raise_on_error=False,
    )
    found = checks(result)["lengths_are_consistent"]
    assert not found.passed and found.severity == dg.AssetCheckSeverity.ERROR
    assert found.metadata["sample"].value == ["bad:0"]


def test_a_lake_written_before_fragments_reads_and_counts_on(tmp_path):
    """silver/steps as it was before fragments (no such columns): a run adds them, the old
    steps read as null and count as fragment 0, and gold builds over both."""
    lake = Lake(str(tmp_path / "lake"))
    land(lake, [step("t", 0, [1, 2], [3]), step("t", 1, [1, 2, 3, 4], [5])])
    build_silver(lake)
    before = lake.read(SILVER_STEPS).drop("fragment", "fragment_reason").to_arrow()
    write_deltalake(
        lake.table_uri(SILVER_STEPS),
        before,
        mode="overwrite",
        schema_mode="overwrite",
        partition_by=["policy_version"],
    )
    lake = Lake(lake.uri)
    assert "fragment" not in lake.open(SILVER_STEPS).schema().to_arrow().names
    later = [step("t", 2, [1, 2, 3, 4, 5, 6], [7]), step("t", 3, [1, 2, 9], [8])]
    land(lake, [*later, completion("t", 1.0)])
    build_silver(lake)
    steps = lake.read(SILVER_STEPS).sort("step_index")
    assert steps["fragment"].to_list() == [None, None, 0, 1]
    assert steps["fragment_reason"].to_list() == [None, None, None, "history_rewritten"]
    kept = build_partition(lake, DEFAULT_SPEC, 1).steps.sort("step_index")
    assert kept["fragment"].to_list() == [None, None, 0, 1]


def test_maintenance_job_compacts_and_keeps_time_travel(tmp_path, monkeypatch):
    lake = Lake(str(tmp_path / "lake"))
    for i in range(4):
        frame = pl.DataFrame(
            {
                "event_id": [f"e{i}"],
                "kind": ["event"],
                "tenant": ["t"],
                "gateway_id": ["g"],
                "batch_seq": [i],
                "schema_version": [1],
                "payload": ["{}"],
            }
        ).with_columns(
            received_at=pl.lit("2026-11-30T00:00:00Z").str.to_datetime(time_zone="UTC"),
            ingest_date=pl.date(2026, 11, 30),
        )
        lake.append(BRONZE_EVENTS, frame.to_arrow())
    files_before = len(lake.open(BRONZE_EVENTS).file_uris())
    monkeypatch.setenv("CLAW_LAKE_URI", lake.uri)
    assert defs.resolve_job_def("maintenance_job").execute_in_process().success
    assert len(lake.open(BRONZE_EVENTS).file_uris()) < files_before
    assert sorted(lake.read(BRONZE_EVENTS)["event_id"].to_list()) == ["e0", "e1", "e2", "e3"]
    assert lake.read(BRONZE_EVENTS, version=2).height == 2  # old versions still readable


def scoped_call(trajectory: str, index: int, prompt: list[int], response: list[int]) -> dict:
    """A scoped proxied call as bronze holds it: the gateway's step index."""
    row = step(trajectory, index, prompt, response, version=1)
    payload = row["payload"].replace('"metadata": {}', '"metadata": {"scoped": true}')
    return row | {"kind": "chat_completion", "payload": payload, "token_source": "upstream"}


def test_proxied_calls_the_gateway_numbered_alike_are_all_kept_in_arrival_order(tmp_path):
    """A gateway that numbered a trajectory's calls again from 0 (how one numbered before
    this fix after a restart): the later calls are other calls, not conflicts; each keeps
    its tokens under a key of its own, after the earlier turns, in an increment as in a
    rebuild from nothing."""
    history: list[int] = [1, 2]
    rows = []
    for turn in range(6):
        reply = [100 + turn]
        rows.append(scoped_call("t", turn % 3, list(history), reply))
        history += [*reply, 200 + turn]
    lake = Lake(str(tmp_path / "lake"))
    land(lake, rows[:3])
    build_silver(lake)
    land(lake, rows[3:])
    run = build_silver(lake)
    assert run.steps_renumbered == 3 and run.conflicts_added == 0
    whole = Lake(str(tmp_path / "whole"))
    land(whole, rows)
    assert build_silver(whole).steps_renumbered == 3
    for built in (lake, whole):
        steps = built.read(SILVER_STEPS).sort("step_index")
        assert steps["event_id"].to_list() == [r["event_id"] for r in rows]  # arrival order
        keys = steps["step_key"].to_list()
        assert keys[:3] == ["t:0", "t:1", "t:2"] and len(set(keys)) == 6
        assert steps["fragment"].to_list() == [0] * 6  # each turn extends the one before
        moved = [json.loads(m).get("renumbered_from") for m in steps["metadata"]]
        assert moved == [None, None, None, "t:0", "t:1", "t:2"]
        assert built.read(SILVER_STEP_CONFLICTS).is_empty()
    assert (
        lake.read(SILVER_STEPS)
        .sort("step_key")
        .equals(whole.read(SILVER_STEPS).sort("step_key").select(lake.read(SILVER_STEPS).columns))
    )

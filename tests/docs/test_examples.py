"""The docs' Python examples run as written: the README's (an unchanged OpenAI client records
a step through a started gateway, the simulated model behind it; the bronze read finds it;
the batch example pulls from a lake with rewarded groups) and the recording tutorial's (chat,
Responses and Messages through the official SDKs, an OpenTelemetry exporter) and the training
tutorial's first (a gradient step on each tree batch); the curation tutorial's spec files
validate and build. Only the gateway's address and the
lake's path are the test's own."""

from __future__ import annotations

import json
import math
import re
import subprocess
from pathlib import Path

import polars as pl

from claw_pipelines.contracts.specs import DEFAULT_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import read_specs
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import group_of, land
from tests.support.servers import GatewayProcess, bronze, wait_until
from tests.support.upstreams import SimProcess

ROOT = Path(__file__).resolve().parents[2]


def blocks(page: str) -> list[str]:
    """The Python code blocks of a docs page, in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


BLOCKS = blocks("README.md")
CURATE = (ROOT / "docs/tutorials/curate.md").read_text()


def run(block: str, url: str, lake: Path) -> str:
    """Run a docs block with the test's gateway and lake; what it printed."""
    printed: list[str] = []
    code = block.replace("./lake", str(lake))
    for address in ("http://127.0.0.1:8080", "http://localhost:8080"):
        code = code.replace(address, url)
    exec(code, {"print": lambda *a, **k: printed.append(" ".join(map(str, a)))})
    return "\n".join(printed)


def test_the_readme_records_an_agent_then_finds_its_step(tmp_path):
    record, check, _ = BLOCKS
    lake = tmp_path / "lake"
    with (
        SimProcess(tmp_path) as sim,
        GatewayProcess(lake, CLAW_UPSTREAM_URL=sim.url, CLAW_FLUSH_INTERVAL_MS="50") as gw,
    ):
        printed = run(record, gw.url, lake)
        assert printed == "traj-42:0"
        landed = landed_step(lake)
    shown = run(check, "", lake)
    assert "chat_completion" in shown and "upstream" in shown
    assert landed["token_source"] == "upstream" and landed["step_index"] == 0


def landed_step(lake: Path) -> dict:
    """The README's step once it is in bronze."""

    def found():
        rows = bronze(lake)
        if "trajectory_uid" not in rows.columns:
            return None
        rows = rows.filter(pl.col("trajectory_uid") == "traj-42")
        return rows.row(0, named=True) if rows.height else None

    return wait_until(found, 20, interval=0.1, what="the README's step")


def test_the_readme_pulls_a_batch(tmp_path):
    lake_path = tmp_path / "lake"
    lake = Lake(str(lake_path))
    for version in (1, 2):
        land(lake, group_of(f"g{version}", [1, 2, 3], [1.0, 0.0], version=version, turns=2))
    build_silver(lake)
    for version in (1, 2):
        build_partition(lake, DEFAULT_SPEC, version)
    printed = run(BLOCKS[2], "", lake_path)
    assert "'tokens':" in printed and "'over_budget': False" in printed


def test_the_recording_tutorial_runs_against_a_gateway(tmp_path):
    lake = tmp_path / "lake"
    examples = blocks("docs/tutorials/record-an-agent.md")
    assert len(examples) == 4
    with (
        SimProcess(tmp_path) as sim,
        GatewayProcess(lake, CLAW_UPSTREAM_URL=sim.url, CLAW_FLUSH_INTERVAL_MS="50") as gw,
    ):
        for example in examples:
            run(example, gw.url, lake)

        def landed():
            rows = bronze(lake)
            if "trajectory_uid" not in rows.columns:
                return None
            steps = rows.filter(pl.col("kind") == "chat_completion")
            found = set(steps["trajectory_uid"])
            return found if {"traj-42", "traj-43", "traj-44"} <= found else None

        wait_until(landed, 20, interval=0.1, what="a step of each protocol")


def curl_blocks(page: str) -> list[str]:
    """The shell blocks of a docs page that call the gateway with curl."""
    found = re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), re.S)
    return [block for block in found if block.lstrip().startswith("curl ")]


def test_the_curl_examples_land_what_they_say(tmp_path):
    """The white-box step and the feedback, event and completion after it, as the tutorials
    show them, against a started gateway: each answer is the one shown (the event ids
    aside), and silver holds the step with its rating and its trajectory's reward."""
    blocks = curl_blocks("docs/tutorials/white-box-steps.md")
    blocks += curl_blocks("docs/tutorials/rewards-and-feedback.md")
    assert len(blocks) == 2
    lake = tmp_path / "lake"
    with GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="50") as gw:
        port = gw.url.rsplit(":", 1)[1]
        answers = []
        for block in blocks:
            script = block.replace("localhost:8080", f"127.0.0.1:{port}")
            done = subprocess.run(
                ["bash", "-c", script + "\necho"], capture_output=True, text=True, timeout=30
            )
            assert done.returncode == 0, done.stderr
            lines = done.stdout.replace("}{", "}\n{").splitlines()  # answers lack a newline
            answers += [json.loads(line) for line in lines if line.strip()]
        shown = json.loads(re.search(r"# (\{.*\})", blocks[0])[1].replace("01a2…", "x"))
        assert answers[0].keys() == shown.keys() and answers[0]["accepted"] == 1
        assert [a["accepted"] for a in answers] == [1, 1, 1, 1]
        wait_until(lambda: bronze(lake).height >= 4, 20, interval=0.1, what="4 records")
    build_silver(Lake(str(lake)))
    steps = Lake(str(lake)).read("silver/steps")
    assert steps["step_key"].to_list() == ["traj-1:0"]
    trajectory = Lake(str(lake)).read("silver/trajectories").row(0, named=True)
    assert trajectory["status"] == "complete"


def test_the_training_tutorial_trains_on_the_lakes_batches(tmp_path):
    """The first example of the training tutorial, as written: a policy takes a gradient step
    on each tree batch of a policy version's partition, and the loss is finite."""
    (example, *_) = blocks("docs/tutorials/train.md")
    lake_path = tmp_path / "lake"
    lake = Lake(str(lake_path))
    land(lake, group_of("g3", [5, 6, 7], [1.0, 0.0, 0.5], version=3, turns=2))
    build_silver(lake)
    build_partition(lake, DEFAULT_SPEC, 3)
    printed = run(example, "", lake_path).splitlines()
    assert printed[0].endswith("[3]")  # the dataset's version, its one policy version
    assert printed[1].startswith("batch 0: 6 steps, loss ")
    assert math.isfinite(float(printed[1].rsplit(" ", 1)[1]))


def test_the_curation_tutorials_specs_validate_and_build(tmp_path):
    """The spec files the curation tutorial shows, written where their first line says: each
    validates, and they build: GRPO keeps the group with a learning signal and drops the
    one whose returns are equal, which the SFT spec re-admits (its best trajectory)."""
    specs = re.findall(r"```yaml\n# (lake/specs/[\w-]+\.yaml)\n(.*?)```", CURATE, re.S)
    assert [path for path, _ in specs] == [
        "lake/specs/math-grpo.yaml",
        "lake/specs/sft-from-grpo.yaml",
    ]
    lake_path = tmp_path / "lake"
    lake = Lake(str(lake_path))
    land(lake, group_of("signal", [1, 2, 3], [1.0, 0.0], version=3))
    land(lake, group_of("flat", [4, 5, 6], [1.0, 1.0], version=3))
    build_silver(lake)
    for path, text in specs:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    shelf = read_specs(lake)
    assert not shelf.errors and {"math-grpo", "sft-from-grpo"} <= set(shelf.specs)
    grpo = build_partition(lake, shelf.specs["math-grpo"], 3)
    sft = build_partition(lake, shelf.specs["sft-from-grpo"], 3)
    kept = pl.read_delta(str(lake_path / "gold/datasets/math-grpo"))
    readmitted = pl.read_delta(str(lake_path / "gold/datasets/sft-from-grpo"))
    assert set(kept["prompt_uid"]) == {"signal"} and grpo.steps.height == kept.height == 2
    assert set(readmitted["trajectory_uid"]) == {"flat-r0"} and sft.steps.height == 1

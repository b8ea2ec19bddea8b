"""Every user error is one clear line naming what is missing and what exists, the same in the
CLI and the Python API (docs/DESIGN.md §9): a table of wrong invocations on one small real lake.
CLI rows run as real `claw` processes (in a few threads, sharing one lake); API rows call
`claw_pipelines.consume.dataset` and expect its NotFound."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from claw_pipelines.consume.dataset import NotFound, open_dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import group_of, land
from tests.support.servers import REPO, free_port

SPEC = CurationSpec(name="train", reward_status=["final", "missing"], merge="prompt_group")
INTERNALS = ("Traceback", "DeltaError", "Kernel", "OverflowError", "pyarrow", "LogSegment")
EXPORT = ["export", "--dataset", "train", "--policy-version", "1", "--out", "{tmp}/out.parquet"]

# (id, argv with {lake} {missing} {copy} {tmp} {port}, words the one line must hold)
CLI_ROWS = [
    ("export-version-too-new", [*EXPORT, "--version", "9999"], ["versions 0..", "9999"]),
    ("export-version-negative", [*EXPORT, "--version", "-1"], ["versions 0..", "version -1"]),
    (
        "export-policy-version",
        ["export", "--dataset", "train", "--policy-version", "42", "--out", "{tmp}/o.parquet"],
        ["policy versions 1, 2", "policy version 42 does not exist"],
    ),
    (
        "export-dataset",
        ["export", "--dataset", "nope", "--policy-version", "1", "--out", "{tmp}/o.parquet"],
        ["'nope'", "datasets: train"],
    ),
    ("export-lake", [*EXPORT, "--lake", "{missing}"], ["no lake at {missing}"]),
    (
        "materialize-lake",
        ["materialize", "--lake", "{missing}"],
        ["no lake at {missing}", "--create"],
    ),
    (
        "materialize-dataset",
        ["materialize", "--dataset", "nope", "--lake", "{copy}"],
        ["'nope'", "specs: default"],
    ),
    (
        "materialize-policy-version",
        ["materialize", "--policy-version", "99", "--lake", "{copy}"],
        ["policy versions 1, 2", "policy version 99 does not exist"],
    ),
    ("check-lake", ["check", "--lake", "{missing}"], ["no lake at {missing}"]),
    ("ledger-dataset", ["ledger", "--dataset", "nope"], ["'nope'", "datasets: train"]),
    ("spec-add", ["spec", "add", "nope"], ["'nope'", "sft-successes"]),
    (
        "rescore-spec",
        ["rescore", "--judge", "exact-match", "--spec", "nope"],
        ["'nope'", "known: default"],
    ),
    (
        "gateway-port",
        ["gateway", "--port", "{port}", "--lake", "{missing}"],
        ["port {port}", "in use"],
    ),
]


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> Lake:
    """Four GRPO groups over policy versions 1 and 2, curated as `train` (dataset versions 0..2)."""
    lake = Lake(str(tmp_path_factory.mktemp("errors") / "lake"))
    rows = []
    for g in range(4):
        rows += group_of(f"g{g}", [7, g, 7, g], [1.0, 0.0, 0.5], version=1 + g % 2, turns=2)
    land(lake, rows)
    build_silver(lake)
    for version in (1, 2):
        build_partition(lake, SPEC, version)
    return lake


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "claw_pipelines.app.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@pytest.fixture(scope="module")
def cli(lake, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, dict[str, str]]]:
    """Every CLI row's outcome (and its placeholders), run four at a time; a port held busy."""
    tmp = tmp_path_factory.mktemp("errors-cli")
    copy = tmp / "copy"  # rows that may write (materialize) get their own lake
    shutil.copytree(lake.uri, copy)
    busy = socket.socket()
    busy.bind(("127.0.0.1", free_port()))
    busy.listen()
    values = {
        "lake": lake.uri,
        "missing": str(tmp / "missing" / "lake"),
        "copy": str(copy),
        "tmp": str(tmp),
        "port": str(busy.getsockname()[1]),
    }
    env = {**os.environ, "CLAW_LAKE_URI": lake.uri, "CLAW_ERROR_LOG": str(tmp / "errors.log")}
    env.pop("CLAW_UPSTREAM_URL", None)
    try:
        with ThreadPoolExecutor(4) as pool:
            futures = {
                name: pool.submit(_run, [a.format(**values) for a in argv], env)
                for name, argv, _ in CLI_ROWS
            }
            return {name: (future.result(), values) for name, future in futures.items()}
    finally:
        busy.close()


def _assert_one_clear_line(text: str, words: list[str]) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    for bad in INTERNALS:
        assert bad not in lines[0], lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    ("name", "words"), [(n, w) for n, _, w in CLI_ROWS], ids=[r[0] for r in CLI_ROWS]
)
def test_a_wrong_cli_invocation_fails_in_one_line_naming_what_is_missing(cli, name, words):
    done, values = cli[name]
    assert done.returncode != 0, done.stdout
    line = _assert_one_clear_line(done.stderr, [w.format(**values) for w in words])
    assert line.startswith("claw: error: ")
    assert "(traceback:" not in line  # an expected error, not a bug sent to the error log
    assert not Path(values["missing"]).exists()  # no reader created the missing lake


# (id, call on the lake's URI and a missing path, words the message must hold)
API_ROWS = [
    ("version-too-new", lambda uri, _: open_dataset("train", uri, 99999), ["0..2", "99999"]),
    ("version-negative", lambda uri, _: open_dataset("train", uri, -1), ["0..2", "version -1"]),
    ("dataset", lambda uri, _: open_dataset("nope", uri), ["'nope'", "datasets: train"]),
    ("lake", lambda _, missing: open_dataset("train", missing), ["no lake at"]),
    (
        "steps-policy-version",
        lambda uri, _: open_dataset("train", uri).steps(policy_version=42),
        ["policy versions 1, 2", "policy version 42 does not exist"],
    ),
    (
        "batches-policy-version",
        lambda uri, _: next(open_dataset("train", uri).batches(42, batch_size=4)),
        ["policy versions 1, 2", "policy version 42 does not exist"],
    ),
]


@pytest.mark.parametrize(("call", "words"), [r[1:] for r in API_ROWS], ids=[r[0] for r in API_ROWS])
def test_a_wrong_api_call_raises_not_found_in_one_line(lake, tmp_path, call, words):
    missing = str(tmp_path / "missing")
    with pytest.raises(NotFound) as raised:
        call(lake.uri, missing)
    assert isinstance(raised.value, LookupError)  # callers catching LookupError still do
    _assert_one_clear_line(str(raised.value), words)
    assert not Path(missing).exists()


def test_the_cli_and_the_api_say_the_same(cli, lake):
    with pytest.raises(NotFound) as raised:
        open_dataset("train", lake.uri, 9999)
    assert cli["export-version-too-new"][0].stderr == f"claw: error: {raised.value}\n"
    with pytest.raises(NotFound) as raised:
        open_dataset("train", lake.uri).steps(42)
    assert cli["export-policy-version"][0].stderr == f"claw: error: {raised.value}\n"

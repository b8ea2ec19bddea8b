"""What each install runs: the package alone (no `stack` extra) serves the gateway and the
live materializer; a verb that needs Dagster or the dashboard says which extra to install,
in one line, instead of a traceback."""

from __future__ import annotations

import subprocess
import sys

from claw_pipelines.lake.delta import Lake
from tests.support.lakes import group_of, land
from tests.support.servers import REPO, wait_until

WITHOUT_STACK = (
    "import sys\n"
    "for name in ('dagster', 'dagster_webserver', 'streamlit'):\n"
    "    sys.modules[name] = None  # as if the stack extra were not installed\n"
    "from claw_pipelines.app.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def claw_without_stack(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_STACK, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_verb_that_needs_the_stack_names_the_extra(tmp_path):
    lake = tmp_path / "lake"
    done = claw_without_stack("materialize", "--lake", str(lake), "--create")
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "claw: error: `claw materialize` needs the stack extra (dagster is not installed): "
        "pip install 'claw-lakehouse[stack]'"
    )


def test_the_live_materializer_runs_without_the_stack(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    land(lake, group_of("g", [1, 2, 3], [1.0, 0.0]))
    follower = subprocess.Popen(
        [sys.executable, "-c", WITHOUT_STACK, "materialize", "--follow", "--lake", lake.uri],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: lake.exists("silver/steps"), 60, interval=0.2, what="a first round")
    finally:
        follower.terminate()
        out, _ = follower.communicate(timeout=30)
    assert lake.read("silver/steps").height == 2, out
    assert "needs the stack extra" not in out

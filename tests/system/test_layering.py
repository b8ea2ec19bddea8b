"""The dependency rules of docs/DESIGN.md §2 hold (import-linter contracts and import probes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import REPO

BIN = Path(sys.executable).parent


def test_import_contracts_hold():
    result = subprocess.run([str(BIN / "lint-imports")], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower() or " 0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("gateway.main", ("dagster", "streamlit")),
        ("dashboards", ("dagster", "gateway")),
        (
            "claw_pipelines.contracts",
            ("dagster", "fastapi", "streamlit", "claw_pipelines.lake.delta"),
        ),
        ("claw_pipelines.lake", ("dagster", "fastapi", "streamlit")),
    ],
)
def test_importing_a_layer_loads_nothing_it_must_not(module, forbidden):
    probe = (
        f"import sys, {module}\n"
        f"bad = [m for m in sys.modules\n"
        f"       if m.split('.')[0] in {forbidden!r} or m in {forbidden!r}]\n"
        "print(','.join(sorted(bad)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "", f"{module} imported {result.stdout.strip()}"

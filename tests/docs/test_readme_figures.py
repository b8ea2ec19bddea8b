"""The figures the docs state that are numbers in the code: each read from the code and found
in the README's or the docs pages' text (a changed constant fails here until the docs say it)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from claw_pipelines.materialize import live
from claw_pipelines.settings import ClawSettings

ROOT = Path(__file__).resolve().parents[2]
# the README and every page of the docs site, as one text
README = "\n".join(
    path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
)


def constant(path: str, name: str) -> float:
    """A module-level number of a file (read without importing it: test modules stay apart)."""
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = node.value
            if isinstance(value, ast.Call):  # float(os.environ.get("...", "90"))
                value = value.args[0].args[1]  # type: ignore[attr-defined]
            return float(ast.literal_eval(value))
    raise LookupError(f"{path} has no {name}")


def test_the_soaks_last_what_the_readme_says() -> None:
    soak = constant("tests/system/test_up.py", "SOAK_S")
    queue = constant("tests/system/test_up.py", "MAX_QUEUE")
    assert f"{soak:g} s of `claw up --demo-traffic`" in README
    assert f"run queue ≤ {queue:g}" in README
    chaos = constant("tests/system/test_s3_multi_writer.py", "CHAOS_S")
    docstring = ast.get_docstring(
        ast.parse((ROOT / "tests/system/test_s3_multi_writer.py").read_text())
    )
    assert docstring is not None and f"for {chaos:g} s" in docstring


def test_limits_and_intervals_are_the_code_s() -> None:
    body = ClawSettings.model_fields["max_body_bytes"].default
    assert f"| `CLAW_MAX_BODY_BYTES` | `{body // 2**20} MiB` |" in README
    assert f"at most every {live.BACKGROUND_S:g} s" in README
    retry = f"{live.RETRY_FIRST_S:g} s doubling to {live.RETRY_MAX_S:g} s"
    assert retry in README


def test_import_provenance_says_how_much_of_the_hash_it_keeps() -> None:
    source = (ROOT / "claw_pipelines/interop/chat_logs.py").read_text()
    kept = re.search(r"hashlib\.sha256\(raw\)\.hexdigest\(\)\[:(\d+)\]", source)
    assert kept is not None
    assert f"the first {kept.group(1)} hex\ndigits of its SHA-256" in README

"""Benchmark figures reach the docs from the benchmarks' own JSON lines: `emit` records every
run when asked, the docs hook cites the latest run's figures and lists every run, a figure no
run recorded fails the build, and every figure the docs cite is in the committed records."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from benchmarks.harness import RECORD_ENV, emit

ROOT = Path(__file__).resolve().parents[2]


def the_hook():
    """The site's benchmarks hook, loaded from its file as MkDocs loads it."""
    spec = importlib.util.spec_from_file_location("bench_hook", ROOT / "docs/hooks/benchmarks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_run_is_recorded_and_the_latest_is_cited(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(RECORD_ENV, str(tmp_path))
    for speed, met in ((1_800.5, False), (2_250.0, True)):
        emit(
            "demo_bench",
            target="take-in >= 2,000 steps/s",
            target_met=met,
            baseline=None,
            ratio={"over_floor": 1.4},
            agentic={"steps_per_s": speed},
            targets_met={"take_in": met},
        )
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    recorded = [
        json.loads(line) for line in (tmp_path / "demo_bench.jsonl").read_text().splitlines()
    ]
    assert recorded == printed and len(recorded) == 2  # every run, as printed

    hook = the_hook()
    hook.RESULTS = tmp_path
    text = "speed [[bench demo_bench agentic.steps_per_s]] steps/s, `[[bench NAME FIELD]]`"
    assert hook.on_page_markdown(text, None, None, None) == (
        "speed 2,250 steps/s, `[[bench NAME FIELD]]`"
    )
    with pytest.raises(LookupError, match=r"no agentic\.missing"):
        hook.on_page_markdown("[[bench demo_bench agentic.missing]]", None, None, None)
    with pytest.raises(LookupError, match="no recorded run"):
        hook.on_page_markdown("[[bench never_ran figure]]", None, None, None)
    page = hook.page()
    assert "| not met | over_floor 1.4 | take_in: no |" in page
    assert "| met | over_floor 1.4 | take_in: yes |" in page


def test_every_figure_the_docs_cite_is_recorded():
    hook = the_hook()
    cited = [
        (m.group(1), m.group(2), path)
        for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
        for m in hook.FIGURE.finditer(path.read_text())
    ]
    assert cited, "the docs cite no recorded benchmark figure"
    for name, field, path in cited:
        assert hook.figure(name, field) is not None, (path, name, field)
    # the benchmarks page lists every benchmark script, and records only of those
    listed = set(re.findall(r"^## `(\w+)`", hook.page(), re.M))
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - hook.HELPERS
    assert listed == scripts and "long_runs" in scripts

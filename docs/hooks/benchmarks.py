"""MkDocs hook: benchmark figures from the benchmarks' own JSON lines, never typed by hand.

`make bench` appends every run's line to `benchmarks/results/<benchmark>.jsonl`. This hook
generates `reference/benchmarks.md` (each benchmark's target and every recorded run: when,
whether it met its target, its ratio, each target's verdict) and replaces a page's
`[[bench NAME FIELD]]` with FIELD (a dotted path into the line, e.g.
`agentic.take_in_steps_per_cpu_s`) of NAME's latest recorded run (one in backticks is shown as
written). A name or field that has no recorded value fails the build."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = "reference/benchmarks.md"
FIGURE = re.compile(r"(?<!`)\[\[bench (\S+) (\S+)\]\](?!`)")  # (in backticks: shown as is)
HELPERS = {"harness", "loadgen", "baseline_app", "relay_floor", "__init__"}  # not benchmarks


def runs(name: str) -> list[dict[str, Any]]:
    """Every recorded run of benchmark `name`, oldest first."""
    path = RESULTS / f"{name}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figure(name: str, field: str) -> Any:
    """FIELD (dotted) of NAME's latest recorded run; LookupError when there is none."""
    recorded = runs(name)
    if not recorded:
        raise LookupError(f"benchmark {name} has no recorded run in {RESULTS}")
    value: Any = recorded[-1]
    for part in field.split("."):
        if not isinstance(value, dict) or part not in value:
            raise LookupError(f"benchmark {name}'s latest run has no {field}")
        value = value[part]
    return value


def shown(value: Any) -> str:
    """A figure as the docs print it (thousands separated; booleans as met / not met)."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {shown(v)}" for k, v in value.items())
    if isinstance(value, bool):
        return "met" if value else "not met"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 1_000 else f"{value:,.0f}"
    return str(value)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Replace each `[[bench NAME FIELD]]` with the recorded figure."""
    return FIGURE.sub(lambda m: shown(figure(m.group(1), m.group(2))), markdown)


def on_files(files: Files, config: Any) -> Files:
    """Add the generated benchmarks page."""
    files.append(File.generated(config, PAGE, content=page()))
    return files


def _verdicts(line: dict[str, Any]) -> str:
    """Each named target's verdict in a run (`targets_met`), or nothing."""
    met = line.get("targets_met")
    if not isinstance(met, dict):
        return ""
    return ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in met.items())


def page() -> str:
    """The benchmarks page: every benchmark script (and recorded benchmark), its runs."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - HELPERS
    names = sorted(scripts | {p.stem for p in RESULTS.glob("*.jsonl")})
    out = [
        "# Benchmarks",
        "",
        "Every run `make bench` recorded (`benchmarks/results/<benchmark>.jsonl`, one JSON line",
        "a run as the script printed it), newest last. These machines are noisy: each target",
        "compares against a baseline measured in the same run, and every run is kept, not the",
        "best one. Run one benchmark with `CLAW_BENCH_RECORD=benchmarks/results` set to add",
        "its run here.",
        "",
    ]
    for name in names:
        recorded = runs(name)
        out += [f"## `{name}`", ""]
        if not recorded:
            out += ["No run recorded yet.", ""]
            continue
        out += [recorded[-1]["target"].replace("|", "\\|"), ""]
        out += ["| measured at (UTC) | target met | ratio | targets |", "|---|---|---|---|"]
        for line in recorded:
            ratio = "" if line.get("ratio") is None else shown(line["ratio"])
            met = shown(bool(line["target_met"]))
            out.append(f"| {line['measured_at']} | {met} | {ratio} | {_verdicts(line)} |")
        out.append("")
    return "\n".join(out)

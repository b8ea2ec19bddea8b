"""MkDocs hook: the reference pages, generated from the code as the site builds, so they cannot
drift from it: the CLI (its own parser's help), the HTTP API (the gateway's OpenAPI document),
the settings (`ClawSettings`), the table schemas (`contracts.tables`)."""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

from mkdocs.structure.files import File, Files

PAGES = {
    "reference/cli.md": "cli",
    "reference/http.md": "http",
    "reference/settings.md": "settings",
    "reference/tables.md": "tables",
}


def on_files(files: Files, config: Any) -> Files:
    """Add the generated reference pages."""
    for path, kind in PAGES.items():
        files.append(File.generated(config, path, content=GENERATORS[kind]()))
    return files


def _verbs(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every sub-command under `parser`, depth first, with its full name."""
    found = []
    for action in parser._actions:  # argparse keeps its sub-parsers there
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((name, sub))
                found += [(f"{name} {n}", p) for n, p in _verbs(sub)]
    return found


def cli() -> str:
    from claw_pipelines.app.cli import build_parser

    parser = build_parser()
    out = ["# CLI reference", "", "Every `claw` verb, as its own `--help` prints it.", ""]
    for name, sub in _verbs(parser):
        out += [f"## `claw {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def http() -> str:
    from claw_pipelines.settings import ClawSettings
    from gateway.main import create_app

    with tempfile.TemporaryDirectory() as lake:
        document = create_app(ClawSettings(lake_uri=lake)).openapi()
    rows = [
        (
            method.upper(),
            f"`{path}`",
            operation.get("summary") or "",
            ", ".join(sorted(operation.get("responses", {}))),
        )
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    ]
    intro = (
        "Every gateway route, from its OpenAPI document (`GET /openapi.json` on a running "
        "gateway; `/docs` renders it). Errors use the OpenAI envelope "
        '(`{"error": {"message", "type", "param", "code"}}`).'
    )
    return _table_page(
        "HTTP API reference", intro, ("method", "path", "what it does", "statuses"), rows
    )


def settings() -> str:
    from pydantic_core import PydanticUndefined

    from claw_pipelines.settings import ClawSettings

    rows = []
    for name, field in ClawSettings.model_fields.items():
        default = field.default
        if default is PydanticUndefined or field.default_factory is not None:
            shown = "computed"
        elif default is None:
            shown = "unset"
        else:
            shown = f"`{default}`"
        rows.append((f"`CLAW_{name.upper()}`", shown, field.description or ""))
    intro = "Environment variables (prefix `CLAW_`, also read from `.env`), from `ClawSettings`."
    return _table_page("Settings reference", intro, ("variable", "default", "meaning"), rows)


def _table_page(title: str, intro: str, columns: tuple[str, ...], rows: list[tuple]) -> str:
    """A page of one Markdown table (cells' pipes escaped)."""
    out = [f"# {title}", "", intro, "", "| " + " | ".join(columns) + " |"]
    out.append("|" + "---|" * len(columns))
    for row in rows:
        out.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    return "\n".join(out) + "\n"


def tables() -> str:
    from claw_pipelines.contracts.tables import TABLES

    out = [
        "# Table schemas",
        "",
        "Every Delta table of a lake, from `claw_pipelines.contracts.tables` (gold datasets,",
        "trees and rejections: one table per curation spec under the prefix shown).",
        "",
    ]
    for name, spec in TABLES.items():
        out += [f"## `{name}`", ""]
        if spec.description:
            out += [spec.description, ""]
        if spec.partition_by:
            out += [f"Partitioned by {', '.join(f'`{c}`' for c in spec.partition_by)}.", ""]
        out += ["| column | type |", "|---|---|"]
        out += [f"| `{f.name}` | `{f.type}` |" for f in spec.schema]
        out.append("")
    return "\n".join(out)


GENERATORS = {"cli": cli, "http": http, "settings": settings, "tables": tables}

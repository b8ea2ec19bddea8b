"""Every design-doc citation in the repository ("docs/DESIGN.md §N") names a section that
docs/DESIGN.md has, and none cites the design doc by another name."""

from __future__ import annotations

import re
import subprocess

from tests.support.servers import REPO

DESIGN = REPO / "docs" / "DESIGN.md"
CITATION = re.compile(r"(\S*)DESIGN(?:\.md)?\)? §(\d+)")


def repository_files(*suffixes: str) -> list[str]:
    """Tracked and new (not ignored) files of the repository with these suffixes."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return [name for name in listed if name.endswith(suffixes) and (REPO / name).is_file()]


def citations() -> list[tuple[str, str, str]]:
    """(file, how it names the doc, section number) of every citation."""
    found = []
    for name in repository_files(".py", ".md"):
        for match in CITATION.finditer((REPO / name).read_text(encoding="utf-8")):
            found.append((name, match[0], match[2]))
    return found


def test_every_design_citation_names_a_section_of_docs_design_md():
    sections = set(re.findall(r"^## (\d+)\. ", DESIGN.read_text(encoding="utf-8"), re.M))
    assert sections >= {str(n) for n in range(1, 10)}  # the numbering citations rely on
    found = citations()
    assert len(found) >= 8, found  # the code's own citations are seen
    for name, text, section in found:
        if name == "docs/DESIGN.md":
            continue
        assert "docs/DESIGN.md" in text, f"{name}: cite it as docs/DESIGN.md §N, not {text!r}"
        assert section in sections, f"{name}: {text!r} names no section of docs/DESIGN.md"

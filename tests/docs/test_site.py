"""The docs site builds as `make docs` builds it, with `--strict`: no page outside the
navigation, no link to a page or anchor that is not there; and the README fits a screen."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "tutorials" / "record-an-agent" / "index.html").exists()
    assert (tmp_path / "DESIGN" / "index.html").exists()


def test_the_readme_fits_a_screen_and_links_only_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).exists(), target

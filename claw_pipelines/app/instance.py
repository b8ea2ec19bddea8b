"""The Dagster instance `claw up` and `claw demo` use: where `DAGSTER_HOME` is, and the
dagster.yaml written there (maintenance runs one at a time: its op pool and its run tag)."""

from __future__ import annotations

import os
from pathlib import Path

from claw_pipelines.settings import ClawSettings

DAGSTER_YAML = """\
# Written by `claw up`. Maintenance runs one at a time (its op pool and its run tag).
telemetry:
  enabled: false
concurrency:
  pools:
    default_limit: 1
  runs:
    max_concurrent_runs: 4
    tag_concurrency_limits:
      - key: claw/maintenance
        limit: 1
"""


def dagster_home(settings: ClawSettings) -> Path:
    """`DAGSTER_HOME`, or `<lake>/_dagster` (a local lake), with a dagster.yaml written once."""
    home = os.environ.get("DAGSTER_HOME")
    if home:
        path = Path(home)
    elif settings.lake_is_remote:
        path = Path.home() / ".claw" / "dagster"
    else:
        path = Path(settings.lake_uri).expanduser().resolve() / "_dagster"
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "dagster.yaml").exists():
        (path / "dagster.yaml").write_text(DAGSTER_YAML)
    initialize_storage(path)
    return path


def initialize_storage(home: Path) -> None:
    """Create (migrate) the Dagster instance's storage under `home` in this process, before
    a daemon and a webserver start on it: two processes creating a fresh SQLite storage at
    once can both stamp its schema version, and neither can load the code afterwards."""
    import dagster as dg

    with dg.DagsterInstance.from_config(str(home)):
        pass

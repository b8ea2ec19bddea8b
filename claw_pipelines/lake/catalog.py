"""What a lake holds: whether there is one at all, and its gold datasets."""

from __future__ import annotations

from pathlib import Path

from claw_pipelines.contracts.tables import GOLD_LINEAGE, gold_dataset_table
from claw_pipelines.lake.delta import Lake


def lake_exists(lake: Lake) -> bool:
    """Whether a local lake's directory exists (an object store has no directory to look
    for: a remote lake is taken as there, and a missing table says so instead)."""
    return lake.is_remote or Path(lake.uri).is_dir()


def gold_datasets(lake: Lake) -> list[str]:
    """The gold datasets written so far (those lineage records whose table exists), sorted."""
    if not lake.exists(GOLD_LINEAGE):
        return []
    names = lake.read(GOLD_LINEAGE, columns=["dataset"])["dataset"].unique().sort()
    return [name for name in names.to_list() if lake.exists(gold_dataset_table(name))]

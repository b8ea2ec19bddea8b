"""What `gold/lineage` says of one dataset: which spec wrote each policy-version partition,
with which dataset and trees versions. Read by the table's change feed (the rows written
since the last look, not the whole table) and kept while the table has not moved; the stored
trees (`consume.source`) and the contract (`consume.judge`) both ask it.
"""

from __future__ import annotations

import polars as pl

from claw_pipelines.consume.kept import Kept
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import GOLD_LINEAGE
from claw_pipelines.lake.catalog import owner_of
from claw_pipelines.lake.delta import Lake

# what a dataset keeps of its lineage rows: which spec wrote each partition, and the trees
LINEAGE_COLUMNS = ["policy_version", "spec_hash", "dataset_version", "trees_version", "written_at"]
# the spec of a dataset version's newest write, and the spec hash of each partition's newest
Specs = tuple[CurationSpec | None, dict[int, str]]


class Lineage:
    """One dataset's lineage rows, its specs as of a dataset version, and specs by hash."""

    def __init__(self, lake: Lake, name: str) -> None:
        self.lake, self.name = lake, name
        # lineage version -> this dataset's rows (LINEAGE_COLUMNS) in written order
        self._rows: Kept[int, pl.DataFrame] = Kept()
        # (dataset version, lineage version) -> its specs (live delivery asks of the newest)
        self._specs: Kept[tuple[int, int | None], Specs] = Kept()
        # spec hash -> the spec lineage recorded (a hash never changes its spec)
        self._spec_by_hash: dict[str, CurationSpec] = {}

    def specs(self, at: int) -> Specs:
        """The spec of the newest write at or before dataset version `at`, and the spec hash
        of each partition's newest write (kept per lineage version)."""
        lineage = self.lake.version(GOLD_LINEAGE)
        return self._specs.get((at, lineage), lambda: self._read_specs(at, lineage))

    def _read_specs(self, at: int, lineage: int | None) -> Specs:
        if lineage is None:
            return None, {}
        rows = self.rows(lineage).filter(pl.col("dataset_version") <= at)
        if not rows.height:
            return None, {}
        spec = self.spec_of(rows["spec_hash"][-1])
        latest = rows.group_by("policy_version").agg(pl.col("spec_hash").last())
        return spec, {int(v): h for v, h in latest.iter_rows()}

    def written(self, policy_version: int, at: int) -> pl.DataFrame:
        """The writes of partition `policy_version` at or before dataset version `at`, oldest
        first (the lineage table must exist)."""
        return (
            self.rows(self.lake.version(GOLD_LINEAGE))  # type: ignore[arg-type]
            .filter(
                (pl.col("policy_version") == policy_version) & (pl.col("dataset_version") <= at)
            )
            .sort("dataset_version", maintain_order=True)
        )

    def rows(self, lineage: int) -> pl.DataFrame:
        """This dataset's lineage rows (LINEAGE_COLUMNS) in written order, as of lineage
        version `lineage`: the rows written since the last call are read (the change feed),
        not the whole table."""
        kept = self._rows.entry
        if kept is not None and kept[0] == lineage:
            return kept[1]
        mine = pl.col("dataset") == self.name
        new = None
        if kept is not None and kept[0] < lineage:
            added = self.lake.changes(GOLD_LINEAGE, kept[0], lineage, [*LINEAGE_COLUMNS, "dataset"])
            if added is not None:
                new = pl.from_arrow(added).filter(mine).select(LINEAGE_COLUMNS)
                new = pl.concat([kept[1], new], how="vertical_relaxed")
        if new is None:
            new = self.lake.read(GOLD_LINEAGE, lineage, columns=LINEAGE_COLUMNS, where=mine)
        return self._rows.put(lineage, new.sort("written_at", maintain_order=True))

    def tenant(self) -> str | None:
        """The tenant whose data the dataset holds (`owner_of` every spec that wrote it)."""
        lineage = self.lake.version(GOLD_LINEAGE)
        if lineage is None:
            return None
        hashes = self.rows(lineage)["spec_hash"].unique().to_list()
        return owner_of({self.spec_of(spec_hash).tenant for spec_hash in hashes})

    def spec_of(self, spec_hash: str) -> CurationSpec:
        """The spec with this hash, as lineage recorded it (read once per hash)."""
        if spec_hash not in self._spec_by_hash:
            text = (
                self.lake.scan(GOLD_LINEAGE)
                .filter((pl.col("dataset") == self.name) & (pl.col("spec_hash") == spec_hash))
                .select("spec_json")
                .head(1)
                .collect()["spec_json"][0]
            )
            self._spec_by_hash[spec_hash] = CurationSpec.model_validate_json(text)
        return self._spec_by_hash[spec_hash]

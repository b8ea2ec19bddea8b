"""The one resource every asset uses: the lake and the settings it was opened with."""

import dagster as dg

from claw_pipelines.lake.delta import Lake
from claw_pipelines.settings import ClawSettings


class ClawLake(dg.ConfigurableResource):
    """The lake named by `lake_uri`, else by `CLAW_LAKE_URI` (and the other `CLAW_` settings)."""

    lake_uri: str = ""

    def settings(self) -> ClawSettings:
        """The `CLAW_` settings, with this resource's lake URI when set."""
        return ClawSettings().with_overrides(lake_uri=self.lake_uri or None)

    def lake(self) -> Lake:
        """The lake to read and write."""
        return Lake.from_settings(self.settings())


# Every run is one step (a multi-asset or one op): executing it in the run's own process
# saves a second Python start per run (seconds under load), so data reaches gold sooner.
defs = dg.Definitions(resources={"claw": ClawLake()}, executor=dg.in_process_executor)

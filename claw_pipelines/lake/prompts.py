"""Steps read back with their whole prompts, from a table that stores prompts relative to
earlier steps (silver/steps, gold/datasets/<name>: docs/DESIGN.md §18).

`with_prompts` decodes rows already read (`transforms.contexts`), reading from the same table
version only what their references need and the rows do not hold: the rest of their
trajectories (silver) or trees (gold), in one read, not a read per reference level. Rows of
a table written before the layout hold their whole prompts and are returned as they are.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.transforms.contexts import (
    PREFIX_TYPES,
    STORED_PROMPT_COLUMNS,
    has_references,
    with_prompt_ids,
)

# where a table's references stay: a step's trajectory (silver), its tree in its partition (gold)
SILVER_SCOPE = ("trajectory_uid",)
GOLD_SCOPE = ("policy_version", "tree_id")
# the columns a read needs so that its prompts can be decoded
PROMPT_READ_COLUMNS = [c for c in STORED_PROMPT_COLUMNS if c != "step_key"]


def scope_of(table: str) -> tuple[str, ...]:
    """The columns that hold a step of `table` and every step its prompt refers to."""
    return SILVER_SCOPE if table == SILVER_STEPS else GOLD_SCOPE


def with_prompts(
    lake: Lake,
    table: str,
    version: int | None,
    rows: pl.DataFrame,
    where: pl.Expr | None = None,
) -> pl.DataFrame:
    """`rows` of `table` at `version` (STORED_PROMPT_COLUMNS and the table's scope columns,
    as read) with their whole `prompt_ids`; the layout columns are dropped. The steps their
    prompts refer to and they lack are read from the same version (`where`: a filter those
    rows satisfy, e.g. their partitions)."""
    scope = scope_of(table)
    if not has_references(rows):
        return with_prompt_ids(rows)

    def fetch(wanted: pl.DataFrame) -> pl.DataFrame:
        keys = wanted.select(scope).unique()
        found = pl.lit(True)
        for column in scope:
            found = found & pl.col(column).is_in(keys[column].unique().implode())
        if where is not None:
            found = found & where
        columns = list(dict.fromkeys([*STORED_PROMPT_COLUMNS, *scope]))
        return lake.read(table, version, columns=columns, where=found)

    return with_prompt_ids(rows, fetch, scope)


def prompt_columns(columns: list[str], table: str) -> list[str]:
    """`columns` to read of `table`, with what decoding `prompt_ids` needs when they name it."""
    if "prompt_ids" not in columns:
        return columns
    return list(dict.fromkeys([*columns, "step_key", *PROMPT_READ_COLUMNS, *scope_of(table)]))


def arrow_with_prompt_ids(table: pa.Table) -> pa.Table:
    """A whole table's rows as pyarrow read them (e.g. `DeltaTable(uri).to_pyarrow_table()`)
    with their full `prompt_ids`, the layout columns dropped: what a pyarrow reader of the lake
    calls (docs/DESIGN.md §18). The rows must hold every step their prompts refer to (a whole
    table, or whole trajectories or trees of it)."""
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    out = with_prompt_ids(frame)
    return out.select([c for c in frame.columns if c not in PREFIX_TYPES]).to_arrow()


def read_steps(
    lake: Lake,
    table: str,
    version: int | None = None,
    columns: list[str] | None = None,
    where: pl.Expr | None = None,
) -> pl.DataFrame:
    """Rows of `table` (silver/steps or a gold dataset) as `Lake.read` reads them, with
    their whole `prompt_ids` and without the layout columns: the read for code that wants
    every prompt whole."""
    rows = lake.read(
        table, version, None if columns is None else prompt_columns(columns, table), where
    )
    whole = with_prompts(lake, table, version, rows)
    return whole if columns is None else whole.select(columns)


# DuckDB (docs/DESIGN.md §18): `claw_steps('<table uri>')` reads silver/steps or a gold dataset
# with every step's whole `prompt_ids`, resolving the references level by level (a recursive
# CTE); the layout columns are left out. Run once per connection, after `LOAD delta`.
DUCKDB_MACRO = """
CREATE OR REPLACE MACRO claw_steps(uri) AS TABLE
WITH RECURSIVE
    stored AS (SELECT * FROM delta_scan(uri)),
    whole(step_key, prompt, response) AS (
        SELECT step_key, coalesce(prompt_suffix_ids, prompt_ids), response_ids
        FROM stored
        WHERE prefix_step_key IS NULL
        UNION ALL
        SELECT
            s.step_key,
            list_concat(
                list_slice(list_concat(w.prompt, w.response), 1, s.prefix_len),
                s.prompt_suffix_ids
            ),
            s.response_ids
        FROM stored s JOIN whole w ON s.prefix_step_key = w.step_key
    )
SELECT stored.* EXCLUDE (prompt_ids, prefix_step_key, prefix_len, prompt_suffix_ids),
       whole.prompt AS prompt_ids
FROM stored JOIN whole USING (step_key)
"""

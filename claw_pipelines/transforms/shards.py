"""The shard key of steps and records, and its bucket (docs/DESIGN.md §19).

Every row a shard derives stays within its key: a scoped step's prompt group
(`coalesce(prompt_uid, trajectory_uid)`: steps, trajectories, rewards, gold units and trees
all stay within one group), and a tenant's unscoped calls (stitching places an unscoped call
in an earlier one's trajectory of the same tenant, and their groups are derived from content
within the tenant). The bucket is a stable hash of the key (64-bit FNV-1a of its UTF-8 bytes,
vectorized over the rows, then mixed: the same in every process, version and machine), modulo
`contracts.shards.BUCKETS`.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.shards import BUCKETS, SHARD_ORDER, Slot, bit_reversed
from claw_pipelines.contracts.tables import STEP_KINDS

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_MIX_1, _MIX_2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def record_shard_keys(records: pl.DataFrame) -> pl.Series:
    """The shard key of bronze step records (`kind`, `tenant`, `trajectory_uid`,
    `prompt_uid`, `payload`): a proxied call the gateway did not scope goes by its tenant."""
    proxied = (records["kind"] != "step").fill_null(False)
    unscoped = pl.Series("unscoped", np.zeros(records.height, dtype=bool))
    if proxied.any():  # only a proxied call's payload is parsed
        scoped = records.filter(proxied)["payload"].str.json_path_match("$.metadata.scoped")
        unscoped = unscoped.scatter(proxied.arg_true(), (scoped == "false").fill_null(False))
    return records.select(_key(pl.lit(unscoped))).to_series()


def with_shard_order(records: pa.Table) -> pa.Table:
    """Bronze `records` (with a `shard_order` column) laid out for shards: `shard_order` set
    (a step record's bucket, its bits reversed; null for facts, which every shard reads) and
    the rows stably sorted by it, facts first, so the step records of shard i of 2^k lie in
    one range of the file's row groups and a shard's read skips the others'
    (`Slot.order_range`). Records of one key keep their order (one key, one order)."""
    if not records.num_rows:
        return records
    keys = pl.from_arrow(
        records.select(["kind", "tenant", "trajectory_uid", "prompt_uid", "payload"])
    )
    assert isinstance(keys, pl.DataFrame)
    is_step = keys["kind"].is_in(STEP_KINDS).to_numpy()
    orders = np.full(records.num_rows, -1, dtype=np.int64)
    if is_step.any():
        orders[is_step] = bit_reversed(buckets_of(record_shard_keys(keys.filter(is_step))))
    column = pa.array(orders.astype(np.int32), mask=~is_step, type=pa.int32())
    records = records.set_column(
        records.schema.get_field_index(SHARD_ORDER), records.schema.field(SHARD_ORDER), column
    )
    if (np.diff(orders) >= 0).all():  # already in order (facts, -1, first)
        return records
    frame = pl.from_arrow(records)
    assert isinstance(frame, pl.DataFrame)
    taken = frame[np.argsort(orders, kind="stable")]  # polars: far faster on lists than take
    return taken.to_arrow().cast(records.schema)


def step_shard_keys(steps: pl.DataFrame) -> pl.Series:
    """The shard key of silver steps (`unscoped`, `tenant`, `trajectory_uid`, `prompt_uid`)."""
    return steps.select(_key(pl.col("unscoped").fill_null(False))).to_series()


def stored_step_shard_keys(steps: pl.DataFrame) -> pl.Series:
    """The shard key of steps as silver stores them (`origin_step_key`, `tenant`,
    `trajectory_uid`, `prompt_uid`): an unscoped call keeps the key its gateway gave it as
    `origin_step_key`, so it goes by its tenant."""
    return steps.select(_key(pl.col("origin_step_key").is_not_null())).to_series()


def owned(slot: Slot, keys: pl.Series) -> np.ndarray:
    """Which of the shard `keys` are `slot`'s (their buckets)."""
    return slot.owns(buckets_of(keys))


def _key(unscoped: pl.Expr) -> pl.Expr:
    group = pl.coalesce("prompt_uid", "trajectory_uid", "tenant")
    return pl.when(unscoped).then(pl.col("tenant")).otherwise(group).alias("shard_key")


def stable_hashes(keys: pl.Series) -> np.ndarray:
    """64-bit FNV-1a of each key's UTF-8 bytes (null: of no bytes), a step per byte position
    over the rows still that long."""
    text = keys.cast(pl.String).fill_null("").to_arrow()
    text = (text.combine_chunks() if isinstance(text, pa.ChunkedArray) else text).cast(
        pa.large_string()
    )
    count = len(text)
    _, offsets_buffer, data_buffer = text.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int64)[text.offset : text.offset + count + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else None
    lengths = np.diff(offsets)
    order = np.argsort(-lengths, kind="stable")  # longest first: live rows are a prefix
    starts, remaining = offsets[:-1][order], lengths[order]
    hashes = np.full(count, _FNV_OFFSET, dtype=np.uint64)
    longest = int(remaining[0]) if count else 0
    alive = count
    with np.errstate(over="ignore"):
        for position in range(longest):
            while alive and remaining[alive - 1] <= position:
                alive -= 1
            assert data is not None
            byte = data[starts[:alive] + position].astype(np.uint64)
            hashes[:alive] = (hashes[:alive] ^ byte) * _FNV_PRIME
    out = np.empty(count, dtype=np.uint64)
    out[order] = hashes
    return out


def buckets_of(keys: pl.Series) -> np.ndarray:
    """Each key's bucket, 0 .. BUCKETS - 1: its hash mixed (MurmurHash3's 64-bit finalizer:
    FNV-1a's low bits follow the last bytes, and keys often differ only in a counter there)."""
    mixed = stable_hashes(keys)
    with np.errstate(over="ignore"):
        for multiplier in (_MIX_1, _MIX_2):
            mixed ^= mixed >> np.uint64(33)
            mixed *= multiplier
        mixed ^= mixed >> np.uint64(33)
    return (mixed % np.uint64(BUCKETS)).astype(np.int64)

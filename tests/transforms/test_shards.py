"""Shard keys and their buckets: stable, one key a group (or a tenant's unscoped calls),
every bucket owned by exactly one shard of N."""

from __future__ import annotations

import json
import random

import numpy as np
import polars as pl
import pytest

from claw_pipelines.contracts.shards import BUCKETS, Slot, bit_reversed
from claw_pipelines.transforms.shards import (
    buckets_of,
    record_shard_keys,
    stable_hashes,
    step_shard_keys,
    with_shard_order,
)


def fnv1a(text: str) -> int:
    """64-bit FNV-1a, one byte at a time (the reference)."""
    value = 0xCBF29CE484222325
    for byte in text.encode():
        value = ((value ^ byte) * 0x100000001B3) % 2**64
    return value


def test_hashes_are_fnv1a_of_the_utf8_bytes():
    rng = random.Random(7)
    alphabet = "abcXYZ0123-_:/ é字🙂"
    keys = [
        "",
        "a",
        "foobar",
        *("".join(rng.choices(alphabet, k=rng.randrange(0, 90))) for _ in range(300)),
    ]
    got = stable_hashes(pl.Series(keys, dtype=pl.String))
    assert got.dtype == np.uint64
    assert [int(h) for h in got] == [fnv1a(k) for k in keys]
    assert int(got[1]) == 0xAF63DC4C8601EC8C  # the published FNV-1a 64 of "a"
    nulls = stable_hashes(pl.Series([None, "a"], dtype=pl.String))
    assert int(nulls[0]) == fnv1a("") and int(nulls[1]) == fnv1a("a")
    sliced = pl.Series(keys, dtype=pl.String).slice(5, 20)  # an offset into the buffers
    assert [int(h) for h in stable_hashes(sliced)] == [fnv1a(k) for k in keys[5:25]]


def fmix64(value: int) -> int:
    """MurmurHash3's 64-bit finalizer (the reference)."""
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        value ^= value >> 33
        value = (value * multiplier) % 2**64
    return value ^ (value >> 33)


def test_buckets_are_the_mixed_hash_modulo_the_bucket_count():
    keys = ["g1", "group-17", "tenant-a", "", "字"]
    expected = [fmix64(fnv1a(k)) % BUCKETS for k in keys]
    assert buckets_of(pl.Series(keys)).tolist() == expected


def _record(kind: str, trajectory: str | None, group: str | None, scoped: bool | None) -> dict:
    metadata = {} if scoped is None else {"scoped": scoped}
    return {
        "kind": kind,
        "tenant": "tenant-a",
        "trajectory_uid": trajectory,
        "prompt_uid": group,
        "payload": json.dumps({"metadata": metadata}),
    }


def test_records_go_by_prompt_group_and_unscoped_calls_by_tenant():
    records = pl.DataFrame(
        [
            _record("step", "t1", "g1", None),  # white box: its group
            _record("step", "t2", None, None),  # no group: its trajectory
            _record("chat_completion", "t3", "g1", True),  # scoped proxied call
            _record("chat_completion", "gw-key", None, False),  # unscoped: the tenant
            _record("completion", "gw-key-2", "gw-group", False),
        ]
    )
    assert record_shard_keys(records).to_list() == ["g1", "t2", "g1", "tenant-a", "tenant-a"]
    steps = pl.DataFrame(
        {
            "unscoped": [False, None, True],
            "tenant": ["tenant-a"] * 3,
            "trajectory_uid": ["t1", "t2", "stitched"],
            "prompt_uid": ["g1", None, "content-group"],
        }
    )
    assert step_shard_keys(steps).to_list() == ["g1", "t2", "tenant-a"]


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_every_bucket_is_owned_by_exactly_one_shard_and_keys_spread(count):
    buckets = np.arange(BUCKETS)
    owners = np.stack([Slot(i, count).owns(buckets) for i in range(count)])
    assert (owners.sum(axis=0) == 1).all()
    keys = pl.Series([f"group-{i}" for i in range(20_000)])
    placed = buckets_of(keys)
    assert placed.min() >= 0 and placed.max() < BUCKETS
    shares = [Slot(i, count).owns(placed).mean() for i in range(count)]
    assert max(shares) - min(shares) < 0.03, shares
    again = buckets_of(pl.Series([f"group-{i}" for i in range(20_000)]))
    assert (again == placed).all()  # the same key, the same bucket


@pytest.mark.parametrize("count", [1, 2, 4, 8, 16])
def test_a_power_of_two_shards_orders_are_one_range_holding_exactly_its_buckets(count):
    buckets = np.arange(BUCKETS)
    orders = bit_reversed(buckets)
    assert sorted(orders.tolist()) == list(range(BUCKETS))  # a permutation of the buckets
    for index in range(count):
        slot = Slot(index, count)
        low, high = slot.order_range()
        assert high - low == BUCKETS // count
        assert (((orders >= low) & (orders < high)) == slot.owns(buckets)).all()


@pytest.mark.parametrize("count", [3, 5, 6])
def test_other_counts_have_no_range_and_read_everything(count):
    assert all(Slot(i, count).order_range() is None for i in range(count))


def test_bronze_is_laid_out_facts_first_then_by_shard_order_keeping_each_keys_order():
    rows = [
        _record("step", f"t{i % 7}", f"g{i % 7}", None) | {"step_index": i, "event_id": f"e{i}"}
        for i in range(40)
    ]
    rows.insert(5, {**_record("feedback", "t1", None, None), "event_id": "f1"})
    frame = pl.DataFrame(rows).with_columns(shard_order=pl.lit(None, pl.Int32))
    laid = pl.from_arrow(with_shard_order(frame.to_arrow()))
    assert laid["event_id"][0] == "f1" and laid["shard_order"][0] is None
    steps = laid.filter(pl.col("kind") == "step")
    expected = bit_reversed(buckets_of(record_shard_keys(steps)))
    assert steps["shard_order"].to_list() == expected.tolist()
    assert steps["shard_order"].is_sorted()
    for _, group in steps.group_by("trajectory_uid"):  # a key's records in arrival order
        assert group["step_index"].is_sorted()
    assert sorted(laid["event_id"].to_list()) == sorted(frame["event_id"].to_list())

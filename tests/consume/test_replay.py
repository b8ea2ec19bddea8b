"""Replay policies of live delivery: a group delivered to a consumer rank up to `max_uses`
times, a cooldown of that rank's batches apart, fresh groups first, in an order (oldest,
newest, reward variance); each delivery recorded with its use number, so restarts (a trainer
SIGKILLed mid-run), ranks, racing processes of one rank and `replay` keep the counts, and
exactly-once stays the default."""

from __future__ import annotations

import dataclasses
import re
import signal
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime
from functools import partial
from itertools import pairwise

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from claw_pipelines.consume.batch import Batch
from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.consume.delivery import choose, consumer_positions, in_order
from claw_pipelines.contracts.errors import ContractViolation
from claw_pipelines.contracts.tables import GOLD_CONSUMPTION, GOLD_CONSUMPTION_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.increments import update_dataset
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import LIVE, drifted, group_of, grown_lake, land
from tests.support.racing import race_in_processes, race_next_batch_in_process
from tests.support.servers import REPO

Delivery = tuple[int, str, int]  # (batch index, group, use number)


@pytest.fixture
def grown(tmp_path) -> Lake:
    return grown_lake(tmp_path / "lake")


def pull_all(dataset: Dataset, consumer: str, groups: int = 1, **options) -> list[Batch]:
    """Every batch `next_batch` gives now (timeout 0), until it gives none."""
    batches: list[Batch] = []
    while batch := dataset.next_batch(groups, consumer=consumer, timeout=0, **options):
        batches.append(batch)
    return batches


def deliveries(batches: list[Batch]) -> list[Delivery]:
    return [(b.batch_index, g, u) for b in batches for g, u in zip(b.groups, b.uses, strict=True)]


def assert_reused(delivered: list[Delivery], units: set[str], max_uses: int, cooldown: int):
    """Each of `units` (and nothing else) delivered exactly `max_uses` times, numbered 1..k in
    batch order, never twice within `cooldown` batches."""
    by_unit: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for index, unit, use in sorted(delivered):
        by_unit[unit].append((index, use))
    assert set(by_unit) == units
    for unit, uses in by_unit.items():
        assert [use for _, use in uses] == list(range(1, max_uses + 1)), (unit, uses)
        indexes = [index for index, _ in uses]
        assert all(b - a > cooldown for a, b in pairwise(indexes)), (unit, indexes)


def recorded(lake: Lake, consumer: str, rank: int = 0) -> list[Delivery]:
    rows = lake.read(GOLD_CONSUMPTION).filter(
        (pl.col("consumer") == consumer) & (pl.col("rank") == rank)
    )
    return sorted(
        (index, group, use)
        for index, groups, uses in rows.select("batch_index", "groups", "uses").iter_rows()
        for group, use in zip(groups, uses, strict=True)
    )


def every_unit(dataset: Dataset) -> set[str]:
    """The dataset's units, as an exactly-once consumer of it is given them."""
    return {g for b in pull_all(dataset, "census") for g in b.groups}


def test_the_arguments_are_checked_before_anything_is_read(grown):
    dataset = Dataset(grown, "live")
    wrong = {
        "max_uses": (0, "max_uses must be at least 1, not 0"),
        "cooldown": (-1, "cooldown must be at least 0, not -1"),
        "order": ("random", "order must be one of 'oldest', 'newest', 'reward_variance', not "),
    }
    for argument, (value, message) in wrong.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            dataset.next_batch(consumer="t", timeout=0, **{argument: value})
        with pytest.raises(ValueError, match=re.escape(message)):
            next(dataset.follow(consumer="t", **{argument: value}))
    assert not grown.exists(GOLD_CONSUMPTION)  # nothing read, nothing recorded


def test_each_group_twice_a_cooldown_apart_fresh_ones_first_and_replayed(grown):
    dataset = Dataset(grown, "live")
    once = pull_all(dataset, "once", 2)  # the default: exactly once
    units = [g for b in once for g in b.groups]
    assert len(units) == len(set(units)) == 12 and {u for b in once for u in b.uses} == {1}
    assert pull_all(dataset, "once", max_uses=1) == []  # max_uses=1 is the default

    batches = pull_all(dataset, "twice", 2, max_uses=2, cooldown=2)
    delivered = deliveries(batches)
    assert_reused(delivered, set(units), 2, 2)
    assert len(batches) == 12 and [b.batch_index for b in batches] == list(range(12))
    groups = [g for _, g, _ in delivered]
    assert [u for _, _, u in delivered] == [1] * 12 + [2] * 12  # every fresh one before a reuse
    assert groups[:12] == units and groups[12:] == units  # in the same order, oldest first
    assert recorded(grown, "twice") == sorted(delivered)

    again = list(dataset.replay("twice"))  # rebuilt with their reuses, in order
    seen = [(b.batch_index, b.groups, b.uses, b.step_keys) for b in batches]
    assert [(b.batch_index, b.groups, b.uses, b.step_keys) for b in again] == seen
    assert [b.uses for b in dataset.replay("twice", after_batch=9)] == [[2, 2], [2, 2]]

    positions = consumer_positions(grown, "live").filter(pl.col("consumer") != "census")
    shown = positions.select("consumer", "batches", "groups", "deliveries").to_dicts()
    assert shown == [
        {"consumer": "once", "batches": 6, "groups": 12, "deliveries": 12},
        {"consumer": "twice", "batches": 12, "groups": 12, "deliveries": 24},
    ]


def test_a_cooldown_longer_than_the_share_waits_for_fresh_groups(grown):
    dataset = Dataset(grown, "live")
    first = pull_all(dataset, "patient", max_uses=2, cooldown=12)
    assert [b.uses for b in first] == [[1]] * 12  # nothing may come again before batch 13
    land(grown, group_of("late", [9, 9], [1.0, 0.0]))
    build_silver(grown)
    update_dataset(grown, LIVE)
    rest = pull_all(dataset, "patient", max_uses=2, cooldown=12)
    assert rest[0].groups == ["1:late"] and rest[0].batch_index == 12  # batch 12 passes
    order = [b.groups[0] for b in first] + ["1:late"]
    assert [b.groups[0] for b in rest[1:]] == order  # each back cooldown + 1 batches later
    assert_reused(deliveries(first + rest), set(order), 2, 12)


def landed_one_by_one(lake: Lake, returns: dict[str, list[float | None]]) -> Dataset:
    """Groups of `live` landed in this order, one increment each (so each lands later)."""
    for n, (group, values) in enumerate(returns.items()):
        land(lake, group_of(group, [n, 5], values))  # type: ignore[arg-type]
        build_silver(lake)
        update_dataset(lake, LIVE)
    return Dataset(lake, "live")


def test_each_order_does_what_it_says(tmp_path):
    returns: dict[str, list[float | None]] = {
        "narrow": [0.6, 0.4],  # reward variance 0.01
        "spread": [1.0, 0.0],  # 0.25
        "unscored": [None, None],  # no reward: last
        "flat": [0.5, 0.5],  # 0
        "triple": [1.0, 0.0, 0.5],  # 1/6
    }
    lake = Lake(str(tmp_path / "lake"))
    dataset = landed_one_by_one(lake, returns)
    landed = ["1:" + g for g in returns]
    by_variance = ["1:spread", "1:triple", "1:narrow", "1:flat", "1:unscored"]
    variance = (  # the variance of each group's rewards, computed here from its steps
        dataset.steps()
        .group_by("prompt_uid")
        .agg(pl.col("reward").var(ddof=0))
        .sort("reward", descending=True, nulls_last=True)
    )
    assert ["1:" + g for g in variance["prompt_uid"]] == by_variance
    orders = {"oldest": landed, "newest": landed[::-1], "reward_variance": by_variance}
    for order, expected in orders.items():
        pulled = pull_all(dataset, order, order=order)
        assert [g for b in pulled for g in b.groups] == expected, order

    # reused: fresh groups before any reuse, and the order among equally used groups
    dataset = Dataset(lake, "live")
    first = [
        dataset.next_batch(consumer="reuse", timeout=0, max_uses=2, order="reward_variance")
        for _ in range(7)
    ]
    assert [(b.groups[0], b.uses[0]) for b in first] == [
        *((g, 1) for g in by_variance),
        *((g, 2) for g in by_variance[:2]),
    ]
    land(lake, group_of("newcomer", [7, 7], [0.55, 0.45]))  # a low variance, but fresh
    build_silver(lake)
    update_dataset(lake, LIVE)
    rest = pull_all(dataset, "reuse", max_uses=2, order="reward_variance")
    assert [(b.groups[0], b.uses[0]) for b in rest] == [
        ("1:newcomer", 1),  # never used: before every reuse
        *(  # then the second uses left, by variance: the newcomer's 0.0025 among them
            (g, 2) for g in ["1:narrow", "1:newcomer", "1:flat", "1:unscored"]
        ),
    ]


def test_the_first_units_of_an_order_are_its_head_whatever_the_ties_and_nulls():
    rng = np.random.default_rng(7)
    n = 3_000
    landed = rng.integers(0, 40, n).astype(float)  # many ties
    variance = rng.integers(0, 5, n) / 4
    units = pl.DataFrame(
        {
            "unit": [f"{i % 3}:g{i}" for i in range(n)],
            "used": rng.integers(0, 3, n),
            "landed_at": np.where(rng.random(n) < 0.1, np.nan, landed),
            "reward_variance": np.where(rng.random(n) < 0.2, np.nan, variance),
            "tokens": rng.integers(1, 200, n),
        }
    ).fill_nan(None)
    rows = units.to_dicts()

    def later(value, descending: bool):  # a key: nulls by their own flag, then the value
        return (value if value is not None else 0) * (-1 if descending else 1)

    keys = {  # each order as its docstring states it, in plain Python
        "oldest": lambda r: (r["landed_at"] is not None, later(r["landed_at"], False)),
        "newest": lambda r: (r["landed_at"] is None, later(r["landed_at"], True)),
        "reward_variance": lambda r: (
            r["reward_variance"] is None,
            later(r["reward_variance"], True),
            r["landed_at"] is not None,
            later(r["landed_at"], False),
        ),
    }
    for order, key in keys.items():
        expected = [r["unit"] for r in sorted(rows, key=lambda r: (r["used"], *key(r), r["unit"]))]
        assert in_order(units, order, n)["unit"].to_list() == expected, order
        for count in (1, 16, 700):
            assert in_order(units, order, count)["unit"].to_list() == expected[:count], order
        tokens = dict(zip(units["unit"], units["tokens"], strict=True))
        for budget in (1, 150, 2_000, 40_000):
            total, fits = 0, []
            for unit in expected:
                total += tokens[unit]
                if total > budget:
                    break
                fits.append(unit)
            chosen = choose(units, None, budget, order)
            assert chosen is not None
            assert chosen["unit"].to_list() == (fits or expected[:1]), (order, budget)
            assert choose(units, 3, budget, order)["unit"].to_list() == (fits or expected[:1])[:3]


def test_ranks_stay_disjoint_and_each_reuses_its_own_share(grown):
    dataset = Dataset(grown, "live")
    shares: dict[int, set[str]] = {}
    for rank in range(3):
        batches = pull_all(dataset, "ddp", rank=rank, world_size=3, max_uses=2)
        shares[rank] = {g for b in batches for g in b.groups}
        assert_reused(deliveries(batches), shares[rank], 2, 0)
        assert recorded(grown, "ddp", rank) == sorted(deliveries(batches))
        assert [b.groups for b in dataset.replay("ddp", rank=rank)] == [b.groups for b in batches]
    everything = [u for share in shares.values() for u in share]
    assert len(everything) == len(set(everything)) == 12  # disjoint, covering


def test_a_refused_group_is_never_offered_again_while_others_are_reused(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    land(lake, group_of("g", [1, 2, 3], [1.0, 0.0, 0.5], turns=2) + drifted())
    build_silver(lake)
    strict = LIVE.model_copy(update={"name": "strict", "blocking": ["turns_nest"]})
    save_spec(lake, strict)
    build_partition(lake, strict, 1)
    dataset = Dataset(lake, "strict")
    shipped, refused = [], 0
    for _ in range(6):
        try:
            batch = dataset.next_batch(consumer="reuse", timeout=0, max_uses=3)
        except ContractViolation:
            refused += 1
            continue
        if batch is None:
            break
        shipped.append((batch.batch_index, batch.groups, batch.uses))
    assert refused == 1  # group d, batch 0
    assert shipped == [(1, ["1:g"], [1]), (2, ["1:g"], [2]), (3, ["1:g"], [3])]
    restarted = Dataset(Lake(lake.uri), "strict")  # the ledger read back from the record
    batch = restarted.next_batch(consumer="reuse", timeout=0, max_uses=5)
    assert (batch.groups, batch.uses) == (["1:g"], [4])


def test_a_consumption_table_from_before_reuse_keeps_working(grown):
    schema = GOLD_CONSUMPTION_SPEC.schema
    before = dataclasses.replace(
        GOLD_CONSUMPTION_SPEC, schema=schema.remove(schema.get_field_index("uses"))
    )
    old = Lake(grown.uri)
    old.ensure(before)
    dataset = Dataset(grown, "live")
    steps = dataset.steps().filter(pl.col("prompt_uid") == "g00")["step_key"].to_list()
    row = {
        "consumer": "old",
        "dataset": "live",
        "dataset_version": dataset.version,
        "policy_version": 1,
        "batch_index": 0,
        "step_keys": steps,
        "consumed_at": datetime.now(UTC),
        "rank": 0,
        "world_size": 1,
        "groups": ["1:g00"],
        "kind": "next",
    }
    old.append(before, pa.Table.from_pylist([row]))
    assert "uses" not in old.read(GOLD_CONSUMPTION).columns
    assert [b.uses for b in Dataset(old, "live").replay("old")] == [[1]]  # before it was added

    later = Dataset(Lake(grown.uri), "live")
    batches = pull_all(later, "old", max_uses=2)
    delivered = [(0, "1:g00", 1), *deliveries(batches)]
    assert_reused(delivered, every_unit(later), 2, 0)
    assert [b.uses for b in later.replay("old")][:2] == [[1], [1]]
    uses = later.lake.read(GOLD_CONSUMPTION).filter(pl.col("consumer") == "old")["uses"]
    assert uses.null_count() == 1  # the old row: null, read as a first use


TRAINER = """
import sys, time
from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.lake.delta import Lake
dataset = Dataset(Lake(sys.argv[1]), "live")
while True:
    batch = dataset.next_batch(
        1, consumer="killed", timeout=30, poll_s=0.05, max_uses=2, cooldown=3
    )
    print(batch.batch_index, batch.groups[0], batch.uses[0], flush=True)
    time.sleep(0.05)  # training
"""


@pytest.mark.slow
def test_a_trainer_killed_mid_run_resumes_with_its_counts(grown):
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, grown.uri], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    trained = [proc.stdout.readline().split() for _ in range(16)]  # 12 fresh, 4 reuses
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    delivered = [(int(index), unit, int(use)) for index, unit, use in trained]
    assert [use for _, _, use in delivered] == [1] * 12 + [2] * 4
    dataset = Dataset(grown, "live")
    resumed = dataset.replay("killed", after_batch=delivered[-1][0])
    resumed = [*resumed, *pull_all(dataset, "killed", max_uses=2, cooldown=3)]
    delivered += deliveries(resumed)
    assert_reused(delivered, every_unit(dataset), 2, 3)  # none a third time, none missing
    assert recorded(grown, "killed") == sorted(delivered)


@pytest.mark.slow
def test_two_processes_of_one_rank_racing_deliver_no_group_more_than_max_uses(grown):
    racer = partial(race_next_batch_in_process, train_s=0.05, max_uses=2)
    answers = race_in_processes(racer, grown.uri)  # both chose from the same ledger first
    delivered = sorted(d for answer in answers for d in answer)
    assert all(answers)  # interleaved: each delivered some batches of the rank
    assert [index for index, _, _ in delivered] == list(range(24))  # each batch by one of them
    assert_reused(delivered, every_unit(Dataset(grown, "live")), 2, 0)
    assert recorded(grown, "racer") == delivered

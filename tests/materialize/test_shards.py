"""Silver built by shards (docs/DESIGN.md §19): each shard writes the steps of its buckets,
the facts it owns and the derived rows of its trajectories, under its own writer and
marker; together they equal one writer's build of the same bronze."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import polars as pl
import pytest

from claw_pipelines.contracts.errors import Fenced
from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    SHARD_LEASES,
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TABLES,
    SILVER_TRAJECTORIES,
    TABLES,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import Resharded, ShardLeases, ShardPlan
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize import live
from claw_pipelines.materialize.gold import build_partition, partition_writer, policy_versions
from claw_pipelines.materialize.increments import AtHand, update_dataset
from claw_pipelines.materialize.live import LiveMaterializer, heartbeat_of
from claw_pipelines.materialize.silver import SilverOptions, build_silver, silver_state
from claw_pipelines.transforms.shards import buckets_of, stored_step_shard_keys
from tests.support import lakes
from tests.support.lakes import feedback, land
from tests.support.rounds import OPTIONS, SPECS, latest_totals, same, script
from tests.support.servers import REPO, wait_until

SHARDS = [Slot(0, 2), Slot(1, 2)]


def one_writer(lake: Lake, path, options: SilverOptions = OPTIONS) -> Lake:
    """A lake with the same bronze, its silver built by one writer from nothing."""
    shutil.copytree(f"{lake.uri}/bronze", path / "bronze")
    one = Lake(str(path))
    build_silver(one, options)
    return one


def assert_built_as_one_writer(lake: Lake, one: Lake, specs=None) -> None:
    """`lake`'s silver, and each spec's dataset, rejections and trees, equal `one`'s (its
    silver built by one writer; its gold built here from nothing, partition by partition)."""
    mine, theirs = silver_of(lake), silver_of(one)
    for table in mine:
        same(mine[table], theirs[table], mine[table].columns[:1])
    for spec in specs or GOLD_SPECS[:2]:
        save_spec(one, spec)
        for version in policy_versions(one):
            build_partition(one, spec, version)
        for table in (gold_dataset_table(spec.name), gold_rejection_table(spec.name)):
            rows = [x.read(table).drop("landed_at") for x in (lake, one)]
            same(*rows, ["step_key"])
        trees = gold_tree_table(spec.name)
        same(lake.read(trees), one.read(trees), ["policy_version", "tree_id", "segment"])


@contextlib.contextmanager
def killed_before_the_marker(monkeypatch):
    """The silver run inside dies (SystemExit) after its appends, before its derived rows
    and marker, as a SIGKILL there would leave it."""
    from claw_pipelines.materialize import silver

    def killed(*args, **kwargs):
        raise SystemExit("killed before the marker")

    derive = silver._write_derived
    monkeypatch.setattr(silver, "_write_derived", killed)
    with pytest.raises(SystemExit):
        yield
    monkeypatch.setattr(silver, "_write_derived", derive)


def silver_of(lake: Lake) -> dict[str, pl.DataFrame]:
    """Every silver table's rows, in key order (the view's own bookkeeping aside)."""
    keys = {
        SILVER_STEPS: ["step_key"],
        SILVER_FEEDBACK: ["feedback_id"],
        SILVER_STEP_REWARDS: ["step_key"],
        SILVER_TRAJECTORIES: ["trajectory_uid"],
    }
    return {table: lake.read(table).sort(key) for table, key in keys.items()}


@pytest.fixture(params=[1, 2, 3])
def seeded_ids(request, monkeypatch):
    """Event ids drawn from a seeded generator: which shard owns which fact (its id's bucket)
    differs from seed to seed, the same in every run of one."""
    draw = random.Random(request.param)
    monkeypatch.setattr(lakes.uuid, "uuid4", lambda: uuid.UUID(int=draw.getrandbits(128)))
    return request.param


def test_two_shards_build_the_silver_one_writer_builds(tmp_path, seeded_ids):
    """Rounds land; the shards run in turns, one lagging a round behind now and then, one
    restarted with nothing kept: every step is written once, by its shard, and the shards'
    silver equals one writer's build from nothing, facts and late rewards included."""
    lake = Lake(str(tmp_path / "lake"))
    views = {slot: None for slot in SHARDS}
    rounds = 6
    for round_ in range(rounds):
        land(lake, script(round_))
        if round_ == rounds - 1:  # late facts for trajectories of the first round
            land(lake, [feedback({"trajectory_uid": "g0-r2"}, "reward", 0.25)])
            land(lake, [feedback({"step_key": "g0-r0:0"}, "label", "late")])
        order = SHARDS if round_ % 2 else SHARDS[::-1]
        for slot in order:
            if slot.index == 1 and round_ == 2:
                continue  # shard 1 falls a round behind, then catches up
            if slot.index == 0 and round_ == 3:
                views[slot] = None  # shard 0 restarts: its view read from the lake
            run = build_silver(lake, OPTIONS, view=views[slot], slot=slot)
            views[slot] = run.view
            assert run.view is not None and run.view.slot == slot
            mine = buckets_of(stored_step_shard_keys(run.new_steps)) % slot.count
            assert set(mine.tolist()) <= {slot.index}  # its own buckets' steps only
    for slot in SHARDS:  # both at bronze's newest version
        assert silver_state(lake, slot=slot).bronze_version == lake.version("bronze/events")

    one = one_writer(lake, tmp_path / "one")
    mine, theirs = silver_of(lake), silver_of(one)
    assert mine[SILVER_STEPS]["step_key"].is_unique().all()
    assert mine[SILVER_FEEDBACK]["feedback_id"].is_unique().all()
    for table in mine:
        same(mine[table], theirs[table], mine[table].columns[:1])
    # both shards wrote: the work was split
    writers = {table: [lake.transaction_version(table, s.silver_app_id) for s in SHARDS]}
    for table in (SILVER_STEPS, SILVER_TRAJECTORIES):
        writers[table] = [lake.transaction_version(table, s.silver_app_id) for s in SHARDS]
        assert all(v is not None for v in writers[table]), writers


def test_shards_read_only_their_own_records_tokens_and_build_what_one_writer_builds(
    tmp_path, monkeypatch
):
    """Bronze laid out by shard order in small row groups (a batch of many groups, as a
    gateway's flush): each of two shards decodes the tokens of its range's row groups only
    (its records, facts, the row group it shares at the boundary), takes the others' clocks
    from their small columns, and the two build the silver one writer builds."""
    bronze = TABLES[BRONZE_EVENTS]
    monkeypatch.setitem(TABLES, BRONZE_EVENTS, replace(bronze, shard_row_group_bytes=4_096))
    lake = Lake(str(tmp_path / "lake"))
    records = []
    for group in range(24):
        records += lakes.group_of(f"p{group}", [group, 5, 9], [1.0, 0.0, 0.5], turns=2)
    land(lake, records)
    land(lake, [*script(0), feedback({"trajectory_uid": "p3-r1"}, "reward", 0.25)])
    orders = lake.read(BRONZE_EVENTS, columns=["shard_order"])["shard_order"]
    total, facts = orders.len(), orders.null_count()  # every shard reads the facts
    decoded = {}
    for slot in SHARDS:
        run = build_silver(lake, OPTIONS, slot=slot)
        decoded[slot] = run.token_rows
        assert run.bronze_rows == total  # every record seen: its own whole, the others' clocks
    assert all(rows < 0.75 * total for rows in decoded.values()), (decoded, total)
    steps = total - facts
    assert sum(decoded.values()) - 2 * facts < 1.25 * steps, (decoded, total, facts)
    mine, theirs = silver_of(lake), silver_of(one_writer(lake, tmp_path / "one"))
    for table in mine:
        same(mine[table], theirs[table], mine[table].columns[:1])


def test_a_shard_killed_after_its_appends_derives_its_share_again(
    tmp_path, monkeypatch, seeded_ids
):
    """A shard's run that dies between its step appends and its marker leaves rows past its
    marker: its next run recognises them and derives its whole share again (not the other
    shard's), and silver still equals one writer's."""
    lake = Lake(str(tmp_path / "lake"))
    for round_ in range(2):
        land(lake, script(round_))
        for slot in SHARDS:
            build_silver(lake, OPTIONS, slot=slot)
    land(lake, script(2))

    with killed_before_the_marker(monkeypatch):
        build_silver(lake, OPTIONS, slot=SHARDS[0])
    for slot in SHARDS:
        build_silver(lake, OPTIONS, slot=slot)
    one = one_writer(lake, tmp_path / "one")
    mine, theirs = silver_of(lake), silver_of(one)
    for table in mine:
        same(mine[table], theirs[table], mine[table].columns[:1])


def test_a_shard_writer_fenced_by_a_newer_owner_commits_nothing(tmp_path):
    """A follower whose lease was taken over (a newer token fenced the shard's tables) has
    its next run refused with Fenced, and nothing of it lands."""
    lake = Lake(str(tmp_path / "lake"))
    land(lake, script(0))
    leases = ShardLeases(lake, "old-owner", ttl_s=30)
    old = leases.acquire(SHARDS[0])
    assert old is not None
    build_silver(lake, OPTIONS, slot=SHARDS[0], fences={SHARDS[0].writer_app_id: old.token})
    land(lake, script(1))
    newer = old.token + 1
    for table in SILVER_TABLES:
        lake.fence(table, SHARDS[0].writer_app_id, newer)
    before = {t: lake.version(t) for t in SILVER_TABLES}
    with pytest.raises(Fenced):
        build_silver(lake, OPTIONS, slot=SHARDS[0], fences={SHARDS[0].writer_app_id: old.token})
    assert {t: lake.version(t) for t in SILVER_TABLES} == before


GOLD_SPECS = SPECS[:4]  # live, fresh (staleness), late (deadline clock), all (by trajectory)


@pytest.mark.parametrize("seeded_ids", [1], indirect=True)  # (silver's tests take 3 seeds)
def test_two_shards_build_the_gold_one_writer_builds(tmp_path, seeded_ids):
    """Each shard curates the groups of its silver view in increments, writing its share of
    every partition under its own writers: the datasets, trees and rejections equal one
    writer's build of every partition from nothing, and the lineage the last writes record
    counts what that build counts."""
    lake = Lake(str(tmp_path / "lake"))
    for spec in GOLD_SPECS:
        save_spec(lake, spec)
    at_hand = {slot: AtHand() for slot in SHARDS}
    rounds = 5
    for round_ in range(rounds):
        land(lake, script(round_))
        if round_ == rounds - 1:
            land(lake, [feedback({"trajectory_uid": "g0-r2"}, "reward", 0.25)])
        for slot in SHARDS if round_ % 2 else SHARDS[::-1]:
            hand = at_hand[slot]
            hand.silver = build_silver(lake, OPTIONS, view=hand.silver, slot=slot).view
            for spec in GOLD_SPECS:
                done = update_dataset(lake, spec, hand, recover=round_ == 0, slot=slot)
                assert done.groups_curated is not None  # its share, never all of silver
    with pytest.raises(ValueError, match="needs its view"):
        update_dataset(lake, GOLD_SPECS[0], AtHand(), slot=SHARDS[0])

    one = one_writer(lake, tmp_path / "one")
    assert_built_as_one_writer(lake, one, GOLD_SPECS)
    for spec in GOLD_SPECS:
        same(latest_totals(lake, spec.name), latest_totals(one, spec.name), ["policy_version"])
        writers = {
            slot: lake.transaction_version(gold_dataset_table(spec.name), partition_writer(1, slot))
            for slot in SHARDS
        }
        assert all(v is not None for v in writers.values()), writers  # both wrote a share


def test_shard_followers_split_the_work_and_one_waiting_takes_over_a_killed_one(tmp_path):
    """`claw materialize --follow --shard i/2` processes: a second follower of shard 0
    waits for its lease; shard 0's first follower is killed (SIGKILL) mid-run and the
    waiting one takes the shard over once the lease lapses (token 2). The followers' silver
    and gold equal one writer's build of the same bronze."""
    lake = Lake(str(tmp_path / "lake"))
    for spec in GOLD_SPECS[:2]:
        save_spec(lake, spec)
    env = {**os.environ, "CLAW_LAKE_URI": lake.uri, "CLAW_SHARD_LEASE_TTL_S": "2"}
    env.pop("DAGSTER_HOME", None)
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--follow"]
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "c")}

    def start(name: str, shard: str) -> subprocess.Popen:
        out = logs[name].open("w")
        args = [*command, "--poll-s", "0.05", "--shard", shard]
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    first, other = start("a", "0/2"), start("b", "1/2")
    procs = [first, other]
    try:
        wait_until(lambda: lake.exists(SHARD_LEASES) and _holders(lake) == 2, 60, what="leases")
        procs.append(start("c", "0/2"))  # shard 0 is held: it waits
        wait_until(lambda: "waiting for its lease" in logs["c"].read_text(), 30, what="waiting")
        for round_ in range(4):
            land(lake, script(round_))
            if round_ == 1:
                time.sleep(0.5)
                first.send_signal(signal.SIGKILL)  # wherever it is
                first.wait(10)
            time.sleep(0.3)
        wait_until(lambda: "lease taken" in logs["c"].read_text(), 60, what="the takeover")
        wait_until(lambda: _caught_up(lake, GOLD_SPECS[:2]), 90, what="both shards caught up")
    finally:
        for proc in procs[1:]:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(30)
    for name, log in logs.items():  # no dataset failed in any follower
        assert "not building" not in log.read_text(), (name, log.read_text())
    assert "lease taken (token 2)" in logs["c"].read_text()
    leases = ShardLeases(lake, "reader").holders()
    zero = leases.filter(pl.col("shard_index") == 0).row(0, named=True)
    assert zero["token"] == 2 and zero["released_at"] is not None  # taken over, then let go

    assert_built_as_one_writer(lake, one_writer(lake, tmp_path / "one", SilverOptions()))


def _holders(lake: Lake) -> int:
    """How many shard leases are held now."""
    return ShardLeases(lake, "reader").holders().filter(~pl.col("expired")).height


def _caught_up(lake: Lake, specs) -> bool:
    """Whether every shard's silver is at bronze's newest version and its heartbeat says it
    brought every dataset up to its marker."""
    newest = lake.version("bronze/events")
    for slot in SHARDS:
        state = silver_state(lake, slot=slot)
        beat = json.loads(lake.read_text(heartbeat_of(slot)) or "{}")
        marker = state.versions.get(SILVER_TRAJECTORIES)
        brought = beat.get("brought", {})
        if state.bronze_version != newest:
            return False
        if any(brought.get(spec.name, {}).get("marker") != marker for spec in specs):
            return False
    return True


def test_resharding_two_three_two_under_traffic_hands_every_group_over(tmp_path, monkeypatch):
    """The lake goes from 2 shards to 3 and back to 2 while rounds land: the followers of
    the old split stop (their shard is retired), the new ones wait for the old leases to
    go, then start after the old split's earliest marker; a follower of the old split that
    wakes up late is fenced. Nothing is lost or built twice: silver and gold equal one
    writer's build."""
    monkeypatch.setattr(live, "PLAN_EVERY_S", 0.0)
    lake = Lake(str(tmp_path / "lake"))
    for spec in GOLD_SPECS[:2]:
        save_spec(lake, spec)

    def followers(count: int) -> list[LiveMaterializer]:
        ShardPlan.set(lake, count)
        return [LiveMaterializer(lake, OPTIONS, slot=Slot(i, count)) for i in range(count)]

    running = followers(2)
    late_lease = None
    for round_ in range(6):
        land(lake, script(round_))
        if round_ in (2, 4):  # 2 -> 3, then 3 -> 2
            nxt = followers(3 if round_ == 2 else 2)
            assert nxt[0].step().waiting  # the old split's leases are still held
            for old in running:
                with pytest.raises(Resharded):
                    old.step()
                if round_ == 2 and old.slot == Slot(0, 2):
                    late_lease = old.lease  # a follower that will wake up late
                old.close()  # lets its lease go
            running = nxt
        for follower in running:
            done = follower.step()
            assert not done.waiting and not follower.failing, follower.failing
            if round_ in (2, 4):  # a new split's first run: after the old one's earliest marker
                assert done.silver is not None and done.silver.read_mode == "changes"
    for follower in running:  # caught up
        while follower.step().changed:
            pass
        follower.close()
    leases = ShardLeases(lake, "reader").holders()
    assert sorted(leases.select("shard_count", "shard_index").rows()) == [
        (2, 0),
        (2, 1),
        (3, 0),
        (3, 1),
        (3, 2),
    ]
    assert late_lease is not None  # its writer was fenced by the 3-way split's followers
    land(lake, script(6))
    with pytest.raises(Fenced):
        build_silver(
            lake,
            OPTIONS,
            slot=late_lease.slot,
            fences={late_lease.slot.writer_app_id: late_lease.token},
        )

    one = one_writer(lake, tmp_path / "one")
    for follower in followers(2):  # the last round, taken in by the 2-way split again
        while follower.step().changed:
            pass
        follower.close()
    assert_built_as_one_writer(lake, one)


def test_claw_shards_and_check_show_each_shard_and_flag_a_lapsed_lease(tmp_path):
    """`claw shards --count 2` sets the split; after two followers ran, `claw shards` names
    each shard's owner, token, lease age and lag, and `claw check` is clean; once shard 1's
    lease lapses unreleased (its follower died) and bronze moves on, both flag it."""
    lake = Lake(str(tmp_path / "lake"))
    env = {**os.environ, "CLAW_LAKE_URI": lake.uri}
    claw = [sys.executable, "-m", "claw_pipelines.app.cli"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*claw, *args], cwd=REPO, env=env, capture_output=True, text=True)

    land(lake, script(0))
    assert "split 2 way(s) from now on" in run("shards", "--count", "2").stdout
    ttl = 15.0  # the two commands below run while the leases hold (8 s was too short under
    # `make test`: two Python starts on a loaded machine)
    followers = [LiveMaterializer(lake, OPTIONS, slot=slot, lease_ttl_s=ttl) for slot in SHARDS]
    for follower in followers:
        follower.step()
    taken = time.monotonic()
    shown = run("shards").stdout
    for slot in SHARDS:
        line = next(line for line in shown.splitlines() if line.startswith(f"shard {slot}:"))
        assert "held by" in line and "token 1" in line and "0 version(s) behind" in line
        assert "PROBLEM" not in line
    checked = run("check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    followers[0].close()  # released: shard 0 is free, cleanly
    time.sleep(max(0.0, taken + ttl + 0.1 - time.monotonic()))  # shard 1's follower "died":
    # its lease lapses unreleased
    land(lake, script(1))
    shown = run("shards").stdout
    assert "shard 1/2: lapsed" in shown and "lease of" in shown and "lapsed" in shown
    assert "shard 0/2: released" in shown and "no follower holds it" in shown
    checked = run("check")
    assert checked.returncode != 0
    assert "shard problem(s)" in checked.stderr and "shard 1/2: lease of" in checked.stdout


def test_the_shards_compact_the_tables_they_share_between_them(tmp_path, monkeypatch):
    """Every table the rounds append to is compacted by one shard's follower, none by two
    (one follower alone compacts them all)."""
    monkeypatch.setattr(live, "COMPACT_EVERY_S", 0.0)
    lake = Lake(str(tmp_path / "lake"))
    queued = {}
    for slot in [None, *SHARDS]:
        follower = LiveMaterializer(lake, OPTIONS, slot=slot)
        follower._queue_compaction(["live", "fresh"])
        queued[slot] = set(follower._compacting)
    ours, theirs = queued[SHARDS[0]], queued[SHARDS[1]]
    assert ours and theirs and not ours & theirs
    assert ours | theirs == queued[None]


def test_shard_followers_keep_a_bounded_history_of_their_share(tmp_path):
    """Shard followers with a window of 8 steps and a history each on disk: most of their
    share leaves memory every round and is read back when a late fact or a replay needs it;
    one restarts midway (its history caught up from silver's feed, other shards' rows left
    out); silver and gold equal one writer's build."""
    lake = Lake(str(tmp_path / "lake"))
    for spec in GOLD_SPECS[:2]:
        save_spec(lake, spec)
    state = tmp_path / "state"

    def follower(slot: Slot) -> LiveMaterializer:
        return LiveMaterializer(lake, OPTIONS, history=state, hot_steps=8, slot=slot)

    running = {slot: follower(slot) for slot in SHARDS}
    landed, evicted, curated = [], set(), {}
    for round_ in range(6):
        landed.append(script(round_))
        land(lake, landed[-1])
        if round_ == 5:  # a replay of the first round, and late facts for it
            land(lake, landed[0])
            land(lake, [feedback({"trajectory_uid": "g0-r2"}, "reward", 0.25)])
        if round_ == 3:  # shard 0 restarts: its history is opened and caught up
            running[SHARDS[0]].close()
            running[SHARDS[0]] = follower(SHARDS[0])
        for slot, live_ in running.items():
            done = live_.step()
            if round_ == 0:  # a first increment curates the shard's share, not all of silver
                curated[slot] = {g.dataset: g.groups_curated for g in done.gold}
            assert not live_.failing, live_.failing
            view = live_.at_hand.silver
            assert view is not None and view.history is not None and view.slot == slot
            if view.steps_total > view.steps.frame.height:  # some of its share left memory
                evicted.add(slot)
    read_back = 0
    for live_ in running.values():
        while live_.step().changed:
            pass
        assert live_.at_hand.silver.history.meta.get("rebuilds", 0) == 0
        read_back += live_.at_hand.silver.read_back
        live_.close()
    assert read_back > 0  # the replay and the late fact found their trajectories on disk
    assert evicted == set(SHARDS)
    groups = lake.read(SILVER_STEPS, version=None, columns=["prompt_uid", "trajectory_uid"])
    first = groups.filter(pl.col("trajectory_uid").is_in(_round_zero_trajectories()))
    total = first.select(pl.coalesce("prompt_uid", "trajectory_uid")).n_unique()
    for name in ("live", "fresh"):  # the shards' first increments split round 0's groups
        assert sum(curated[slot][name] for slot in SHARDS) == total, (curated, total)
    assert (state / "shard-0of2").is_dir() and (state / "shard-1of2").is_dir()
    assert_built_as_one_writer(lake, one_writer(lake, tmp_path / "one"))


def test_a_bounded_shard_follower_killed_before_its_marker_derives_its_share_again(
    tmp_path, monkeypatch
):
    """A shard's follower with a small window dies between its step appends and its marker;
    the next one (same history folder) finds the rows past its marker and derives every
    trajectory of its share, those on disk and not in its window included."""
    lake = Lake(str(tmp_path / "lake"))
    state = tmp_path / "state"

    def follower(slot: Slot) -> LiveMaterializer:
        return LiveMaterializer(lake, OPTIONS, history=state, hot_steps=2, slot=slot)

    running = {slot: follower(slot) for slot in SHARDS}
    for round_ in range(3):
        land(lake, script(round_))
        for live_ in running.values():
            live_.step()
    land(lake, script(3))

    with killed_before_the_marker(monkeypatch):
        running[SHARDS[0]].step()
    running[SHARDS[0]].close()
    running[SHARDS[0]] = follower(SHARDS[0])
    for live_ in running.values():
        while live_.step().changed:
            pass
        live_.close()
    mine, theirs = silver_of(lake), silver_of(one_writer(lake, tmp_path / "one"))
    for table in mine:
        same(mine[table], theirs[table], mine[table].columns[:1])


def _round_zero_trajectories() -> list[str]:
    """The trajectories of the script's first round."""
    return sorted({row["trajectory_uid"] for row in script(0) if row.get("trajectory_uid")})

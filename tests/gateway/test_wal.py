"""WAL frames, torn tails, group commit, and the bronze batch layout (no server)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time

import numpy as np
import pyarrow as pa
import pytest

from claw_pipelines.contracts.tables import BRONZE_EVENTS_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.settings import ClawSettings
from gateway.records import (
    TOKEN_FIELDS,
    BronzeRecord,
    PackedColumn,
    RecordColumns,
    bronze_table,
    typed_arrays,
)
from gateway.wal import scheduling
from gateway.wal.flusher import BronzeFlusher
from gateway.wal.frames import decode_columns, decode_frames, encode_frame, read_segment
from gateway.wal.layout import SEALED_SUFFIX, SPARE, sealed_segments
from gateway.wal.log import Write, WriteAheadLog
from gateway.wal.scheduling import WalUnavailable
from gateway.wal.syncer import ANSWER, COMMAND, MIN_SPARE_BYTES, OPEN, SEAL, SYNC, serve


def record(i: int, with_tokens: bool = True) -> BronzeRecord:
    arrays = typed_arrays([[1, 2, i], [i], [-0.5], None]) if with_tokens else [None] * 4
    payload = f'{{"trajectory_uid":"t{i}","step_index":{i}}}'.encode()
    return BronzeRecord(
        f"e{i}",
        "step" if with_tokens else "event",
        "ten",
        1_700_000_000_000_000,
        payload,
        "client" if with_tokens else None,
        *arrays,
    )


def one_by_one(records: list[BronzeRecord]) -> RecordColumns:
    """The columns of records held one by one: the oracle the flusher's columnar decoding
    of WAL frames is checked against."""
    return RecordColumns(
        [r.event_id for r in records],
        [r.kind for r in records],
        [r.tenant for r in records],
        np.array([r.received_us for r in records], np.int64),
        [r.token_source for r in records],
        pa.array([r.payload.decode() for r in records], pa.string()),
        tuple(PackedColumn.of([getattr(r, name) for r in records]) for name in TOKEN_FIELDS),
    )


def test_frames_round_trip_and_stop_at_a_torn_tail():
    records = [record(i, with_tokens=i % 2 == 0) for i in range(5)]
    data = b"".join(encode_frame(r) for r in records)
    decoded, valid = decode_frames(data + encode_frame(record(9))[:-3])
    assert valid == len(data)
    assert [r.event_id for r in decoded] == [r.event_id for r in records]
    assert decoded[0].array("prompt_ids").tolist() == [1, 2, 0] and decoded[1].prompt_ids is None
    assert decoded[2].array("rollout_log_probs").dtype == np.float32


def test_a_corrupt_frame_ends_the_readable_log():
    data = bytearray(b"".join(encode_frame(record(i)) for i in range(3)))
    first = len(encode_frame(record(0)))
    data[first + 20] ^= 0xFF
    decoded, valid = decode_frames(bytes(data))
    assert [r.event_id for r in decoded] == ["e0"] and valid == first


def test_frames_read_as_columns_land_the_rows_frames_read_one_by_one_do():
    first = [record(i, with_tokens=i % 2 == 0) for i in range(5)]
    second = [record(i) for i in range(5, 8)]
    torn = b"".join(encode_frame(r) for r in first) + encode_frame(record(9))[:-3]
    spare = b"".join(encode_frame(r) for r in second) + bytes(64)  # a spare's zeros
    columns, valid = decode_columns([torn, spare])
    assert valid == [len(torn) - len(encode_frame(record(9))) + 3, len(spare) - 64]
    expected = bronze_table(one_by_one(first + second), "gw", 3)
    assert bronze_table(columns, "gw", 3).equals(expected)
    assert expected.column("event_id").to_pylist() == [f"e{i}" for i in range(8)]


def test_bronze_batch_matches_the_contract_schema():
    frames = encode_frame(record(0)) + encode_frame(record(1, with_tokens=False))
    table = bronze_table(decode_columns([frames])[0], "gw", 7)
    assert table.schema == BRONZE_EVENTS_SPEC.schema
    rows = table.to_pylist()
    assert rows[0]["prompt_ids"] == [1, 2, 0] and rows[1]["prompt_ids"] is None
    assert rows[0]["step_index"] == 0 and rows[0]["batch_seq"] == 7
    assert str(rows[0]["ingest_date"]) == "2023-11-14"


def started_wal(directory, groups: list[tuple[int, str]]) -> WriteAheadLog:
    """A running WAL (on the current loop) that notes each commit group: (records, by)."""
    wal = WriteAheadLog(directory)
    wal.on_group = lambda records, seconds, by: groups.append((records, by))
    wal.lock()
    wal.start(next_seq=1)
    return wal


def test_one_fdatasync_acknowledges_every_write_before_it(tmp_path):
    groups: list[tuple[int, str]] = []

    async def scenario():
        wal = started_wal(tmp_path / "wal", groups)
        loop = asyncio.get_running_loop()
        futures = []
        for burst in range(4):
            for i in range(50):
                future = loop.create_future()
                futures.append(future)
                wal.submit(Write(encode_frame(record(burst * 50 + i)), 1, future))
            await asyncio.sleep(0)
        await asyncio.gather(*futures)
        sealed = wal.seal()
        await wal.close()  # waits for the syncer: the sealed segment is durable and renamed
        return sealed

    sealed = asyncio.run(scenario())
    assert sum(records for records, _ in groups) == 200 and len(groups) < 200  # shared fsyncs
    assert {by for _, by in groups} == {"syncer"}  # bursts go to the syncer, which pipelines
    (path,) = sealed_segments(tmp_path / "wal")
    assert sealed.seq == 1 and sealed.records == 200 and path.name == f"{1:020d}.wal"
    assert [r.event_id for r in read_segment(path)] == [f"e{i}" for i in range(200)]


async def lone_writes(wal: WriteAheadLog, first: int, count: int) -> None:
    """`count` writes, one at a time, each awaited before the next."""
    loop = asyncio.get_running_loop()
    for i in range(first, first + count):
        future = loop.create_future()
        wal.submit(Write(encode_frame(record(i)), 1, future))
        await future


def test_a_lone_write_on_an_idle_log_is_synced_by_the_loop_itself(tmp_path):
    groups: list[tuple[int, str]] = []

    async def scenario():
        wal = started_wal(tmp_path / "wal", groups)
        await lone_writes(wal, 0, 1)  # the syncer has answered by now: the name is durable
        await lone_writes(wal, 1, 3)
        wal.seal()
        await wal.close()

    asyncio.run(scenario())
    assert groups[1:4] == [(1, "loop")] * 3
    (path,) = sealed_segments(tmp_path / "wal")
    assert [r.event_id for r in read_segment(path)] == ["e0", "e1", "e2", "e3"]


def test_after_a_slow_inline_sync_the_syncer_takes_the_syncs(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(scheduling, "INLINE_SYNC_LIMIT_S", 0.0)  # any sync counts as slow
    caplog.set_level(logging.INFO, logger="gateway.wal.scheduling")

    groups: list[tuple[int, str]] = []

    async def scenario():
        wal = started_wal(tmp_path / "wal", groups)
        await lone_writes(wal, 0, 4)
        await wal.close()

    asyncio.run(scenario())
    assert [by for _, by in groups].count("loop") == 1
    assert "the syncer process takes every sync for 1 s" in caplog.text


def test_second_process_cannot_take_the_same_wal(tmp_path):
    first = WriteAheadLog(tmp_path / "wal")
    first.lock()
    with pytest.raises(RuntimeError, match="in use by another gateway"):
        WriteAheadLog(tmp_path / "wal").lock()


def test_leftover_open_segments_are_sealed_on_recovery(tmp_path):
    async def write_one():
        wal = WriteAheadLog(tmp_path / "wal")
        wal.lock()
        wal.start(next_seq=7)
        future = asyncio.get_running_loop().create_future()
        wal.submit(Write(encode_frame(record(0)), 1, future))
        await future
        # the process "dies" here: no seal, no close; the syncer sees its socket close
        sync = wal._sync
        sync._loop.remove_reader(sync._channel.fileno())
        sync._channel.close()
        os.close(wal._lock_fd)
        await asyncio.to_thread(sync._syncer.wait, 10)

    asyncio.run(write_one())
    wal = WriteAheadLog(tmp_path / "wal")
    wal.lock()
    (leftover,) = wal.seal_leftovers()
    assert leftover.name == f"{7:020d}.wal"
    assert [r.event_id for r in read_segment(leftover)] == ["e0"]


def test_closed_wal_refuses_writes_and_leaves_no_empty_segment(tmp_path):
    async def scenario():
        wal = WriteAheadLog(tmp_path / "wal")
        wal.lock()
        wal.start(next_seq=1)
        await wal.close()
        with pytest.raises(WalUnavailable):
            wal.submit(
                Write(encode_frame(record(0)), 1, asyncio.get_running_loop().create_future())
            )

    asyncio.run(scenario())
    assert not list((tmp_path / "wal").glob("*.wal")) and not list(
        (tmp_path / "wal").glob("*.open")
    )


def test_the_syncer_answers_a_batch_once_and_hands_sealed_segments_over(tmp_path):
    for seq in (1, 2):
        (tmp_path / f"{seq:020d}.open").write_bytes(b"x" * 100)
    gateway_end, syncer_end = socket.socketpair()
    syncer = threading.Thread(target=serve, args=(tmp_path, syncer_end))
    syncer.start()
    try:
        gateway_end.sendall(COMMAND.pack(OPEN, 2, 0))  # announced ahead: claims no position
        assert ANSWER.unpack(gateway_end.recv(ANSWER.size)) == (0, 0, 3)  # names up to 2 durable
        gateway_end.sendall(COMMAND.pack(OPEN, 3, 0))  # an empty segment, removed meanwhile
        assert ANSWER.unpack(gateway_end.recv(ANSWER.size)) == (0, 0, 3)
        gateway_end.sendall(COMMAND.pack(SEAL, 1, 100) + COMMAND.pack(SYNC, 2, 150))
        answers = gateway_end.recv(64)
        while len(answers) < ANSWER.size:
            answers += gateway_end.recv(64)
        # one answer for both when the syncer read them together, else one each
        assert ANSWER.unpack(answers[-ANSWER.size :]) == (0, 150, 3)
    finally:
        gateway_end.close()
        syncer.join(10)
    assert not syncer.is_alive()
    segments = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("spare"))
    assert segments == [f"{1:020d}.wal", f"{2:020d}.open"]


def test_the_syncer_reports_a_failed_sync(tmp_path):
    gateway_end, syncer_end = socket.socketpair()
    syncer = threading.Thread(target=serve, args=(tmp_path, syncer_end))
    syncer.start()
    try:
        gateway_end.sendall(COMMAND.pack(SYNC, 9, 10))  # no such segment
        assert ANSWER.unpack(gateway_end.recv(ANSWER.size)) == (1, 10, 0)
    finally:
        gateway_end.close()
        syncer.join(10)


def test_segments_start_from_a_zero_filled_spare_and_are_sealed_to_their_frames(tmp_path):
    directory = tmp_path / "wal"

    async def scenario():
        wal = WriteAheadLog(directory)
        wal.lock()
        wal.start(next_seq=1)  # no spare yet: segment 1 starts empty
        loop = asyncio.get_running_loop()

        async def write(i: int) -> None:
            future = loop.create_future()
            wal.submit(Write(encode_frame(record(i)), 1, future))
            await future

        await write(1)
        deadline = loop.time() + 10
        while not (directory / SPARE).exists() and loop.time() < deadline:
            await asyncio.sleep(0.01)  # the syncer fills one in the background
        wal.seal()  # segment 2 takes the spare
        assert wal.current.path.stat().st_size >= MIN_SPARE_BYTES
        await write(2)
        assert wal.current.path.stat().st_size >= MIN_SPARE_BYTES  # overwritten, not grown
        await wal.close()

    asyncio.run(scenario())
    sealed = sealed_segments(directory)
    assert [r.event_id for path in sealed for r in read_segment(path)] == ["e1", "e2"]
    assert [path.stat().st_size for path in sealed] == [len(encode_frame(record(1)))] * 2


def test_a_crash_leaves_zeros_after_the_frames_and_they_read_as_the_end(tmp_path, caplog):
    frames = encode_frame(record(0)) + encode_frame(record(1))
    clean, torn = tmp_path / "1.wal", tmp_path / "2.wal"
    clean.write_bytes(frames + bytes(4096))
    torn.write_bytes(frames + b"\x07" + bytes(4096))
    assert [r.event_id for r in read_segment(clean)] == ["e0", "e1"]
    assert "torn" not in caplog.text
    assert [r.event_id for r in read_segment(torn)] == ["e0", "e1"]
    assert "ignoring 4097 torn bytes" in caplog.text


def test_a_stopping_flusher_whose_commits_fail_waits_out_its_retries(tmp_path):
    """The gateway gone (its pipe at EOF) while bronze refuses the commit: the flusher keeps
    the records and retries with its backoff (a handful of tries a second, not a busy loop
    that floods the log), and drains once bronze takes them."""
    settings = ClawSettings(lake_uri=str(tmp_path / "lake"), wal_dir=tmp_path / "wal")
    Lake.from_settings(settings).ensure(BRONZE_EVENTS_SPEC)
    blocker = tmp_path / "lake" / "bronze" / "events" / "ingest_date=2023-11-14"
    blocker.write_text("a file where the record's partition folder goes: writes fail")
    settings.resolved_wal_dir.mkdir(parents=True, exist_ok=True)
    segment = settings.resolved_wal_dir / f"{1:020d}{SEALED_SUFFIX}"
    segment.write_bytes(encode_frame(record(1)))
    control, gateway_end = os.pipe()
    os.close(gateway_end)  # EOF: the gateway stopped
    flusher = BronzeFlusher(settings)
    thread = threading.Thread(target=flusher.run, args=(control,), daemon=True)
    thread.start()
    time.sleep(2.0)  # backoff 0.1, 0.2, 0.4, 0.8 s: about five tries
    assert thread.is_alive() and segment.exists()  # the records kept, still trying
    assert 2 <= flusher.status["failures"] <= 8, flusher.status
    blocker.unlink()
    thread.join(15)
    assert not thread.is_alive() and not segment.exists()
    landed = Lake.from_settings(settings).read("bronze/events", columns=["event_id"])
    assert landed["event_id"].to_list() == ["e1"]

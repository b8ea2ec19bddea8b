"""WAL frames, torn tails, group commit, and the bronze batch layout (no server)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from claw_pipelines.contracts.tables import BRONZE_EVENTS_SPEC
from gateway.records import (
    BronzeRecord,
    decode_frames,
    encode_frame,
    to_bronze_table,
    typed_arrays,
)
from gateway.wal import WalUnavailable, Write, WriteAheadLog


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


def test_bronze_batch_matches_the_contract_schema():
    table = to_bronze_table([record(0), record(1, with_tokens=False)], "gw", 7)
    assert table.schema == BRONZE_EVENTS_SPEC.schema
    rows = table.to_pylist()
    assert rows[0]["prompt_ids"] == [1, 2, 0] and rows[1]["prompt_ids"] is None
    assert rows[0]["step_index"] == 0 and rows[0]["batch_seq"] == 7
    assert str(rows[0]["ingest_date"]) == "2023-11-14"


def test_group_commit_covers_concurrent_appends_with_few_fsyncs(tmp_path):
    groups: list[int] = []
    all_done = threading.Event()

    def on_group_done(group, error, seconds):
        assert error is None
        groups.append(sum(len(w.records) for w in group))
        if sum(groups) == 200:
            all_done.set()

    wal = WriteAheadLog(tmp_path / "wal", on_group_done)
    wal.lock()
    wal.start(next_seq=1)
    for i in range(200):
        wal.submit(Write([record(i)], encode_frame(record(i))))
    assert all_done.wait(10)
    sealed = wal.seal()
    wal.close()
    assert len(groups) < 200  # writes queued together share one fsync
    assert sealed.seq == 1 and len(sealed.records) == 200
    on_disk, _ = decode_frames(sealed.path.read_bytes())
    assert [r.event_id for r in on_disk] == [f"e{i}" for i in range(200)]


def test_second_process_cannot_take_the_same_wal(tmp_path):
    first = WriteAheadLog(tmp_path / "wal", lambda *a: None)
    first.lock()
    with pytest.raises(RuntimeError, match="in use by another gateway"):
        WriteAheadLog(tmp_path / "wal", lambda *a: None).lock()


def test_closed_wal_refuses_writes_and_leaves_no_empty_segment(tmp_path):
    wal = WriteAheadLog(tmp_path / "wal", lambda *a: None)
    wal.lock()
    wal.start(next_seq=1)
    assert wal.close() is None
    with pytest.raises(WalUnavailable):
        wal.submit(Write([record(0)], encode_frame(record(0))))
    assert not list((tmp_path / "wal").glob("*.wal"))

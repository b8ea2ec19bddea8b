"""Trainer feedback (claw_pipelines.consume.feedback): a trainer records its log-probs on a
batch next_batch delivered, once, durably beside the behaviour log-probs; wrong arguments are
refused naming them; the mismatch report's figures equal a hand computation."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import polars as pl
import pytest

from claw_pipelines.consume.dataset import Dataset, open_dataset
from claw_pipelines.contracts.errors import NotFound
from claw_pipelines.contracts.tables import GOLD_TRAINER_FEEDBACK
from tests.support.racing import BarrierLake

SHIFT_V1 = math.log(1.5)  # policy version 1: the trainer is 1/1.5 as likely on a reply's 1st token
SHIFT_V2 = 0.05  # policy version 2: the trainer is exp(-0.05) as likely on every reply token
UNCAPTURED = -1.0  # the trainer's log-prob where no behaviour one was captured


def responses(batch) -> list[np.ndarray]:
    """Each step's response token indices in the batch."""
    return [
        index[p:]
        for index, p in zip(batch.step_token_index, batch.step_prompt_lens.tolist(), strict=True)
    ]


def trainer_log_probs(batch) -> np.ndarray:
    """A trainer's log-probs per packed token: the behaviour ones lowered by SHIFT_V1 on the first
    reply token of policy version 1's steps and by SHIFT_V2 on every reply token of version 2's;
    UNCAPTURED where none was captured; 0 on prompts (never read)."""
    values = np.zeros(batch.num_tokens)
    for at, version in zip(responses(batch), batch.step_policy_versions.tolist(), strict=True):
        shift = np.zeros(len(at))
        if version == 1:
            shift[0] = SHIFT_V1
        else:
            shift[:] = SHIFT_V2
        captured = batch.has_behaviour_log_probs[at]
        values[at] = np.where(captured, batch.behaviour_log_probs[at] - shift, UNCAPTURED)
    return values


def delivered(lake, consumer: str, groups: int = 4):
    batch = open_dataset("behaviour", lake.uri).next_batch(
        groups, consumer=consumer, layout="flat", timeout=0
    )
    assert batch is not None
    return batch


def test_feedback_is_recorded_per_step_beside_the_behaviour_log_probs(behaviour):
    ds = open_dataset("behaviour", behaviour.uri)
    batch = delivered(behaviour, "rt")
    values = trainer_log_probs(batch)
    assert ds.record_feedback(batch, values, loss=0.25, step=3) is True
    rows = behaviour.read(GOLD_TRAINER_FEEDBACK).filter(pl.col("consumer") == "rt")
    assert rows["step_key"].to_list() == batch.step_keys
    assert set(rows["batch_index"]) == {batch.batch_index} and set(rows["rank"]) == {0}
    assert set(rows["loss"]) == {0.25} and set(rows["train_step"]) == {3}
    assert set(rows["dataset_version"]) == {ds.version}
    gold = {r["step_key"]: r for r in ds.steps().to_dicts()}
    for row, at in zip(rows.iter_rows(named=True), responses(batch), strict=True):
        step = gold[row["step_key"]]
        assert row["policy_version"] == step["policy_version"]
        assert np.allclose(row["trainer_log_probs"], values[at].astype(np.float32))
        if step["rollout_log_probs"] is None:
            assert row["behaviour_log_probs"] == [None] * step["response_len"]
            assert row["tokens_compared"] == 0 and row["k1"] is None
        else:
            assert np.allclose(row["behaviour_log_probs"], step["rollout_log_probs"])
            assert row["tokens_compared"] == step["response_len"]
    # the batch's contract report now carries its mismatch
    assert batch.contract.feedback is not None
    assert batch.contract.feedback.tokens_compared == rows["tokens_compared"].sum()
    assert "trainer feedback:" in str(batch.contract)


def test_feedback_takes_a_torch_tensor_too(behaviour):
    torch = pytest.importorskip("torch")
    batch = delivered(behaviour, "torch-trainer", groups=1)
    tensor = torch.tensor(trainer_log_probs(batch), dtype=torch.bfloat16, requires_grad=True)
    loss = (tensor.float() * 2).sum()
    assert open_dataset("behaviour", behaviour.uri).record_feedback(batch, tensor, loss=loss)
    rows = behaviour.read(GOLD_TRAINER_FEEDBACK).filter(pl.col("consumer") == "torch-trainer")
    assert rows.height == len(batch.step_keys)
    assert rows["loss"][0] == pytest.approx(loss.item())


def test_a_retried_or_replayed_batch_is_recorded_once(behaviour):
    ds = open_dataset("behaviour", behaviour.uri)
    first, second = delivered(behaviour, "once", 2), delivered(behaviour, "once", 2)
    assert ds.record_feedback(first, trainer_log_probs(first), step=1)
    again = open_dataset("behaviour", behaviour.uri)  # another process, say, after a restart
    assert again.record_feedback(first, trainer_log_probs(first) - 1, step=1) is False
    on_record = behaviour.read(GOLD_TRAINER_FEEDBACK).filter(pl.col("consumer") == "once")
    assert on_record.height == len(first.step_keys)
    (replayed, unfed) = list(ds.replay("once"))
    assert replayed.step_keys == first.step_keys and replayed.consumer == "once"
    recorded, fed = replayed.contract.feedback, first.contract.feedback  # the first call's
    assert recorded is not None and fed is not None
    assert recorded.tokens_compared == fed.tokens_compared
    assert recorded.k1 == pytest.approx(fed.k1) and recorded.k3 == pytest.approx(fed.k3)
    assert unfed.contract.feedback is None
    assert ds.record_feedback(replayed, trainer_log_probs(replayed)) is False
    assert ds.record_feedback(second, trainer_log_probs(second)) is True
    counted = behaviour.read(GOLD_TRAINER_FEEDBACK).filter(pl.col("consumer") == "once")
    assert counted.height == len(first.step_keys) + len(second.step_keys)


def test_two_processes_recording_one_batch_at_once_record_it_once(behaviour):
    """Both compute from the same state and commit together (tests/support/racing.py): the
    guard lets one land; the other tries again, finds it on record and writes nothing."""
    batch = delivered(behaviour, "racing", 1)
    values = trainer_log_probs(batch)
    barrier = threading.Barrier(2)
    racers = [Dataset(BarrierLake(behaviour.uri, barrier), "behaviour") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(lambda ds: ds.record_feedback(batch, values), racers))
    assert sorted(outcomes) == [False, True]
    rows = behaviour.read(GOLD_TRAINER_FEEDBACK).filter(pl.col("consumer") == "racing")
    assert rows.height == len(batch.step_keys)


def test_wrong_feedback_is_refused_naming_the_argument(behaviour):
    ds = open_dataset("behaviour", behaviour.uri)
    batch = delivered(behaviour, "wrong", 1)
    good = trainer_log_probs(batch)
    trained = np.flatnonzero(batch.loss_mask)
    with pytest.raises(ValueError, match=r"log_probs must hold one value per token .* \(5,\)"):
        ds.record_feedback(batch, good[:5])
    with pytest.raises(ValueError, match="log_probs must hold one value per token"):
        ds.record_feedback(batch, good[None, :])
    nan = good.copy()
    nan[trained[2]] = np.nan
    with pytest.raises(ValueError, match=f"log_probs is not finite at 1 trained .* {trained[2]}"):
        ds.record_feedback(batch, nan)
    with pytest.raises(ValueError, match=r"log_probs must be log-probabilities \(<= 0\)"):
        ds.record_feedback(batch, -good)  # probabilities' negatives, say
    with pytest.raises(ValueError, match="loss must be finite"):
        ds.record_feedback(batch, good, loss=float("nan"))
    with pytest.raises(ValueError, match="step must be at least 0"):
        ds.record_feedback(batch, good, step=-1)
    with pytest.raises(ValueError, match="step must be an integer"):
        ds.record_feedback(batch, good, step=1.5)
    offline = next(ds.batches(1, 6))
    with pytest.raises(ValueError, match="batch was never delivered"):
        ds.record_feedback(offline, np.zeros(offline.num_tokens))
    batch.consumer = "someone-else"  # a batch this consumer was never given
    with pytest.raises(NotFound, match="consumer 'someone-else' rank 0 was never delivered"):
        ds.record_feedback(batch, good)
    assert (
        not behaviour.read(GOLD_TRAINER_FEEDBACK)
        .filter(pl.col("consumer").is_in(["wrong", "someone-else"]))
        .height
    )


def expected_figures(log_probs: list[list[float]], shift_first: float, shift_all: float):
    """By hand: mean |b - t|, k1, k3, the share of ratios outside [0.8, 1.2] and the tokens,
    when t = b - shift_first on each reply's first token and b - shift_all elsewhere."""
    diffs = []
    for reply in log_probs:
        diffs += [shift_first + shift_all] + [shift_all] * (len(reply) - 1)
    d = np.array(diffs)  # b - t per token
    ratio = np.exp(-d)
    return {
        "tokens_compared": len(d),
        "mean_abs_diff": np.abs(d).mean(),
        "k1": d.mean(),
        "k3": (ratio - 1 + d).mean(),
        "outside_band": ((ratio < 0.8) | (ratio > 1.2)).mean(),
    }


def test_the_mismatch_report_equals_a_hand_computation(behaviour):
    ds = open_dataset("behaviour", behaviour.uri)
    batch = delivered(behaviour, "report")
    assert ds.record_feedback(batch, trainer_log_probs(batch), loss=1.5, step=0)
    steps = ds.steps()
    captured = steps.filter(pl.col("rollout_log_probs").is_not_null())
    by_version = {
        v: captured.filter(pl.col("policy_version") == v)["rollout_log_probs"].to_list()
        for v in (1, 2)
    }
    # version 1: r = 1/1.5 (outside the band) on first tokens only; version 2: r = exp(-0.05)
    v1, v2 = (
        expected_figures(by_version[1], SHIFT_V1, 0),
        expected_figures(by_version[2], 0, SHIFT_V2),
    )
    assert v1["outside_band"] == pytest.approx(len(by_version[1]) / v1["tokens_compared"])
    assert v2["outside_band"] == 0 and v2["k1"] == pytest.approx(0.05)
    report = ds.feedback_report(consumer="report")
    table = {row["policy_version"]: row for row in report.by_policy_version.to_dicts()}
    for version, want in ((1, v1), (2, v2)):
        got = table[version]
        assert got["tokens_compared"] == want["tokens_compared"]
        for figure in ("mean_abs_diff", "k1", "k3", "outside_band"):
            assert got[figure] == pytest.approx(want[figure], rel=1e-5, abs=1e-7), figure
        assert got["steps"] == steps.filter(pl.col("policy_version") == version).height
    overall = v1["tokens_compared"] + v2["tokens_compared"]
    assert report.overall.tokens_compared == overall
    (one,) = report.by_batch.to_dicts()
    assert (one["batch_index"], one["loss"], one["train_step"]) == (batch.batch_index, 1.5, 0)
    assert one["k1"] == pytest.approx(
        (v1["k1"] * v1["tokens_compared"] + v2["k1"] * v2["tokens_compared"]) / overall
    )
    # the worst steps: version 1's two-token replies, |b - t| = ln 1.5 / 2 on average
    worst = report.worst_steps
    assert worst.height == 5 and set(worst["policy_version"]) == {1}
    assert worst["mean_abs_diff"].to_list() == pytest.approx([SHIFT_V1 / 2] * 5)
    # another band reads the lists again: version 2's ratios exp(-0.05) ≈ 0.951 fall outside
    narrow = ds.feedback_report(consumer="report", band=(0.96, 1.04))
    assert narrow.by_policy_version.filter(pl.col("policy_version") == 2)["outside_band"][0] == 1.0
    assert "policy version 1:" in str(report) and report.to_dict()["overall"]["tokens_compared"]
    with pytest.raises(ValueError, match="band must hold 1"):
        ds.feedback_report(band=(1.1, 1.3))


def test_a_dataset_without_feedback_reports_nothing_compared(behaviour):
    report = open_dataset("behaviour", behaviour.uri).feedback_report(consumer="nobody")
    assert report.overall.tokens_compared == 0 and report.by_batch.is_empty()
    assert "no token carries both log-probs" in str(report)

"""The bulk simulation's long-trajectory shape: every turn resends the whole history, and the
token counts (sent, distinct) are what the steps hold."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from claw_pipelines.simulation.bulk import AGENTIC, BulkShape, bulk_batches, token_counts


def test_agentic_turns_resend_the_whole_history() -> None:
    table = pa.concat_tables(bulk_batches(AGENTIC.rollouts * AGENTIC.turns, AGENTIC, 10, seed=3))
    steps = table.filter(pc.equal(table["kind"], "step")).to_pylist()
    assert len(steps) == 240  # one group: 8 rollouts x 30 turns
    by_trajectory: dict[str, list[dict]] = {}
    for step in steps:
        by_trajectory.setdefault(step["trajectory_uid"], []).append(step)
    assert len(by_trajectory) == 8
    first_prompts = set()
    for turns in by_trajectory.values():
        turns.sort(key=lambda s: s["step_index"])
        assert [s["step_index"] for s in turns] == list(range(30))
        assert 2_000 <= len(turns[0]["prompt_ids"]) < 4_000
        first_prompts.add(tuple(turns[0]["prompt_ids"]))
        for before, after in itertools.pairwise(turns):
            history = before["prompt_ids"] + before["response_ids"]
            assert after["prompt_ids"][: len(history)] == history  # the whole history again
            assert 200 <= len(after["prompt_ids"]) - len(history) < 1_500  # a tool result
            assert 100 <= len(after["response_ids"]) < 400
    assert len(first_prompts) == 1  # a group's rollouts share its prompt

    sent, distinct = token_counts(table)
    assert sent == sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in steps)
    prompt = len(next(iter(first_prompts)))
    added = sum(
        len(t[-1]["prompt_ids"]) + len(t[-1]["response_ids"]) - prompt
        for t in by_trajectory.values()
    )
    assert distinct == prompt + added
    assert 14_000 < sent / len(steps) < 25_000  # ~19,000 tokens a step


def test_the_default_shape_stays_short() -> None:
    (table,) = bulk_batches(24, BulkShape(), 1_000, seed=7)
    steps = table.filter(pc.equal(table["kind"], "step"))
    assert steps.num_rows == 24
    lengths = pc.list_value_length(steps["prompt_ids"]).to_numpy()
    assert (lengths >= 40).all() and (lengths < 120 + 2 * (64 + 24)).all()
    assert np.asarray(steps["step_index"]).max() == 2

"""Packing steps for training (claw_pipelines.transforms.packing): the behaviour log-probs are
scattered onto each step's response tokens, averaged where a tree shares a token between
several steps' responses, and absent where a step captured none; a token several responses hold
takes the oldest of their policy versions."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from claw_pipelines.transforms import packing
from claw_pipelines.transforms.packing import pack

NAN = math.nan


def frame() -> pl.DataFrame:
    """Four steps: s0 and s1 share their prompt and first reply token (tree 0), s2 extends s0
    (its prompt holds s0's reply) and captured no log-prob, s3 (tree 1) has one log-prob for
    two reply tokens (so none counts), and s1's second log-prob is NaN."""
    steps = [
        ("s0", [1, 2], [3, 4], [-0.1, -0.2], 0),
        ("s1", [1, 2], [3, 5], [-0.3, NAN], 0),
        ("s2", [1, 2, 3, 4, 9], [6], None, 0),
        ("s3", [8], [7, 7], [-1.0], 1),
    ]
    return pl.DataFrame(
        {
            "step_key": [s[0] for s in steps],
            "prompt_ids": [s[1] for s in steps],
            "response_ids": [s[2] for s in steps],
            "rollout_log_probs": [s[3] for s in steps],
            "prompt_len": [len(s[1]) for s in steps],
            "response_len": [len(s[2]) for s in steps],
            "response_mask": [None] * len(steps),
            "reward": [1.0, 0.0, 0.5, 1.0],
            "advantage": [0.5, -0.5, 0.0, 0.0],
            "tree": [s[4] for s in steps],
        },
        schema_overrides={
            "prompt_ids": pl.List(pl.Int32),
            "response_ids": pl.List(pl.Int32),
            "rollout_log_probs": pl.List(pl.Float32),
            "response_mask": pl.List(pl.Int8),
        },
    )


def response_of(packed, key: str) -> np.ndarray:
    k = packed.step_keys.index(key)
    return packed.token_of[k][packed.step_prompt_lens[k] :]


@pytest.mark.parametrize("layout", ["tree", "flat"])
def test_behaviour_log_probs_are_each_steps_at_its_response_tokens(layout):
    steps = frame()
    packed = pack(steps, steps["tree"].to_numpy(), layout)
    values, has = packed.behaviour_log_probs, packed.has_behaviour_log_probs
    assert values.dtype == np.float32 and has.dtype == bool
    assert len(values) == len(has) == len(packed.input_ids)
    s0, s1, s2, s3 = (response_of(packed, k) for k in ("s0", "s1", "s2", "s3"))
    if layout == "tree":  # token 3 after [1, 2] is one position, in both s0's and s1's reply
        assert s0[0] == s1[0]
        assert values[s0[0]] == pytest.approx((-0.1 - 0.3) / 2)
    else:
        assert values[s0[0]] == pytest.approx(-0.1) and values[s1[0]] == pytest.approx(-0.3)
    assert values[s0[1]] == pytest.approx(-0.2)
    assert not has[s1[1]] and values[s1[1]] == 0  # NaN: not captured
    assert not has[s2].any() and not has[s3].any()  # none, and one for two tokens
    captured = {*s0.tolist(), *s1[:1].tolist()}
    assert set(np.flatnonzero(has).tolist()) == captured
    assert (values[~has] == 0).all()


def test_without_the_column_nothing_is_captured():
    steps = frame().drop("rollout_log_probs")
    packed = pack(steps, steps["tree"].to_numpy(), "tree")
    assert not packed.has_behaviour_log_probs.any() and not packed.behaviour_log_probs.any()


def test_a_token_several_responses_hold_takes_the_oldest_version():
    rng = np.random.default_rng(0)
    total = 50
    response = rng.integers(0, 40, 300)  # tokens 40.. held by no response
    versions = rng.integers(1, 9, 300)
    holders = np.bincount(response, minlength=total)
    got = packing._token_versions(response, versions, holders, total)
    expected = np.full(total, -1)
    for token, version in zip(response.tolist(), versions.tolist(), strict=True):
        expected[token] = version if expected[token] < 0 else min(expected[token], version)
    np.testing.assert_array_equal(got, expected)
    assert (holders[:40] > 1).any() and (got[40:] == -1).all()


def test_token_versions_of_one_version_match_the_general_rule():
    response = np.array([0, 1, 1, 3, 5, 5, 5])
    holders = np.bincount(response, minlength=8)
    one = packing._token_versions(response, np.full(7, 4), holders, 8)
    np.testing.assert_array_equal(one, [4, 4, -1, 4, -1, 4, -1, -1])
    mixed = packing._token_versions(response, np.array([4, 4, 2, 4, 4, 3, 4]), holders, 8)
    np.testing.assert_array_equal(mixed, [4, 2, -1, 4, -1, 3, -1, -1])

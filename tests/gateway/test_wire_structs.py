"""The msgspec structs of `POST /v1/steps` accept a subset of what the pydantic model accepts,
to the same values: every body they pass is one the model passes, with equal records; every
other body goes to the model, whose error names the field (so both paths answer alike)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from claw_pipelines.contracts.limits import INT32_MAX, LABEL_PATTERN, UID_PATTERN
from claw_pipelines.contracts.wire import StepBatch
from claw_pipelines.contracts.wire_structs import checked_steps
from gateway.records import step_records

uids = st.one_of(
    st.from_regex(UID_PATTERN, fullmatch=True).filter(lambda s: len(s) <= 256),
    st.text(max_size=12),
    st.sampled_from(["traj-1\n", "", "a" * 257, "ok:1", "x y"]),
)
labels = st.one_of(st.from_regex(LABEL_PATTERN, fullmatch=True), st.text(max_size=8))
ints = st.one_of(
    st.integers(0, INT32_MAX),
    st.integers(-5, INT32_MAX + 5),
    st.sampled_from([True, 1.0, 2**70, -1, "3"]),
)
token_lists = st.lists(ints, max_size=6)
floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-3, 3),
    st.sampled_from(["1", None, 1e300, -3.5e38, -3.4028234663852886e38]),
)
json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=5)
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def steps(draw) -> dict:
    step = {
        "trajectory_uid": draw(uids),
        "step_index": draw(ints),
        "prompt_ids": draw(token_lists),
        "response_ids": draw(token_lists),
    }
    optional = {
        "prompt_uid": uids,
        "rollout_log_probs": st.lists(floats, max_size=6),
        "response_mask": st.lists(st.sampled_from([0, 1, 2, True, 0.0]), max_size=6),
        "reward": floats,
        "policy_version": ints,
        "is_last": st.sampled_from([True, False, 1, "true", None]),
        "finish_reason": labels,
        "model": st.text(max_size=10),
        "metadata": st.one_of(
            st.dictionaries(st.text(max_size=5), json_values, max_size=3), json_values
        ),
        "event_id": uids,
        "unknown": st.integers(),
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), unique=True, max_size=6)):
        step[name] = draw(optional[name])
    if draw(st.booleans()):  # a clean step: what a well-behaved client sends
        n = len(step["response_ids"] if isinstance(step["response_ids"], list) else [])
        step.update(
            trajectory_uid="traj-7",
            step_index=3,
            prompt_ids=[1, 2, 3],
            response_ids=[4] * n,
            rollout_log_probs=[-0.5] * n,
        )
        step.pop("unknown", None)
    return step


bodies = st.one_of(
    st.lists(steps(), min_size=0, max_size=3).map(lambda s: json.dumps({"steps": s}).encode()),
    st.sampled_from(
        [b"", b"{}", b'{"steps": []}', b'{"steps": [{}]}', b"[]", b'{"steps": [1]}', b"\xff"]
    ),
)


def records_of(steps_) -> list[tuple]:
    return [
        (json.loads(r.payload), r.arrays(), r.kind, r.tenant)
        for r in step_records(steps_, "tenant-a", "key-1", policy_version=4)
    ]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies)
def test_the_structs_accept_only_what_the_model_accepts_to_the_same_records(body):
    fast = checked_steps(body)
    try:
        model = StepBatch.model_validate_json(body)
    except ValidationError:
        assert fast is None, body
        return
    if fast is not None:
        assert records_of(fast) == records_of(model.steps)


def test_a_clean_body_takes_the_fast_path():
    body = {
        "steps": [
            {
                "trajectory_uid": "traj-1",
                "prompt_uid": "group-1",
                "step_index": 0,
                "prompt_ids": [1, 2, 3],
                "response_ids": [4, 5],
                "rollout_log_probs": [-0.25, -1.5e-7],
                "response_mask": [1, 0],
                "reward": 1,
                "finish_reason": "stop",
                "metadata": {"tool": "bash", "turn": [1, {"a": None}]},
            }
        ]
    }
    raw = json.dumps(body).encode()
    fast = checked_steps(raw)
    assert fast is not None
    assert records_of(fast) == records_of(StepBatch.model_validate_json(raw).steps)

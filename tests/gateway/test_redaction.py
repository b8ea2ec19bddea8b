"""Secrets in what agents send never reach the lake's stored payloads (unless switched off)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.redaction import redact, redact_payload
from tests.support.servers import GatewayProcess, wait_landed

SECRETS = {
    "openai_key": "sk-proj-Abcdefghijklmnopqrstuvwxyz0123456789",
    "anthropic_key": "sk-ant-api03-abcdefghijklmnopqrstuvwxyz",
    "aws_access_key": "AKIAIOSFODNN7EXAMPLE",
    "github_token": "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
    "slack_token": "xoxb-1234567890-abcdefghij",
    "google_api_key": "AIzaSyA-abcdefghijklmnopqrstuvwxyz01234",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N",
    "bearer_token": "Bearer abcdefghijklmnopqrstuvwxyz.0123",
    "private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg\n-----END PRIVATE KEY-----",
}


@pytest.mark.parametrize(("kind", "secret"), SECRETS.items())
def test_each_credential_shape_is_redacted_and_json_stays_valid(kind, secret):
    stored = redact(json.dumps({"content": f"here: {secret} (keep this)"}))
    assert secret not in stored and f"[REDACTED:{kind}]" in stored
    assert json.loads(stored)["content"].endswith("(keep this)")


def test_fields_named_as_secrets_are_redacted_and_others_kept():
    stored = json.loads(
        redact(
            json.dumps(
                {
                    "api_key": "abcd1234",
                    "db_password": "hunter22",
                    "x-api-key": "zzzzzzzz",
                    "token_source": "upstream",
                    "max_tokens": 16,
                    "tokenizer": "qwen",
                    "step_key": "traj:0",
                }
            )
        )
    )
    assert stored["api_key"] == stored["db_password"] == stored["x-api-key"]
    assert stored["api_key"] == "[REDACTED:secret_field]"
    assert stored["token_source"] == "upstream" and stored["tokenizer"] == "qwen"
    assert stored["max_tokens"] == 16 and stored["step_key"] == "traj:0"


def test_clean_payloads_are_not_even_copied():
    clean = b'{"trajectory_uid":"t","step_index":0,"metadata":{}}'
    assert redact_payload(clean) is clean


# Text built from pieces of every shape (in both cases), so that near-misses are common.
_PIECES = st.sampled_from(
    [
        *SECRETS.values(),
        *("AKIA", "akia", "sK-", "Bearer ", "eyJ", "gh", "p_", "_key", '"', ":", " "),
        *('"api_key": "', '"Token": "', '"password":"', "abcd1234", "x" * 20, "0123456789" * 4),
    ]
)


@given(st.lists(_PIECES, max_size=12).map("".join))
def test_the_literal_screen_never_skips_a_payload_with_a_secret(text):
    payload = json.dumps({"content": text}).encode()
    assert redact_payload(payload) == redact(payload.decode()).encode()


def _land(gateway, secret: str) -> dict:
    step = {
        "trajectory_uid": "redact-1",
        "step_index": 0,
        "prompt_ids": [1, 2],
        "response_ids": [3],
        "metadata": {"note": f"user pasted {secret}", "api_key": "abcd1234"},
    }
    answer = httpx.post(gateway.url + "/v1/steps", json={"steps": [step]}, timeout=10).json()
    feedback = {
        "target": {"step_key": "redact-1:0"},
        "kind": "comment",
        "value": f"the agent leaked {secret}",
        "source": "human",
    }
    more = httpx.post(gateway.url + "/v1/feedback", json=feedback, timeout=10).json()
    rows = wait_landed(gateway.lake, answer["event_ids"] + more["event_ids"])
    return {row["kind"]: row for row in rows.to_dicts()}


def test_the_gateway_stores_redacted_payloads_and_exact_tokens(gateway):
    rows = _land(gateway, SECRETS["openai_key"])
    for row in rows.values():
        assert SECRETS["openai_key"] not in row["payload"]
        assert "[REDACTED:openai_key]" in row["payload"]
    payload = json.loads(rows["step"]["payload"])
    assert payload["metadata"]["api_key"] == "[REDACTED:secret_field]"
    assert rows["step"]["prompt_ids"] == [1, 2]  # token ids are training data: exact


def test_redaction_can_be_switched_off(tmp_path):
    with GatewayProcess(tmp_path / "lake", CLAW_REDACT_SECRETS="false") as gateway:
        rows = _land(gateway, SECRETS["aws_access_key"])
    assert all(SECRETS["aws_access_key"] in row["payload"] for row in rows.values())

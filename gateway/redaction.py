"""Secrets never reach the lake: credential shapes in stored payloads become `[REDACTED:kind]`.

Applied to every record's JSON payload before it is written (the audit copy of proxied
requests and responses, metadata, feedback, events). Token ids live in typed columns and are
never touched. Request headers are not stored at all. Switch off with
`CLAW_REDACT_SECRETS=false` (e.g. for a lake that must keep prompts byte for byte).
"""

from __future__ import annotations

import re

_SHAPES = [
    ("private_key", r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----"),
    ("anthropic_key", r"sk-ant-[A-Za-z0-9_\-]{16,}"),
    ("openai_key", r"sk-(?:proj-)?[A-Za-z0-9_\-]{20,}"),
    ("aws_access_key", r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    ("github_token", r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    ("slack_token", r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),
    ("google_api_key", r"\bAIza[0-9A-Za-z_\-]{35}"),
    ("jwt", r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    ("bearer_token", r"\b(?i:bearer)\s+[A-Za-z0-9._~+/=\-]{16,}"),
]
_ANY_SHAPE = re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in _SHAPES), re.DOTALL)
# "api_key": "...", "db_password": "...": the string value of a field named as a secret
_SECRET_FIELD = re.compile(
    r'("(?:[A-Za-z0-9]+[_\-])*(?:api[_\-]?key|apikey|secret|password|passwd|'
    r'(?:access|refresh|auth|id|bearer)?[_\-]?token|authorization|credentials?)"\s*:\s*")'
    r'((?:[^"\\]|\\.){4,}?)(")',
    re.IGNORECASE,
)
_QUICK = re.compile(
    rb"sk-|AKIA|ASIA|gh[pousr]_|xox|AIza|eyJ|(?i:bearer|key|secret|passw|token|authoriz|credential)"
)


def redact(text: str) -> str:
    """`text` with every secret replaced by `[REDACTED:<kind>]` (JSON stays valid)."""
    text = _ANY_SHAPE.sub(lambda m: f"[REDACTED:{m.lastgroup}]", text)
    return _SECRET_FIELD.sub(lambda m: f"{m[1]}[REDACTED:secret_field]{m[3]}", text)


def redact_payload(payload: bytes) -> bytes:
    """A record's JSON payload, redacted (untouched, and uncopied, when nothing looks secret)."""
    if not _QUICK.search(payload):
        return payload
    text = payload.decode("utf-8", "surrogatepass")
    cleaned = redact(text)
    return payload if cleaned == text else cleaned.encode("utf-8", "surrogatepass")

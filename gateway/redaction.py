"""Secrets never reach the lake: credential shapes in stored payloads become `[REDACTED:kind]`.

Applied to every record's JSON payload before it is written (the audit copy of proxied
requests and responses, metadata, feedback, events). Token ids live in typed columns and are
never touched. Request headers are not stored at all. Switch off with
`CLAW_REDACT_SECRETS=false` (e.g. for a lake that must keep prompts byte for byte).
"""

from __future__ import annotations

import re

from ahocorasick_rs import BytesAhoCorasick

# (kind, the literal every match contains, pattern): a pattern runs only if its literal occurs
_SHAPES = [
    (
        "private_key",
        "PRIVATE KEY",
        r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----",
    ),
    ("anthropic_key", "sk-ant-", r"sk-ant-[A-Za-z0-9_\-]{16,}"),
    ("openai_key", "sk-", r"sk-(?:proj-)?[A-Za-z0-9_\-]{20,}"),
    ("aws_access_key", "AKIA", r"\bAKIA[0-9A-Z]{16}\b"),
    ("aws_access_key", "ASIA", r"\bASIA[0-9A-Z]{16}\b"),
    ("github_token", "_", r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    ("slack_token", "xox", r"\bxox[abprs]-[A-Za-z0-9\-]{10,}"),
    ("google_api_key", "AIza", r"\bAIza[0-9A-Za-z_\-]{35}"),
    ("jwt", "eyJ", r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}"),
    ("bearer_token", "", r"\b[Bb][Ee][Aa][Rr][Ee][Rr]\s+[A-Za-z0-9._~+/=\-]{16,}"),
]
_COMPILED = [(kind, literal, re.compile(pattern, re.DOTALL)) for kind, literal, pattern in _SHAPES]
# "api_key": "...", "db_password": "...": the string value of a field named as a secret
_SECRET_FIELD = re.compile(
    r'("(?:[A-Za-z0-9]+[_\-])*(?:api[_\-]?key|apikey|secret|password|passwd|'
    r'(?:access|refresh|auth|id|bearer)?[_\-]?token|authorization|credentials?)"\s*:\s*")'
    r'((?:[^"\\]|\\.){4,}?)(")',
    re.IGNORECASE,
)
# A cheap literal screen runs first: a payload none of these hits holds no secret shape and no
# secret-named string field, and is stored untouched. One Aho-Corasick pass over the lowered
# payload finds any of them (lowered, so cased markers may hit spuriously: `redact` then
# checks each shape exactly); 21 separate substring searches cost five times as much.
_CASED_MARKERS = (b"AKIA", b"ASIA", b"AIza", b"eyJ", b"PRIVATE KEY", b"sk-", b"xox")
_GITHUB_MARKERS = (b"ghp_", b"gho_", b"ghu_", b"ghs_", b"ghr_")
_LOWER_MARKERS = (
    b"bearer",
    b'key"',
    b'secret"',
    b'password"',
    b'passwd"',
    b'token"',
    b'authorization"',
    b'credential"',
    b'credentials"',
)


_SCREEN = BytesAhoCorasick(
    [m.lower() for m in (*_CASED_MARKERS, *_GITHUB_MARKERS, *_LOWER_MARKERS)]
)


def _may_hold_secrets(payload: bytes) -> bool:
    return bool(_SCREEN.find_matches_as_indexes(payload.lower()))


def redact(text: str) -> str:
    """`text` with every secret replaced by `[REDACTED:<kind>]` (JSON stays valid)."""
    lowered = text.lower()
    for kind, literal, pattern in _COMPILED:
        if (literal in text) if literal else ("bearer" in lowered):
            text = pattern.sub(f"[REDACTED:{kind}]", text)
    if any(marker.decode() in lowered for marker in _LOWER_MARKERS[1:]):
        text = _SECRET_FIELD.sub(lambda m: f"{m[1]}[REDACTED:secret_field]{m[3]}", text)
    return text


def redact_payload(payload: bytes) -> bytes:
    """A record's JSON payload, redacted (untouched, and uncopied, when nothing looks secret)."""
    if not _may_hold_secrets(payload):
        return payload
    text = payload.decode("utf-8", "surrogatepass")
    cleaned = redact(text)
    return payload if cleaned == text else cleaned.encode("utf-8", "surrogatepass")

"""How the gateway captures token ids from its upstream, decided once at start.

`probe_upstream` asks the upstream what it returns: its model list (the bundled simulated
model says `owned_by: claw-simulated`), then one chat completion of a single token with
`return_token_ids` and `logprobs`. `CaptureMode` combines that with `CLAW_TOKENIZER`:
- the upstream returns ids: they are recorded as sampled (`upstream`); a configured
  tokenizer still serves token-in and any answer that comes back without ids;
- it returns none: ids are computed here with the model's tokenizer (`CLAW_TOKENIZER`) and
  checked against the server's counts; with no tokenizer the gateway refuses to start,
  since the bundled tokenizer serves only the simulated model;
- it could not be asked (down at start): ids are recorded when answers carry them; an
  answer without them, with no tokenizer, lands as an `uncaptured_call` event, never as a
  step with made-up ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import httpx

from claw_pipelines.tokenization import BUNDLED, ChatTokenizer, load_chat_tokenizer
from gateway.proxy.capture import logprob_ids, response_ids_of

SIMULATED_OWNER = "claw-simulated"  # `owned_by` of the bundled simulated model
PROBE_MODEL = "claw-probe"  # the model asked for when the upstream lists none
# a server may load its weights on a first call: wait for the answer, not for a dead host
PROBE_TIMEOUT = httpx.Timeout(10.0, connect=3.0)


@dataclass(frozen=True, slots=True)
class UpstreamProbe:
    """What the upstream said at start: None where it could not be asked."""

    token_ids: bool | None  # whether a chat answer carries the sampled ids
    log_probs: bool | None  # whether it carries their log-probs
    simulated: bool = False  # the bundled simulated model (`claw sim-llm`)
    model: str | None = None  # the first model it lists
    detail: str = ""  # why something is unknown


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def probe_upstream(base_url: str, timeout: httpx.Timeout = PROBE_TIMEOUT) -> UpstreamProbe:
    """Ask the upstream (an OpenAI base URL) whether it returns token ids and log-probs."""
    base = base_url.rstrip("/")
    cards: list[dict[str, Any]] = []
    try:  # a fresh connection for each: a server may break the one a failure was sent on
        listed = httpx.get(base + "/models", timeout=timeout)
        data = (_json(listed) or {}).get("data") if listed.is_success else None
        cards = [c for c in data or () if isinstance(c, dict)]
    except (httpx.HTTPError, AttributeError):
        pass  # no model list (`transformers serve` answers 500): the test call still tells
    simulated = any(c.get("owned_by") == SIMULATED_OWNER for c in cards)
    model = next((c["id"] for c in cards if isinstance(c.get("id"), str)), None)
    try:
        answer = httpx.post(
            base + "/chat/completions",
            json={
                "model": model or PROBE_MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 1,
                "return_token_ids": True,
                "logprobs": True,
            },
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        return UpstreamProbe(None, None, simulated, model, f"unreachable ({type(exc).__name__})")
    if answer.status_code in (400, 422) and b"return_token_ids" in answer.content:
        return UpstreamProbe(False, None, simulated, model, "it refuses return_token_ids")
    body = _json(answer)
    choices = body.get("choices") if answer.is_success and isinstance(body, dict) else None
    if not choices or not isinstance(choices[0], dict):
        detail = f"its test call answered {answer.status_code}"
        return UpstreamProbe(None, None, simulated, model, detail)
    choice = choices[0]
    ids = response_ids_of(choice, "chat_completion") is not None
    log_probs = isinstance(choice.get("logprobs"), dict) or logprob_ids(choice.get("logprobs"))
    detail = "" if ids else "its answers carry none"
    return UpstreamProbe(ids, bool(log_probs), simulated, model, detail)


class CaptureMode:
    """Where a gateway's token ids come from, and the tokenizer it may compute them with."""

    def __init__(self, tokenizer: str | None, probe: UpstreamProbe | None = None) -> None:
        self.probe = probe
        self.tokenizer_setting = tokenizer
        if tokenizer is None and probe is not None and probe.simulated:
            self.tokenizer_setting = BUNDLED  # the simulated model's own tokenizer

    @cached_property
    def tokenizer(self) -> ChatTokenizer | None:
        """The model's chat tokenizer, when one is configured (loaded once)."""
        if self.tokenizer_setting is None:
            return None
        return load_chat_tokenizer(self.tokenizer_setting)

    def refusal(self) -> str | None:
        """Why the gateway must not start in this mode (one line), or None."""
        probe = self.probe
        if probe is None or probe.token_ids is not False or self.tokenizer_setting is not None:
            return None
        return (
            f"the upstream returns no token ids ({probe.detail}): set CLAW_TOKENIZER to the "
            "model's tokenizer folder (as saved with save_pretrained) so the gateway can "
            "compute them and check them against the server's counts"
        )

    def summary(self) -> str:
        """One line for the start-up log: where ids come from, and whether log-probs do."""
        facts = self.describe()
        log_probs = {True: "yes", False: "no", None: "unknown"}[facts["upstream_returns_log_probs"]]
        tokenizer = facts["tokenizer"] or "none"
        return f"token ids: {facts['token_ids']}; log-probs: {log_probs}; tokenizer: {tokenizer}"

    def describe(self) -> dict[str, Any]:
        """The mode as /readyz and the start-up log show it."""
        probe = self.probe
        token_ids = None if probe is None else probe.token_ids
        if token_ids:
            ids = "server ids"
        elif self.tokenizer_setting is not None:
            ids = "local tokenizer, checked against the server's counts"
        else:
            ids = "server ids when answers carry them (unknown at start)"
        return {
            "token_ids": ids,
            "upstream_returns_ids": token_ids,
            "upstream_returns_log_probs": None if probe is None else probe.log_probs,
            "simulated_upstream": bool(probe and probe.simulated),
            "tokenizer": self.tokenizer_setting,
            "probe": None if probe is None else probe.detail or "ok",
        }

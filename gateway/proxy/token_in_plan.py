"""One token-in call's plan: where it continues from, its prompt ids and the upstream body
(apart from `token_in`, which plans them, so a proxied call can carry one without importing
the planner)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.proxy.token_history import extend_chain


@dataclass(slots=True)
class TokenInPlan:
    """One token-in call: where it continues from, its prompt ids and the upstream body; or,
    for a call that continues nothing (`via_chat`), the chat call itself, whose ids the
    upstream renders and returns (nothing to splice, so nothing to tokenize here)."""

    trajectory_uid: str
    tools: Any
    chain: list[bytes]
    mode: str
    parent_step: int | None
    via_chat: bool
    prompt_ids: np.ndarray | None = None
    new_tokens: int | None = None
    body: bytes = b""
    logprobs_top: int | None = None  # None: the agent did not ask for log-probs
    token_ids: bool = False  # the agent asked for return_token_ids itself

    def metadata(self, reply: dict[str, Any]) -> dict[str, Any]:
        """What a step of this call (its reply message) records in `metadata.token_in`."""
        return {
            "mode": self.mode,
            "parent_step": self.parent_step,
            "history": extend_chain(self.chain, self.tools, reply).hex(),
            "new_tokens": self.new_tokens,
            "sent_as": "text" if self.via_chat else "ids",
        }

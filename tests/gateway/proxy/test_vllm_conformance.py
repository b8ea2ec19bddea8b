"""Protocol conformance against vLLM's own OpenAI protocol models (vllm 0.33, imported on CPU
where it is installed: `pip install --no-deps vllm==0.33.0` beside the test extra): what the
proxy asks an upstream for validates as vLLM's requests, and what `claw sim-llm` answers
(whole and streamed, chat and completions, token-in) validates as vLLM's responses, with the
token-id fields where vLLM puts them. Skipped where vLLM is absent, except under
`CLAW_REAL_SERVERS=required` (CI's `make real-servers`), where its absence fails."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel

from tests.support.real_servers import import_or_skip

chat_protocol = import_or_skip("vllm.entrypoints.openai.chat_completion.protocol")
completion_protocol = import_or_skip("vllm.entrypoints.openai.completion.protocol")

from claw_pipelines.simulation.llm import create_sim_app  # noqa: E402
from gateway.proxy.capture import CHAT_KIND, COMPLETION_KIND, augment  # noqa: E402

CHAT = {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 3?"}]}
COMPLETION = {"model": "m", "prompt": "2 + 3 =", "max_tokens": 8}
JSON = {"Content-Type": "application/json"}
TOKEN_IN = {"model": "m", "prompt": [11, 12, 13, 14], "max_tokens": 8}


# fields `claw sim-llm` sends that vLLM's models do not define (the README lists them):
# OpenAI's chat log-probs carry `refusal` beside `content`; vLLM's have `content` only
BEYOND_VLLM = {"choices[].logprobs.refusal"}


def beyond(data, parsed, path: str = "") -> set[str]:
    """Paths of fields in `data` that vLLM's parsed model does not define."""
    if isinstance(data, dict) and isinstance(parsed, BaseModel):
        fields = type(parsed).model_fields
        found = {path + k for k in data if k not in fields}
        for key in data.keys() & fields.keys():
            found |= beyond(data[key], getattr(parsed, key), f"{path}{key}.")
        return found
    if isinstance(data, list) and isinstance(parsed, list):
        return set().union(
            *(beyond(a, b, path[:-1] + "[].") for a, b in zip(data, parsed, strict=True))
        )
    return set()


def upstream_body(body: dict, kind: str) -> bytes:
    """What the proxy sends upstream for a client's body."""
    sent, added = augment(json.dumps(body).encode(), body, kind)
    assert added.token_ids
    return sent


def sse_chunks(text: str) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture(scope="module")
def sim() -> TestClient:
    return TestClient(create_sim_app())


@pytest.mark.parametrize("stream", [False, True])
def test_chat_requests_and_answers_are_vllms(sim, stream):
    sent = upstream_body(CHAT | {"stream": stream}, CHAT_KIND)
    request = chat_protocol.ChatCompletionRequest.model_validate_json(sent)
    assert request.return_token_ids is True and request.logprobs is True
    answer = sim.post("/v1/chat/completions", content=sent, headers=JSON)
    assert answer.status_code == 200, answer.text
    if not stream:
        parsed = chat_protocol.ChatCompletionResponse.model_validate(answer.json())
        assert parsed.prompt_token_ids and parsed.choices[0].token_ids
        assert parsed.choices[0].logprobs is not None
        return
    chunks = [
        chat_protocol.ChatCompletionStreamResponse.model_validate(c)
        for c in sse_chunks(answer.text)
    ]
    assert chunks[0].prompt_token_ids  # in the first chunk only, as vLLM sends it
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    assert sum(len(c.choices[0].token_ids or []) for c in chunks if c.choices) > 0


@pytest.mark.parametrize("body", [COMPLETION, TOKEN_IN], ids=["text", "token-in"])
@pytest.mark.parametrize("stream", [False, True])
def test_completion_requests_and_answers_are_vllms(sim, body, stream):
    sent = upstream_body(body | {"stream": stream}, COMPLETION_KIND)
    request = completion_protocol.CompletionRequest.model_validate_json(sent)
    assert request.return_token_ids is True and request.logprobs == 0
    answer = sim.post("/v1/completions", content=sent, headers=JSON)
    assert answer.status_code == 200, answer.text
    if not stream:
        parsed = completion_protocol.CompletionResponse.model_validate(answer.json())
        choice = parsed.choices[0]
        assert choice.prompt_token_ids and choice.token_ids
        if body is TOKEN_IN:
            assert choice.prompt_token_ids == TOKEN_IN["prompt"]
        assert not beyond(answer.json(), parsed)
        return
    raw = sse_chunks(answer.text)
    chunks = [completion_protocol.CompletionStreamResponse.model_validate(c) for c in raw]
    assert not set().union(*(beyond(r, c) for r, c in zip(raw, chunks, strict=True)))
    assert chunks[0].choices[0].prompt_token_ids  # on each choice's first chunk
    assert sum(len(c.choices[0].token_ids or []) for c in chunks if c.choices) > 0


def test_token_in_requests_and_the_chat_answers_made_of_them_are_vllms(sim):
    from claw_pipelines.settings import ClawSettings
    from gateway.proxy.call import ProxyCall
    from gateway.proxy.capture import CHAT as CHAT_ENDPOINT
    from gateway.proxy.capture_mode import CaptureMode
    from gateway.proxy.chat_from_tokens import chat_chunks
    from gateway.proxy.scope import Scope, TrajectoryBook
    from gateway.proxy.token_history import Turn
    from gateway.proxy.token_in import TokenIn
    from tests.support.upstreams import CALCULATOR

    capture = CaptureMode("bundled")  # the simulated model's own tokenizer
    token_in = TokenIn(ClawSettings(token_in="on"), None, TrajectoryBook(), capture)
    scope = Scope("t-1", "g-1")
    # the first turn goes as a chat call; its ids become the turn the next call continues
    first = CHAT | {"tools": [CALCULATOR], "return_token_ids": True}
    call = ProxyCall(CHAT_ENDPOINT, first, json.dumps(first).encode(), scope, "tenant", None, 0)
    root = asyncio.run(token_in.plan(call, upstream_ids=True))
    assert root.via_chat
    answer = sim.post("/v1/chat/completions", json=first).json()
    reply = answer["choices"][0]["message"]
    ids = np.asarray(answer["prompt_token_ids"] + answer["choices"][0]["token_ids"], np.int32)
    key = bytes.fromhex(root.metadata(reply)["history"])
    token_in.history.add("t-1", key, Turn(0, ids, ended=True))
    follow_up = {"role": "user", "content": "And 4 + 4?"}
    if reply.get("tool_calls"):
        follow_up = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"}
    messages = [*CHAT["messages"], reply, follow_up]
    body = {
        "model": "m",
        "messages": messages,
        "tools": [CALCULATOR],
        "logprobs": True,
        "top_logprobs": 2,
        "max_completion_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": 3,
    }
    call = ProxyCall(CHAT_ENDPOINT, body, json.dumps(body).encode(), scope, "tenant", None, 0)
    plan = asyncio.run(token_in.plan(call, upstream_ids=True))
    assert (plan.mode, plan.parent_step) == ("extend", 0)
    assert plan.prompt_ids[: len(ids)].tolist() == ids.tolist()
    request = completion_protocol.CompletionRequest.model_validate_json(plan.body)
    assert request.prompt == plan.prompt_ids.tolist() and request.return_token_ids is True
    assert (request.logprobs, request.max_tokens, request.seed) == (2, 64, 3)
    assert not request.stream
    answer = sim.post("/v1/completions", content=plan.body, headers=JSON)
    assert answer.status_code == 200, answer.text
    completion_protocol.CompletionResponse.model_validate(answer.json())
    chat, _ = token_in.chat_answer(plan, answer.json())
    parsed = chat_protocol.ChatCompletionResponse.model_validate(chat)
    assert not beyond(chat, parsed) - BEYOND_VLLM
    events = chat_chunks(chat, include_usage=True).decode()
    for chunk in sse_chunks(events):
        chat_protocol.ChatCompletionStreamResponse.model_validate(chunk)

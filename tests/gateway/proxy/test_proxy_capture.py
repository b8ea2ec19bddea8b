"""Token capture, SSE parsing and trajectory state of the proxy, without servers."""

from __future__ import annotations

import asyncio
import json

import pytest

from claw_pipelines.simulation.protocol import ChatCompletionRequest
from claw_pipelines.simulation.serving import SimulatedModel
from claw_pipelines.tokenization import load_chat_tokenizer, load_tokenizer
from gateway.errors import ApiError
from gateway.proxy.capture import (
    CHAT_KIND,
    COMPLETION_KIND,
    LOCAL_UNVERIFIED,
    Added,
    StepTokens,
    augment,
    captured_choices,
    local_prompt_ids,
    local_response_ids,
    stripped,
    verified,
)
from gateway.proxy.scope import TrajectoryBook, scope_of
from gateway.proxy.stream import DONE, StreamAccumulator, sse_data
from gateway.proxy.upstream import Upstream

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find the capital of Peru."},
    ],
    [{"role": "user", "content": "héllo wörld — ünïcode ✓"}],
]


@pytest.fixture(scope="module")
def sim() -> SimulatedModel:
    return SimulatedModel(load_tokenizer(), seed=0)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_local_tokenization_reproduces_the_sampled_ids(sim, messages, tools, seed):
    body = {"messages": messages, "seed": seed, "return_token_ids": True, "n": 2}
    if tools:
        body["tools"] = tools
    request = ChatCompletionRequest.model_validate(body)
    answer = sim.chat_response(sim.chat(request, body), request)
    tokenizer = load_chat_tokenizer()
    assert local_prompt_ids(body, CHAT_KIND, 0, tokenizer) == (answer["prompt_token_ids"], True)
    for choice in answer["choices"]:
        if choice["finish_reason"] == "length":
            continue
        local = local_response_ids(
            body, CHAT_KIND, choice["message"], choice["finish_reason"], tokenizer
        )
        assert local == choice["token_ids"]


def test_stream_chunks_fold_into_the_whole_answer(sim):
    body = {"messages": CONVERSATIONS[1], "tools": TOOLS, "seed": 4, "n": 3}
    streamed = body | {"stream": True, "return_token_ids": True, "logprobs": True}
    request = ChatCompletionRequest.model_validate(streamed)
    whole_request = ChatCompletionRequest.model_validate(body | {"return_token_ids": True})
    whole = sim.chat_response(sim.chat(whole_request, body), whole_request)
    accumulator = StreamAccumulator(CHAT_KIND)
    for chunk in sim.chat_chunks(sim.chat(request, streamed), request):
        accumulator.add(json.loads(json.dumps(chunk)))
    captured = accumulator.captured(None)
    assert [c.index for c in captured] == [0, 1, 2]
    for choice, expected in zip(captured, whole["choices"], strict=True):
        assert choice.response_ids == expected["token_ids"]
        assert choice.prompt_ids == whole["prompt_token_ids"]
        assert len(choice.logprobs) == len(expected["token_ids"])
        assert choice.finish_reason == expected["finish_reason"]
        message = {k: v for k, v in expected["message"].items() if v is not None}
        assert {k: v for k, v in choice.output.items() if v is not None} == message


def test_a_cut_stream_yields_exactly_the_choices_that_arrived_marked_cut():
    accumulator = StreamAccumulator(CHAT_KIND)
    accumulator.add({"id": "x", "choices": [{"index": 0, "delta": {"content": "Hi"}}]})
    accumulator.add({"id": "x", "choices": [{"index": 2, "delta": {}, "finish_reason": "stop"}]})
    captured = accumulator.captured("client_disconnected")  # n=3 asked: choice 1 never came
    assert [(c.index, c.finish_reason) for c in captured] == [
        (0, "client_disconnected"),
        (2, "stop"),
    ]
    assert captured[0].output["content"] == "Hi"


def test_sse_events_survive_any_split_of_the_bytes():
    stream = (
        b": keep-alive comment\r\n\r\n"
        b'data: {"a": 1}\r\n\r\n'
        b'data: {"b":\ndata: 2}\n\n'
        b"data: [DONE]\n\n"
    )

    async def parse(pieces: list[bytes]) -> list[bytes]:
        async def source():
            for piece in pieces:
                yield piece

        return [data async for data in sse_data(source())]

    expected = [b'{"a": 1}', b'{"b":\n2}', DONE]
    assert asyncio.run(parse([stream])) == expected
    assert asyncio.run(parse([bytes([b]) for b in stream])) == expected


def test_augment_asks_for_ids_and_logprobs_and_stripping_removes_only_those():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    raw = json.dumps(body).encode() + b"\n"
    upstream, added = augment(raw, body, CHAT_KIND)
    assert json.loads(upstream) == body | {"return_token_ids": True, "logprobs": True}
    assert added == Added(token_ids=True, logprobs=True)
    answer = {
        "id": "c",
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "token_ids": [3], "logprobs": {"content": []}, "text": "t"}],
    }
    assert stripped(answer, added) == {
        "id": "c",
        "choices": [{"index": 0, "logprobs": None, "text": "t"}],
    }
    assert answer["prompt_token_ids"] == [1, 2]  # the upstream answer itself is untouched

    asked = body | {"logprobs": False, "return_token_ids": True}
    upstream, added = augment(json.dumps(asked).encode(), asked, CHAT_KIND)
    assert json.loads(upstream) == asked | {"logprobs": True}
    assert added == Added(token_ids=False, logprobs=True)

    legacy = {"model": "m", "prompt": "p", "logprobs": 2, "return_token_ids": True}
    raw = json.dumps(legacy).encode()
    assert augment(raw, legacy, COMPLETION_KIND) == (raw, Added())


def test_scope_headers_are_validated():
    assert scope_of({}).trajectory_uid is None
    scope = scope_of({"x-claw-trajectory": "t.1", "x-claw-policy-version": "3"})
    assert (scope.trajectory_uid, scope.policy_version, scope.via) == ("t.1", 3, "header")
    with pytest.raises(ApiError) as bad:
        scope_of({"x-claw-trajectory": "spaces are not allowed"})
    assert bad.value.param == "X-Claw-Trajectory"
    with pytest.raises(ApiError):
        scope_of({"x-claw-policy-version": "-1"})


def test_trajectory_book_counts_steps_and_forgets_the_oldest():
    book = TrajectoryBook(capacity=2)
    assert book.claim_steps("a", 1) == 0
    assert book.claim_steps("a", 2) == 1
    assert book.claim_steps("a", 1) == 3
    book.register("a", {"policy_version": 5, "agent": "x"})
    assert book.registered("a") == (5, {"agent": "x"})
    book.claim_steps("b", 1)
    book.claim_steps("c", 1)  # evicts "a", the least recently used
    assert book.registered("a") == (None, {})
    assert book.claim_steps("a", 1) == 0


def test_sglang_and_llama_cpp_answers_give_their_ids():
    # SGLang 0.5.18+: per-choice prompt_token_ids and response_token_ids on chat answers
    sglang = {
        "id": "s",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "prompt_token_ids": [1, 2],
                "response_token_ids": [3, 4],
                "finish_reason": "stop",
            }
        ],
    }
    added = Added(token_ids=True, logprobs=True)
    view = stripped(sglang, added)
    assert "response_token_ids" not in view["choices"][0]
    assert "prompt_token_ids" not in view["choices"][0]
    (choice,) = captured_choices(sglang, view, CHAT_KIND)
    assert (choice.prompt_ids, choice.response_ids) == ([1, 2], [3, 4])
    assert "response_token_ids" not in choice.response["choices"][0]  # ids live in columns
    # llama.cpp: no id fields, but every chat log-prob entry names its sampled token's id
    entries = [{"id": 7, "token": "a", "logprob": -0.1}, {"id": 8, "token": "b", "logprob": -0.2}]
    llama = {
        "choices": [{"index": 0, "message": {"content": "ab"}, "logprobs": {"content": entries}}]
    }
    (choice,) = captured_choices(llama, llama, CHAT_KIND)
    assert choice.response_ids == [7, 8] and choice.prompt_ids is None
    assert choice.logprobs == [-0.1, -0.2]


def test_a_usage_chunk_only_the_gateway_asked_for_is_dropped():
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    upstream, added = augment(json.dumps(body).encode(), body, CHAT_KIND)
    assert json.loads(upstream)["stream_options"] == {"include_usage": True} and added.usage
    usage = {"prompt_tokens": 3, "completion_tokens": 2}
    assert stripped({"id": "c", "choices": [], "usage": usage}, added) is None
    last = {"id": "c", "choices": [{"index": 0, "delta": {}}], "usage": usage}  # on a choice
    assert stripped(last, added) == {"id": "c", "choices": [{"index": 0, "delta": {}}]}
    asked = body | {"stream_options": {"include_usage": True}}
    _, added = augment(json.dumps(asked).encode(), asked, CHAT_KIND)
    assert not added.usage  # the client's own usage chunk reaches it


def test_a_server_refusing_ids_on_streams_keeps_giving_them_on_plain_calls():
    upstream = Upstream("http://127.0.0.1:9/v1")
    upstream.refuses_token_ids(stream=True)  # SGLang refuses return_token_ids on chat streams
    assert upstream.returns_token_ids(stream=False) and not upstream.returns_token_ids(True)
    upstream.refuses_token_ids(stream=False)
    assert not upstream.returns_token_ids(stream=False)


def test_local_ids_are_labelled_by_the_servers_counts():
    def tokens(prompt: int, response: int) -> StepTokens:
        return StepTokens(
            b"\0" * 4 * prompt, b"\0" * 4 * response, None, LOCAL_UNVERIFIED, True, True
        )

    two = [tokens(5, 3), tokens(5, 4)]  # n=2: one prompt, two replies
    agree = verified(two, [0, 0], {"prompt_tokens": 5, "completion_tokens": 7})
    assert [t.token_source for t in agree] == ["local", "local"]
    assert agree[0].metadata["token_check"] == {
        "prompt_tokens": [5, 5],
        "completion_tokens": [7, 7],
    }
    disagree = verified(two, [0, 0], {"prompt_tokens": 5, "completion_tokens": 8})
    assert {t.token_source for t in disagree} == {"local_unverified"}
    unknown = verified(two, [0, 0], None)
    assert {t.token_source for t in unknown} == {"local_unverified"}
    server = [StepTokens(b"", b"", None, "upstream")]
    assert verified(server, [0], None) == server  # the server's ids need no check

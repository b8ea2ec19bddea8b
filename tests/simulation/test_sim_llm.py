"""The bundled tokenizer, the chat template and the simulated model, served for real by uvicorn."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from hypothesis import given, settings
from hypothesis import strategies as st

from claw_pipelines.simulation.llm import create_sim_app
from claw_pipelines.tokenization import (
    SPECIAL_TOKENS,
    decode,
    encode,
    encode_chat,
    load_tokenizer,
    render_chat,
)
from tests.support.upstreams import CALCULATOR

QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]


@contextmanager
def sim_server(seed: int = 0, latency_ms: float = 0.0) -> Iterator[str]:
    """The simulated model served by uvicorn on a free loopback port; yields its /v1 URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(create_sim_app(seed=seed, latency_ms=latency_ms), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "sim server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with sim_server(seed=0) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as sync_client:
        yield sync_client


def _chat(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("messages", QUESTION)
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(model="claw-sim-llm", extra_body=extra, **kwargs)


# --- tokenizer and template -------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_tokenizer_round_trips_any_text(text: str) -> None:
    assert decode(encode(text)) == text


def test_tokenizer_round_trips_unicode_and_special_strings() -> None:
    text = "naïve café 日本語 🙂👍🏽 \x00\t\r\n  <|im_end|> </tool_call> \u200b Ω≈ç√"
    ids = encode(text)
    assert decode(ids) == text
    assert load_tokenizer().token_to_id("<|im_end|>") in ids
    assert all(0 <= i < load_tokenizer().get_vocab_size() for i in ids)


def test_bundled_tokenizer_is_small_with_its_special_tokens() -> None:
    tokenizer = load_tokenizer()
    shipped = Path(__file__).parents[2] / "claw_pipelines" / "bundled_tokenizer" / "tokenizer.json"
    assert shipped.stat().st_size < 512 * 1024
    assert 3000 < tokenizer.get_vocab_size() <= 4096
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(encode("The answer is 19.")) <= 6


def test_template_renders_tools_tool_calls_and_content_parts() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "12 + 7?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "12 + 7"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "19"},
    ]
    text = render_chat(messages, tools=[CALCULATOR])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(CALCULATOR) in text
    assert "<|im_start|>user\nWhat is\n12 + 7?<|im_end|>\n" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "12 + 7"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert text.endswith("<|im_start|>tool\n19<|im_end|>\n<|im_start|>assistant\n")
    assert text.count("Be brief.") == 1
    # dict arguments render like their JSON string; no generation prompt when not asked
    messages[2]["tool_calls"][0]["function"]["arguments"] = {"expression": "12 + 7"}
    assert render_chat(
        messages, tools=[CALCULATOR], add_generation_prompt=False
    ) == text.removesuffix("<|im_start|>assistant\n")
    assert render_chat(QUESTION, template="{{ messages[0].content | upper }}") == "WHAT IS 12 + 7?"


def test_template_is_sandboxed() -> None:
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        render_chat(QUESTION, template="{{ messages.__class__.__mro__[1].__subclasses__() }}")


# --- the simulated model over HTTP ------------------------------------------------------------


def test_models_and_health_say_simulated(base_url: str) -> None:
    with httpx.Client(base_url=base_url.removesuffix("/v1")) as http:
        assert http.get("/health").status_code == 200
        models = http.get("/v1/models").json()
    assert [(m["id"], m["owned_by"]) for m in models["data"]] == [
        ("claw-sim-llm", "claw-simulated")
    ]


def test_chat_is_deterministic_and_token_ids_decode_to_content(client: openai.OpenAI) -> None:
    first, again = _chat(client), _chat(client)
    choice = first.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.token_ids == again.choices[0].token_ids
    assert choice.message.content == again.choices[0].message.content
    assert first.prompt_token_ids == encode_chat(QUESTION)
    assert decode(choice.token_ids, skip_special_tokens=True) == choice.message.content
    assert decode(choice.token_ids[-1:]) == "<|im_end|>"
    assert first.usage.prompt_tokens == len(first.prompt_token_ids)
    assert first.usage.completion_tokens == len(choice.token_ids)
    assert any(ch.isdigit() for ch in choice.message.content)  # an arithmetic answer


def test_seed_decides_the_answer() -> None:
    bodies = {"messages": [{"role": "user", "content": "Tell me something."}], "n": 4}
    answers = []
    for seed in (3, 3, 4):
        with sim_server(seed=seed) as url, httpx.Client() as http:
            answer = http.post(url + "/chat/completions", json=bodies).json()
            answers.append([c["message"]["content"] for c in answer["choices"]])
    assert answers[0] == answers[1] != answers[2]


def test_next_turn_prompt_contains_the_response_tokens(client: openai.OpenAI) -> None:
    response = _chat(client, tools=[CALCULATOR], tool_choice="required")
    call = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls" and call.content is None
    turn = [
        *QUESTION,
        call.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "19"},
    ]
    following = _chat(client, messages=turn, tools=[CALCULATOR])
    prefix = response.prompt_token_ids + response.choices[0].token_ids
    assert following.prompt_token_ids[: len(prefix)] == prefix
    assert following.choices[0].finish_reason == "stop"  # a tool result is answered in text
    assert "19" in following.choices[0].message.content


def test_streaming_reassembles_to_the_plain_answer(client: openai.OpenAI) -> None:
    kwargs = {"n": 3, "tools": [CALCULATOR], "logprobs": True, "top_logprobs": 2}
    plain = _chat(client, **kwargs)
    stream = _chat(client, stream=True, stream_options={"include_usage": True}, **kwargs)
    content, args, ids, logprobs, finish = {}, {}, {}, {}, {}
    with stream:
        chunks = list(stream)
    assert chunks[0].prompt_token_ids == plain.prompt_token_ids
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            i = c.index
            content[i] = content.get(i, "") + (c.delta.content or "")
            for call in c.delta.tool_calls or []:
                args[i] = args.get(i, "") + (call.function.arguments or "")
            ids.setdefault(i, []).extend(getattr(c, "token_ids", None) or [])
            logprobs.setdefault(i, []).extend(c.logprobs.content if c.logprobs else [])
            finish[i] = c.finish_reason or finish.get(i)
    for choice in plain.choices:
        i = choice.index
        assert ids[i] == choice.token_ids
        assert finish[i] == choice.finish_reason
        assert logprobs[i] == choice.logprobs.content
        if choice.message.tool_calls:
            assert args[i] == choice.message.tool_calls[0].function.arguments
        else:
            assert content[i] == choice.message.content


def test_tools_n2_and_logprobs_with_the_async_client(base_url: str) -> None:
    async def run():
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as aclient:
            return await aclient.chat.completions.create(
                model="claw-sim-llm",
                messages=QUESTION,
                tools=[CALCULATOR],
                tool_choice="required",
                n=2,
                logprobs=True,
                top_logprobs=3,
                extra_body={"return_token_ids": True},
            )

    response = asyncio.run(run())
    assert len(response.choices) == 2
    assert response.choices[0].token_ids != response.choices[1].token_ids
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "calculator" and call.id.startswith("call_")
        assert arguments["expression"] == "12 + 7"
        assert isinstance(arguments["precision"], int) and isinstance(arguments["exact"], bool)
        assert arguments["unit"] in ("none", "cm") and "note" not in arguments
        entries = choice.logprobs.content
        assert len(entries) == len(choice.token_ids)
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in entries)
        assert all(e.top_logprobs[0].logprob == e.logprob for e in entries)
        assert b"".join(bytes(e.bytes) for e in entries).decode() == decode(choice.token_ids)


def test_max_tokens_truncates_with_finish_reason_length(client: openai.OpenAI) -> None:
    full = _chat(client, seed=5)
    cut = _chat(client, seed=5, max_completion_tokens=2)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].token_ids == full.choices[0].token_ids[:2]
    assert cut.choices[0].message.content == decode(cut.choices[0].token_ids)


def test_an_aborted_request_answers_its_tokens_so_far_and_resumes_where_it_stopped(
    client: openai.OpenAI,
) -> None:
    full = _chat(client, seed=8, logprobs=True)
    cut = _chat(client, seed=8, logprobs=True, extra_body={"abort_after_tokens": 3})
    choice, whole = cut.choices[0], full.choices[0]
    assert choice.finish_reason == "abort" and choice.token_ids == whole.token_ids[:3]
    assert choice.message.content == decode(choice.token_ids, skip_special_tokens=True)
    assert [t.logprob for t in choice.logprobs.content] == [
        t.logprob for t in whole.logprobs.content[:3]
    ]
    # resumed as rollout engines do: the prompt's ids plus the partial reply's, token in
    prompt = [*cut.model_extra["prompt_token_ids"], *choice.token_ids]
    rest = client.completions.create(
        model="claw-sim-llm",
        prompt=prompt,
        seed=8,
        logprobs=0,
        extra_body={"return_token_ids": True},
    ).choices[0]
    assert rest.finish_reason == "stop"
    assert [*choice.token_ids, *rest.token_ids] == whole.token_ids  # the answer, whole
    assert rest.logprobs.token_logprobs == [t.logprob for t in whole.logprobs.content[3:]]
    short = _chat(client, seed=8, extra_body={"abort_after_tokens": 10_000}).choices[0]
    assert short.finish_reason == "stop"  # it ended before the abort came


def test_completions_take_token_id_prompts(base_url: str) -> None:
    ids = encode("Compute 3 * 4 =")
    with httpx.Client(base_url=base_url) as http:
        by_text = http.post(
            "/completions", json={"prompt": "Compute 3 * 4 =", "return_token_ids": True}
        )
        many = http.post(
            "/completions",
            json={
                "prompt": [ids, encode("Hello")],
                "n": 2,
                "logprobs": 2,
                "return_token_ids": True,
            },
        )
        streamed = http.post(
            "/completions", json={"prompt": ids, "stream": True, "return_token_ids": True}
        )
    text_choice = by_text.json()["choices"][0]
    assert text_choice["prompt_token_ids"] == ids and "prompt_token_ids" not in by_text.json()
    choices = many.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["token_ids"] == text_choice["token_ids"]  # same prompt ids, same choice
    assert choices[0]["text"] == decode(choices[0]["token_ids"], skip_special_tokens=True)
    assert [c["prompt_token_ids"] for c in choices[1:3]] == [ids, encode("Hello")]
    legacy = choices[0]["logprobs"]
    assert len(legacy["tokens"]) == len(legacy["token_logprobs"]) == len(choices[0]["token_ids"])
    assert all(len(top) == 2 for top in legacy["top_logprobs"]) and legacy["text_offset"][0] == 0
    events = [line[6:] for line in streamed.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parts = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(p["text"] for p in parts) == text_choice["text"]
    assert [i for p in parts for i in p["token_ids"]] == text_choice["token_ids"]
    assert parts[0]["prompt_token_ids"] == ids and parts[-1]["finish_reason"] == "stop"


def test_errors_use_the_openai_envelope(client: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, n=0)
    assert caught.value.body["param"] == "n"
    with httpx.Client(base_url=base_url) as http:
        bad_json = http.post(
            "/chat/completions", content=b"{", headers={"content-type": "application/json"}
        )
        bad_part = http.post(
            "/chat/completions",
            json={"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        )
        bad_ids = http.post("/completions", json={"prompt": [1, 10**9]})
        unknown = http.post(
            "/chat/completions", json={"messages": QUESTION, "vendor_knob": {"x": 1}}
        )
    for response in (bad_json, bad_part, bad_ids):
        assert response.status_code == 400
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert bad_part.json()["error"]["param"] == "messages[0].content"
    assert unknown.status_code == 200


def test_latency_is_spread_without_blocking_the_server() -> None:
    async def run(url: str) -> tuple[float, int]:
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            started = time.monotonic()
            body = {"messages": QUESTION, "stream": True}
            calls = [http.post("/chat/completions", json=body) for _ in range(4)]
            answers = await asyncio.gather(
                *calls, http.post("/chat/completions", json={"messages": QUESTION})
            )
            return time.monotonic() - started, sum(r.status_code == 200 for r in answers)

    with sim_server(latency_ms=300) as url:
        elapsed, ok = asyncio.run(run(url))
    assert ok == 5
    assert 0.3 <= elapsed < 1.0

"""Deterministic generation of the simulated model (no server code).

What a choice says is a function of (server seed, request `seed`, prompt token ids, choice
index) only, never of temperature or `max_tokens`: the sequence is generated whole, then cut.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from claw_pipelines.tokenization import (
    END_OF_TEXT,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TOOL_CALL_START,
    decode,
    encode,
    render_tool_call,
)

TOOL_CALL_PROBABILITY = 0.6
ARITHMETIC_ACCURACY = 0.8
TOP_LOGPROBS_MAX = 20

OPENERS = ("Sure.", "Okay.", "Let me think.", "Good question.", "Here is what I found.")
PHRASES = (
    "The agent reads the data carefully.",
    "The model returns a short answer.",
    "Each step uses the prompt and the tool output.",
    "The result looks correct so far.",
    "I checked the question step by step.",
    "The next token depends on the prompt.",
    "A small model can still give a good reward.",
    "The trainer learns from every trajectory.",
    "This tool finds the current value.",
    "The final result is ready.",
    "The policy improves with each new version.",
    "Let me know if you need anything else.",
    "The gateway stores every record once.",
    "The summary is short and clear.",
    "I can help with that task.",
    "The user needs a simple plan.",
)
TOOL_RESULT_PHRASES = (
    "The tool returned {result}.",
    "Based on the tool output, the result is {result}.",
    "I used the tool and got {result}.",
)
ARITHMETIC_ANSWERS = (
    "The answer is {value}.",
    "{expression} = {value}",
    "Let me compute that: {expression} = {value}. The answer is {value}.",
)
WORDS = ("weather", "Paris", "report", "data", "value", "notes", "today", "python", "search")

_OPERAND = r"\(*-?\d{1,12}(?:\.\d{1,6})?\)*"
_EXPRESSION = re.compile(rf"{_OPERAND}(?:\s*[-+*/]\s*{_OPERAND}){{1,7}}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


@dataclass(frozen=True)
class ToolCall:
    """A tool call the simulated model decided to make."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Generation:
    """One sampled choice: its exact token ids, visible text and per-token log-probs."""

    token_ids: list[int]
    text: str
    finish_reason: str
    tool_call: ToolCall | None
    logprobs: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


def choice_key(seed: int, request_seed: int | None, prompt_ids: Sequence[int], index: int) -> int:
    """A 64-bit key from everything a choice may depend on."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(f"{seed}:{request_seed}:{index}:".encode())
    digest.update(np.asarray(prompt_ids, dtype="<i8").tobytes())
    return int.from_bytes(digest.digest(), "little")


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("not arithmetic")


def find_arithmetic(text: str) -> tuple[str, int | float] | None:
    """The last arithmetic expression in `text` (like `12 + 7`) and its value, if any."""
    for match in reversed(list(_EXPRESSION.finditer(text))):
        expression = match.group(0).strip()
        try:
            value = _evaluate(ast.parse(expression, mode="eval"))
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
            continue
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            value = int(value)
        return expression, round(value, 6) if isinstance(value, float) else value
    return None


def _number_text(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _arithmetic_answer(rng: np.random.Generator, expression: str, value: int | float) -> str:
    if rng.random() >= ARITHMETIC_ACCURACY:
        value = value + int(rng.choice([-10, -2, -1, 1, 2, 10]))
    template = ARITHMETIC_ANSWERS[int(rng.integers(len(ARITHMETIC_ANSWERS)))]
    return template.format(expression=expression, value=_number_text(value))


def _chatter(rng: np.random.Generator) -> str:
    count = int(rng.integers(1, 4))
    picks = rng.choice(len(PHRASES), size=count, replace=False)
    sentences = [PHRASES[i] for i in picks]
    if rng.random() < 0.3:
        sentences.insert(0, OPENERS[int(rng.integers(len(OPENERS)))])
    return " ".join(sentences)


def reply_text(rng: np.random.Generator, question: str, tool_result: str | None) -> str:
    """What the model says: arithmetic answered (mostly right), tool results used, else chatter."""
    if tool_result is not None:
        numbers = _NUMBER.findall(tool_result)
        if numbers and find_arithmetic(question) and rng.random() < 0.9:
            return f"The answer is {numbers[-1]}."
        result = numbers[-1] if numbers else "ready"
        index = int(rng.integers(len(TOOL_RESULT_PHRASES)))
        return TOOL_RESULT_PHRASES[index].format(result=result) + " " + _chatter(rng)
    found = find_arithmetic(question)
    if found is not None:
        return _arithmetic_answer(rng, *found)
    return _chatter(rng)


def _schema_type(schema: dict[str, Any]) -> str:
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return kind if isinstance(kind, str) else "string"


def fill_value(schema: Any, rng: np.random.Generator, hint: str | None, depth: int = 0) -> Any:
    """A value fitting a JSON schema (enums, strings, numbers, booleans, objects, arrays)."""
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][int(rng.integers(len(schema["enum"])))]
    kind = _schema_type(schema)
    numbers = [float(n) for n in _NUMBER.findall(hint or "")]
    if kind == "integer":
        return int(numbers[0]) if numbers else int(rng.integers(0, 100))
    if kind == "number":
        return numbers[0] if numbers else round(float(rng.uniform(0, 100)), 2)
    if kind == "boolean":
        return bool(rng.random() < 0.5)
    if kind == "object" and depth < 4:
        return fill_arguments(schema, rng, hint, depth + 1)
    if kind == "array" and depth < 4:
        return [fill_value(schema.get("items"), rng, hint, depth + 1)]
    if hint:
        return hint
    return " ".join(WORDS[i] for i in rng.choice(len(WORDS), size=2, replace=False))


def fill_arguments(
    parameters: Any, rng: np.random.Generator, hint: str | None, depth: int = 0
) -> dict[str, Any]:
    """Arguments for an object schema: every required property (else the first one) filled."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict) or not properties:
        return {}
    required = [name for name in parameters.get("required") or [] if name in properties]
    names = required or list(properties)[:1]
    return {name: fill_value(properties[name], rng, hint, depth) for name in names}


def sample_logprobs(
    key: int, token_ids: Sequence[int], vocab_size: int, first_regular: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log-probs of the sampled tokens and of `TOP_LOGPROBS_MAX - 1` distinct alternatives.

    The sampled token is always the most likely one (p ≥ 0.5), alternatives are sorted and the
    probabilities of a row sum to less than one.
    """
    rng = np.random.default_rng([key, 1])
    ids = np.asarray(token_ids, dtype=np.int64)
    count, alternatives = len(ids), TOP_LOGPROBS_MAX - 1
    chosen = rng.uniform(0.5, 0.999, count)
    weights = -np.sort(-rng.exponential(size=(count, alternatives)), axis=1)
    alt_p = (1.0 - chosen)[:, None] * 0.95 * weights / weights.sum(axis=1, keepdims=True)
    offsets = np.cumsum(rng.integers(1, 40, size=(count, alternatives)), axis=1)
    regular = vocab_size - first_regular
    alt_ids = first_regular + (ids[:, None] - first_regular + offsets) % regular
    top_ids = np.concatenate([ids[:, None], alt_ids], axis=1)
    top_logprobs = np.log(np.concatenate([chosen[:, None], alt_p], axis=1))
    return top_logprobs[:, 0].copy(), top_ids, top_logprobs


def split_one_token(tokenizer: Tokenizer, ids: list[int], key: int) -> list[int]:
    """The same text with one of its tokens spelled as two (picked by `key`): the ids a model
    may sample but re-encoding the text never gives back; `ids` if no token can be split."""
    rng = np.random.default_rng([key, 2])
    specials = {tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    texts = [decode([i], tokenizer) for i in ids]  # a simulator, not a hot path
    candidates = [p for p, (i, t) in enumerate(zip(ids, texts, strict=True)) if i not in specials]
    for position in rng.permutation(candidates):
        text = texts[position]
        if len(text) < 2 or "\ufffd" in text:
            continue
        parts = [*encode(text[:1], tokenizer), *encode(text[1:], tokenizer)]
        if len(parts) > 1 and decode(parts, tokenizer) == text:
            return [*ids[:position], *parts, *ids[position + 1 :]]
    return ids


def _finish(
    tokenizer: Tokenizer,
    key: int,
    text: str,
    stop_token: str,
    tool_call: ToolCall | None,
    max_tokens: int | None,
    drift: float = 0.0,
) -> Generation:
    """Encode the full answer (with probability `drift` one token split in two), score it,
    then cut it at `max_tokens`."""
    ids = [*encode(text, tokenizer), tokenizer.token_to_id(stop_token)]
    if drift > 0 and np.random.default_rng([key, 3]).random() < drift:
        ids = split_one_token(tokenizer, ids, key)
    first_regular = 1 + max(tokenizer.token_to_id(t) for t in SPECIAL_TOKENS)
    logprobs, top_ids, top_logprobs = sample_logprobs(
        key, ids, tokenizer.get_vocab_size(), first_regular
    )
    finish = "tool_calls" if tool_call else "stop"
    if max_tokens is not None and len(ids) > max_tokens:
        ids, finish, tool_call = ids[:max_tokens], "length", None
        logprobs, top_ids, top_logprobs = (
            logprobs[:max_tokens],
            top_ids[:max_tokens],
            top_logprobs[:max_tokens],
        )
    visible = "" if tool_call else decode(ids, tokenizer, skip_special_tokens=True)
    return Generation(ids, visible, finish, tool_call, logprobs, top_ids, top_logprobs)


def _sliced(tokenizer: Tokenizer, gen: Generation, start: int, stop: int) -> Generation:
    """Tokens `start:stop` of a choice, with their log-probs (visible text decoded)."""
    ids = gen.token_ids[start:stop]
    return replace(
        gen,
        token_ids=ids,
        text=decode(ids, tokenizer, skip_special_tokens=True),
        logprobs=gen.logprobs[start:stop],
        top_ids=gen.top_ids[start:stop],
        top_logprobs=gen.top_logprobs[start:stop],
    )


def aborted(tokenizer: Tokenizer, gen: Generation, after: int | None) -> Generation:
    """The choice as vLLM answers a request aborted after `after` tokens (weights updated
    mid-generation): the tokens so far, finish_reason `abort`; a choice that ended first
    stays as it is."""
    if after is None or len(gen.token_ids) <= after:
        return gen
    return replace(_sliced(tokenizer, gen, 0, after), finish_reason="abort", tool_call=None)


def open_assistant_turn(tokenizer: Tokenizer, ids: Sequence[int]) -> int | None:
    """Where the partial reply starts in a ChatML prompt that ends inside an assistant turn
    (the conversation, the assistant's generation prompt, then some of its reply): what a
    rollout engine sends to resume an aborted request; None for any other prompt."""
    opener = encode(_GENERATION_PROMPT, tokenizer)
    starts = [i for i, t in enumerate(ids) if t == opener[0]]
    if not starts:
        return None
    begin = starts[-1] + len(opener)
    end_id = tokenizer.token_to_id(IM_END)
    if list(ids[starts[-1] : begin]) != opener or begin >= len(ids) or end_id in ids[begin:]:
        return None
    return begin


def continue_completion(
    tokenizer: Tokenizer,
    key: int,
    ids: Sequence[int],
    reply_start: int,
    max_tokens: int | None = None,
    drift: float = 0.0,
) -> Generation | None:
    """The rest of an aborted reply: the conversation `ids[:reply_start]` is answered as it
    was (`key` is its own), and when the partial reply `ids[reply_start:]` begins that
    answer, what follows is the continuation (cut at `max_tokens`); None when it does not."""
    conversation = decode(list(ids[:reply_start]), tokenizer)
    whole = generate_completion(tokenizer, key, conversation, None, drift)
    partial = list(ids[reply_start:])
    if whole.token_ids[: len(partial)] != partial or len(whole.token_ids) == len(partial):
        return None
    rest = _sliced(tokenizer, whole, len(partial), len(whole.token_ids))
    if max_tokens is not None and len(rest.token_ids) > max_tokens:
        rest = replace(_sliced(tokenizer, rest, 0, max_tokens), finish_reason="length")
    return replace(rest, tool_call=None)


def _last(messages: Sequence[dict[str, Any]], role: str) -> dict[str, Any] | None:
    return next((m for m in reversed(messages) if m.get("role") == role), None)


def _text_of(message: dict[str, Any] | None) -> str:
    content = (message or {}).get("content")
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content or ""


def _pick_tool(
    rng: np.random.Generator, tools: Sequence[dict[str, Any]], tool_choice: Any
) -> dict[str, Any] | None:
    """The tool to call, or None to answer in text (tool_choice: none/auto/required/named)."""
    functions = [t.get("function") or {} for t in tools]
    if not functions or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        return next((f for f in functions if f.get("name") == wanted), None)
    if tool_choice != "required" and rng.random() >= TOOL_CALL_PROBABILITY:
        return None
    return functions[int(rng.integers(len(functions)))]


def generate_chat(
    tokenizer: Tokenizer,
    key: int,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: Any = "auto",
    max_tokens: int | None = None,
    drift: float = 0.0,
) -> Generation:
    """One chat choice: a tool call (sometimes, when tools are offered) or a text answer."""
    rng = np.random.default_rng([key, 0])
    question = _text_of(_last(messages, "user"))
    last_is_tool = bool(messages) and messages[-1].get("role") == "tool"
    function = None if last_is_tool else _pick_tool(rng, tools or [], tool_choice)
    if function is not None:
        hint = found[0] if (found := find_arithmetic(question)) else None
        arguments = json.dumps(fill_arguments(function.get("parameters"), rng, hint))
        call = ToolCall("call_" + rng.bytes(12).hex(), str(function.get("name", "")), arguments)
        text = render_tool_call(call.name, call.arguments)
        return _finish(tokenizer, key, text, IM_END, call, max_tokens, drift)
    tool_result = _text_of(messages[-1]) if last_is_tool else None
    text = reply_text(rng, question, tool_result)
    return _finish(tokenizer, key, text, IM_END, None, max_tokens, drift)


def generate_completion(
    tokenizer: Tokenizer,
    key: int,
    prompt_text: str,
    max_tokens: int | None = None,
    drift: float = 0.0,
) -> Generation:
    """One legacy completion choice: a continuation of the prompt text; a prompt that is a
    ChatML conversation waiting for the assistant is answered as its chat would be."""
    chat = parse_chat_prompt(prompt_text)
    if chat is not None:
        messages, tools = chat
        return generate_chat(tokenizer, key, messages, tools, "auto", max_tokens, drift)
    rng = np.random.default_rng([key, 0])
    found = find_arithmetic(prompt_text)
    text = " " + (_arithmetic_answer(rng, *found) if found else _chatter(rng))
    return _finish(tokenizer, key, text, END_OF_TEXT, None, max_tokens, drift)


_GENERATION_PROMPT = IM_START + "assistant\n"
_TOOLS = re.compile(r"\n\n# Tools\n.*?<tools>\n(.*?)\n</tools>", re.DOTALL)


def parse_chat_prompt(text: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None] | None:
    """The messages and tools of a ChatML-rendered conversation ending in the assistant's
    generation prompt (what a token-in client sends as a completion); None otherwise."""
    if not text.endswith(_GENERATION_PROMPT) or not text.startswith(IM_START):
        return None
    messages: list[dict[str, Any]] = []
    tools = None
    for turn in text[: -len(_GENERATION_PROMPT)].split(IM_START)[1:]:
        role, _, content = turn.partition("\n")
        content = content.removesuffix("\n").removesuffix(IM_END)
        if role == "system" and not messages and (found := _TOOLS.search(content)):
            tools = [json.loads(line) for line in found.group(1).split("\n") if line]
            content = content[: found.start()]
        if role == "assistant" and TOOL_CALL_START in content:
            content = content.split(TOOL_CALL_START)[0].rstrip("\n")
            messages.append({"role": role, "content": content, "tool_calls": [{}]})
            continue
        messages.append({"role": role, "content": content})
    return messages, tools

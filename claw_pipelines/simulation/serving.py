"""The simulated model as a serving object (no FastAPI): requests in, response dicts out."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from claw_pipelines.simulation.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Piece,
    chat_logprobs,
    completion_logprobs,
    stream_pieces,
    usage,
)
from claw_pipelines.simulation.sampling import (
    Generation,
    aborted,
    choice_key,
    continue_completion,
    generate_chat,
    generate_completion,
    open_assistant_turn,
)
from claw_pipelines.tokenization import decode, encode, render_chat

MAX_MODEL_LEN = 32_768
OWNED_BY = "claw-simulated"


class SimRequestError(ValueError):
    """A request the simulated model refuses (HTTP 400), naming the parameter at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Run:
    """The generations of one request: per prompt, its token ids and `n` choices."""

    id: str
    created: int
    prompt_ids: list[list[int]]
    choices: list[Generation]
    n: int

    @property
    def usage(self) -> dict[str, int]:
        """Prompt tokens counted once per prompt, completion tokens over all choices."""
        return usage(sum(map(len, self.prompt_ids)), sum(len(c.token_ids) for c in self.choices))


class SimulatedModel:
    """A deterministic stand-in for an OpenAI-compatible inference server like vLLM."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        seed: int = 0,
        model_id: str = "claw-sim-llm",
        drift: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        # the share of choices sampled with one token spelled as two: re-rendering their text
        # gives other ids, as it often does with real models
        self.drift = drift
        self.model_id = model_id
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        """The `GET /v1/models` answer."""
        card = {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": OWNED_BY,
            "root": self.model_id,
            "parent": None,
            "max_model_len": MAX_MODEL_LEN,
        }
        return {"object": "list", "data": [card]}

    def _check_prompt(self, ids: Sequence[int], param: str) -> None:
        if len(ids) >= MAX_MODEL_LEN:
            raise SimRequestError(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens; "
                f"the prompt has {len(ids)}.",
                param,
            )
        vocab = self.tokenizer.get_vocab_size()
        if ids and max(ids) >= vocab:
            raise SimRequestError(f"token id {max(ids)} is out of vocabulary ({vocab})", param)

    def _new_run(
        self, prefix: str, prompt_ids: list[list[int]], choices: list[Generation], n: int
    ) -> Run:
        return Run(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), prompt_ids, choices, n)

    def chat(self, request: ChatCompletionRequest, body: dict[str, Any]) -> Run:
        """Sample `n` choices for a chat (rendered from the raw request body, fields as sent)."""
        messages, tools = body["messages"], body.get("tools") or None
        try:
            prompt = render_chat(messages, tools)
        except Exception as error:  # a template error names the message at fault
            raise SimRequestError(f"cannot render the chat: {error}", "messages") from error
        prompt_ids = encode(prompt, self.tokenizer)
        self._check_prompt(prompt_ids, "messages")
        tool_choice = body.get("tool_choice") or "auto"
        choices = [
            generate_chat(
                self.tokenizer,
                choice_key(self.seed, request.seed, prompt_ids, index),
                messages,
                tools,
                tool_choice,
                request.token_limit,
                self.drift,
            )
            for index in range(request.n)
        ]
        choices = [aborted(self.tokenizer, c, request.abort_after_tokens) for c in choices]
        return self._new_run("chatcmpl", [prompt_ids], choices, request.n)

    def completion(self, request: CompletionRequest) -> Run:
        """Sample `n` choices for every prompt of a legacy completion request."""
        all_ids, choices = [], []
        for prompt in request.prompts():
            ids = encode(prompt, self.tokenizer) if isinstance(prompt, str) else prompt
            self._check_prompt(ids, "prompt")
            text = prompt if isinstance(prompt, str) else decode(ids, self.tokenizer)
            all_ids.append(ids)
            choices += [
                aborted(
                    self.tokenizer,
                    self._complete(request, ids, text, index),
                    request.abort_after_tokens,
                )
                for index in range(request.n)
            ]
        return self._new_run("cmpl", all_ids, choices, request.n)

    def _complete(
        self, request: CompletionRequest, ids: list[int], text: str, index: int
    ) -> Generation:
        """One choice for a prompt: a ChatML prompt ending inside an assistant turn (an
        aborted reply sent again to be resumed) gets the rest of that reply, as the answer
        to the conversation would have gone on; any other prompt a new answer."""
        reply_start = open_assistant_turn(self.tokenizer, ids)
        if reply_start is not None:
            key = choice_key(self.seed, request.seed, ids[:reply_start], index)
            rest = continue_completion(
                self.tokenizer, key, ids, reply_start, request.max_tokens, self.drift
            )
            if rest is not None:
                return rest
        return generate_completion(
            self.tokenizer,
            choice_key(self.seed, request.seed, ids, index),
            text,
            request.max_tokens,
            self.drift,
        )

    def _message(self, gen: Generation) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": gen.text or None}
        if gen.tool_call is not None:
            call = gen.tool_call
            function = {"name": call.name, "arguments": call.arguments}
            message["tool_calls"] = [{"id": call.id, "type": "function", "function": function}]
        return message

    @staticmethod
    def _choice(
        index: int,
        payload: dict[str, Any],
        finish_reason: str | None,
        logprobs: dict[str, Any] | None,
        token_ids: list[int] | None,
    ) -> dict[str, Any]:
        """One entry of `choices`; `token_ids` only when they were asked for."""
        choice = {"index": index, **payload, "logprobs": logprobs, "finish_reason": finish_reason}
        choice["stop_reason"] = None
        return choice if token_ids is None else choice | {"token_ids": token_ids}

    def chat_response(self, run: Run, request: ChatCompletionRequest) -> dict[str, Any]:
        """The non-streaming chat completion object."""
        top = request.top_logprobs or 0
        choices = [
            self._choice(
                index,
                {"message": self._message(gen)},
                gen.finish_reason,
                chat_logprobs(self.tokenizer, gen, top) if request.logprobs else None,
                gen.token_ids if request.return_token_ids else None,
            )
            for index, gen in enumerate(run.choices)
        ]
        response = self._envelope(run, "chat.completion", choices) | {"usage": run.usage}
        if request.return_token_ids:
            response["prompt_token_ids"] = run.prompt_ids[0]
        return response

    def completion_response(self, run: Run, request: CompletionRequest) -> dict[str, Any]:
        """The non-streaming legacy completion object."""
        choices = []
        for index, gen in enumerate(run.choices):
            logprobs = None
            if request.logprobs is not None:
                logprobs = completion_logprobs(self.tokenizer, gen, request.logprobs)
            ids = gen.token_ids if request.return_token_ids else None
            choice = self._choice(index, {"text": gen.text}, gen.finish_reason, logprobs, ids)
            if request.return_token_ids:
                choice["prompt_token_ids"] = run.prompt_ids[index // run.n]
            choices.append(choice)
        # prompt ids on each choice only, as vLLM answers (no top-level copy)
        return self._envelope(run, "text_completion", choices) | {"usage": run.usage}

    def _envelope(self, run: Run, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": run.id,
            "object": kind,
            "created": run.created,
            "model": self.model_id,
            "system_fingerprint": f"claw-sim-seed-{self.seed}",
            "choices": choices,
        }

    def _chat_delta(self, gen: Generation, piece: Piece, first: bool) -> dict[str, Any]:
        if gen.tool_call is None:
            return {"content": piece.text}
        call: dict[str, Any] = {"index": 0, "function": {"arguments": piece.text}}
        if first:
            call |= {"id": gen.tool_call.id, "type": "function"}
            call["function"] = {"name": gen.tool_call.name, "arguments": piece.text}
        return {"tool_calls": [call]}

    def _interleaved(self, run: Run) -> Iterator[tuple[int, Generation, Piece, int, bool]]:
        """(choice index, choice, piece, piece number, is last) round-robin over the choices."""
        pieces = [stream_pieces(self.tokenizer, gen) for gen in run.choices]
        for step in range(max(map(len, pieces))):
            for index, (gen, own) in enumerate(zip(run.choices, pieces, strict=True)):
                if step < len(own):
                    yield index, gen, own[step], step, step == len(own) - 1

    def chat_chunks(self, run: Run, request: ChatCompletionRequest) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed chat completion (vLLM-style token ids when asked)."""
        kind = "chat.completion.chunk"
        for index, gen in enumerate(run.choices):
            delta = {"role": "assistant"} | ({} if gen.tool_call else {"content": ""})
            chunk = self._envelope(
                run, kind, [self._choice(index, {"delta": delta}, None, None, None)]
            )
            if index == 0 and request.return_token_ids:
                chunk["prompt_token_ids"] = run.prompt_ids[0]
            yield chunk
        top = request.top_logprobs or 0
        for index, gen, piece, step, last in self._interleaved(run):
            logprobs = None
            if request.logprobs:
                logprobs = chat_logprobs(self.tokenizer, gen, top, piece.start, piece.end)
            ids = gen.token_ids[piece.start : piece.end] if request.return_token_ids else None
            delta = self._chat_delta(gen, piece, step == 0)
            finish = gen.finish_reason if last else None
            choice = self._choice(index, {"delta": delta}, finish, logprobs, ids)
            yield self._envelope(run, kind, [choice])
        if request.include_usage:
            yield self._envelope(run, kind, []) | {"usage": run.usage}

    def completion_chunks(self, run: Run, request: CompletionRequest) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed legacy completion (prompt ids on each choice's first chunk)."""
        for index, gen, piece, step, last in self._interleaved(run):
            logprobs = None
            if request.logprobs is not None:
                logprobs = completion_logprobs(
                    self.tokenizer, gen, request.logprobs, piece.start, piece.end
                )
            ids = gen.token_ids[piece.start : piece.end] if request.return_token_ids else None
            finish = gen.finish_reason if last else None
            choice = self._choice(index, {"text": piece.text}, finish, logprobs, ids)
            if request.return_token_ids and step == 0:
                choice["prompt_token_ids"] = run.prompt_ids[index // run.n]
            yield self._envelope(run, "text_completion", [choice])
        if request.include_usage:
            yield self._envelope(run, "text_completion", []) | {"usage": run.usage}

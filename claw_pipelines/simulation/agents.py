"""Simulated agents for demos and load: white-box math solvers, black-box tool agents, a
rollout worker whose request a weight update aborts and that resumes it (partial rollouts),
and a feedback service. They know only URLs: an inference server and a Claw gateway."""

from __future__ import annotations

import json
import random
import re
import uuid
from dataclasses import dataclass, field

import httpx

from claw_pipelines.lake.tokenizers import bundled_fingerprint

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@dataclass
class Task:
    """An arithmetic question with a checkable answer."""

    question: str
    answer: int

    @classmethod
    def random(cls, rng: random.Random) -> Task:
        """A random `a op b` task."""
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["+", "-", "*"])
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return cls(f"What is {a} {op} {b}?", value)

    def reward(self, text: str | None) -> float:
        """1.0 when the last number in `text` is the answer, else 0.0."""
        numbers = re.findall(r"-?\d+", text or "")
        return 1.0 if numbers and int(numbers[-1]) == self.answer else 0.0


@dataclass
class Tally:
    """What the agents sent and what the gateway acknowledged."""

    steps: int = 0
    trajectories: int = 0
    feedback: int = 0
    events: int = 0
    event_ids: list[str] = field(default_factory=list)

    def add(self, answer: dict, kind: str) -> None:
        """Count an `Accepted` answer."""
        self.event_ids += answer["event_ids"]
        setattr(self, kind, getattr(self, kind) + answer["accepted"])


def white_box_group(
    llm: httpx.Client,
    gateway: httpx.Client,
    task: Task,
    rollouts: int,
    policy_version: int | None,
    tally: Tally,
) -> list[str]:
    """GRPO group of a white-box agent: it samples from its own inference server with exact
    token ids and log-probs, then submits token-level steps with rewards (`policy_version`
    None: the gateway stamps the published one). Returns step keys."""
    group = f"wb-{uuid.uuid4().hex[:12]}"
    answer = (
        llm.post(
            "/chat/completions",
            json={
                "model": "claw-sim-llm",
                "n": rollouts,
                "logprobs": True,
                "return_token_ids": True,
                "messages": [
                    {"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": task.question},
                ],
            },
        )
        .raise_for_status()
        .json()
    )
    steps = []
    for choice in answer["choices"]:
        trajectory = f"{group}-r{choice['index']}"
        logprobs = [item["logprob"] for item in choice["logprobs"]["content"]]
        steps.append(
            {
                "trajectory_uid": trajectory,
                "prompt_uid": group,
                "step_index": 0,
                "prompt_ids": answer["prompt_token_ids"],
                "response_ids": choice["token_ids"],
                "rollout_log_probs": logprobs,
                "response_mask": [1] * len(choice["token_ids"]),
                "reward": task.reward(choice["message"]["content"]),
                "policy_version": policy_version,
                "is_last": True,
                "finish_reason": choice["finish_reason"],
                "model": answer["model"],
                "metadata": {
                    "agent": "white-box-math",
                    "task": task.question,
                    # the ids are the simulated model's: exports decode them with its tokenizer
                    "tokenizer": {"name": "bundled", "fingerprint": bundled_fingerprint()},
                },
            }
        )
    tally.add(gateway.post("/v1/steps", json={"steps": steps}).raise_for_status().json(), "steps")
    tally.trajectories += len(steps)
    return [f"{s['trajectory_uid']}:0" for s in steps]


def black_box_rollout(
    gateway_url: str,
    api_key: str,
    task: Task,
    group: str,
    policy_version: int,
    tally: Tally,
    max_turns: int = 4,
    scoped: bool = True,
    seed: int | None = None,
    compact_every: int | None = None,
) -> str:
    """A tool-using agent that only knows an OpenAI base URL: scoped to its trajectory, or
    the plain `/v1` (unscoped: the lake stitches its turns by their token prefixes). Returns
    its trajectory uid (unscoped: its first call's, which stitching keeps).

    `compact_every`: the agent keeps its context short, as agents that summarize their
    history do: it asks follow-up questions until `max_turns` calls, and after every
    `compact_every` calls it replaces the turns since its first question with one summary
    message (`compacted`), so its next prompt no longer extends the previous one. It is
    rewarded on the last question it asked."""
    from openai import OpenAI

    trajectory = f"bb-{uuid.uuid4().hex[:12]}"
    base_url = f"{gateway_url}/t/{trajectory}/g/{group}/v1" if scoped else f"{gateway_url}/v1"
    client = OpenAI(
        base_url=base_url,
        api_key=api_key,
        max_retries=2,
        default_headers={"X-Claw-Policy-Version": str(policy_version)},
    )
    messages = [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": task.question},
    ]
    final = None
    follow_ups = random.Random(seed)
    with client:
        for turn in range(1, max_turns + 1):
            raw = client.chat.completions.with_raw_response.create(
                model="claw-sim-llm", messages=messages, tools=[CALCULATOR_TOOL], seed=seed
            )
            reply = raw.parse().choices[0].message
            if not scoped and turn == 1:  # the first call names the trajectory
                trajectory = raw.headers["x-claw-step-keys"].rsplit(":", 1)[0]
            tally.steps += 1
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                final = reply.content
                if compact_every is None or turn == max_turns:
                    break
                task = Task.random(follow_ups)  # a follow-up question, scored at the end
                messages.append({"role": "user", "content": f"And now: {task.question}"})
            for call in reply.tool_calls or ():
                expression = json.loads(call.function.arguments).get("expression", "")
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": str(_calculate(expression, task)),
                    }
                )
            if compact_every is not None and turn % compact_every == 0:
                messages = compacted(messages)
    return complete(gateway_url, api_key, trajectory, task.reward(final), tally)


def complete(gateway_url: str, api_key: str, trajectory: str, reward: float, tally: Tally) -> str:
    """Close `trajectory` with its `reward` through the gateway, counted in `tally`; its id."""
    done = httpx.post(
        f"{gateway_url}/v1/trajectories/{trajectory}/complete",
        headers={"Authorization": f"Bearer {api_key}"},
        json={"reward": reward},
        timeout=30,
    )
    tally.add(done.raise_for_status().json(), "events")
    tally.trajectories += 1
    return trajectory


def compacted(messages: list[dict]) -> list[dict]:
    """A conversation compacted as context-managing agents do: the system prompt and the first
    question kept, every later message replaced by one user message summarizing them (what
    the tools returned, what was answered), then the newest question or tool result again
    so the conversation goes on where it was."""
    head, rest = messages[:2], messages[2:]
    if not rest:
        return list(messages)
    last = rest[-1]
    keep_last = last.get("role") in ("user", "tool") and len(rest) > 1
    earlier = rest[:-1] if keep_last else rest
    notes = []
    for message in earlier:
        if message.get("role") == "tool":
            notes.append(f"a tool returned {message.get('content')}")
        elif message.get("role") == "assistant" and message.get("content"):
            notes.append(f"you answered: {message['content']}")
        elif message.get("role") == "user":
            notes.append(f"the user asked: {message.get('content')}")
    summary = {"role": "user", "content": "Summary of the conversation so far: " + "; ".join(notes)}
    if keep_last and last.get("role") == "tool":  # a tool result needs its call: say it
        last = {"role": "user", "content": f"The calculator returned {last.get('content')}."}
    return [*head, summary, *([last] if keep_last else [])]


def partial_rollout(
    gateway_url: str,
    api_key: str,
    task: Task,
    group: str,
    policy_version: int,
    tally: Tally,
    abort_after: int = 6,
) -> str:
    """An async-RL rollout worker's request that a weight update aborts mid-generation and
    that the worker resumes under the new policy, as AReaL and slime do: its chat call under
    `policy_version` is aborted after `abort_after` tokens (the simulated model's stand-in
    for the update; vLLM answers finish_reason `abort` with the tokens so far); the worker
    sends the prompt's ids plus the partial reply's ids back as a token-in completion under
    `policy_version + 1`, which the lake joins to the partial into one step. Scoped to its
    trajectory (returned); a reply that ended before the abort is not resumed."""
    from openai import OpenAI

    trajectory = f"pr-{uuid.uuid4().hex[:12]}"
    client = OpenAI(
        base_url=f"{gateway_url}/t/{trajectory}/g/{group}/v1", api_key=api_key, max_retries=2
    )
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": task.question},
    ]
    with client:
        first = client.chat.completions.create(
            model="claw-sim-llm",
            messages=messages,
            logprobs=True,
            extra_headers={"X-Claw-Policy-Version": str(policy_version)},
            extra_body={"return_token_ids": True, "abort_after_tokens": abort_after},
        )
        choice = first.choices[0]
        text, tally.steps = choice.message.content or "", tally.steps + 1
        if choice.finish_reason == "abort":  # resumed: the same prompt plus the partial reply
            prompt = [*first.model_extra["prompt_token_ids"], *choice.model_extra["token_ids"]]
            rest = client.completions.create(
                model="claw-sim-llm",
                prompt=prompt,
                logprobs=0,
                extra_headers={"X-Claw-Policy-Version": str(policy_version + 1)},
                extra_body={"return_token_ids": True},
            )
            text, tally.steps = text + rest.choices[0].text, tally.steps + 1
    return complete(gateway_url, api_key, trajectory, task.reward(text), tally)


def _calculate(expression: str, task: Task) -> int:
    """The checker tool: evaluates `a op b`; falls back to the task's own answer."""
    match = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", expression or "")
    if not match:
        return task.answer
    a, op, b = int(match[1]), match[2], int(match[3])
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def feedback_service(
    gateway: httpx.Client, step_keys: list[str], rng: random.Random, tally: Tally
) -> None:
    """Late human feedback: ratings, labels and a correction on some finished steps."""
    for key in step_keys:
        if rng.random() < 0.3:
            body = {
                "target": {"step_key": key},
                "kind": "rating",
                "value": rng.randint(1, 5),
                "source": "human",
                "annotator": f"annotator-{rng.randint(1, 3)}",
            }
            tally.add(gateway.post("/v1/feedback", json=body).raise_for_status().json(), "feedback")
        if rng.random() < 0.1:
            body = {
                "target": {"step_key": key},
                "kind": "label",
                "value": "needs-review",
                "source": "human",
            }
            tally.add(gateway.post("/v1/feedback", json=body).raise_for_status().json(), "feedback")


def session_event(gateway: httpx.Client, kind: str, trajectory: str | None, tally: Tally):
    """A live event from a black-box service."""
    body = {"type": kind, "trajectory_uid": trajectory, "payload": {"source": "demo"}}
    tally.add(gateway.post("/v1/events", json=body).raise_for_status().json(), "events")

"""The learning loop's toy verifiable task and its agent (`claw demo --learn`).

The policy (`model_folders.word_policy_folder`) says only a vocabulary of whole words, one
token each; the task rewards the share of a reply's words that are in a small target set
drawn from that vocabulary, so an untrained policy scores about targets / vocabulary (16 of
128: 0.125) and a policy that learned to say target words scores up to 1. The agent knows
an OpenAI base URL and a checkpoint folder per policy version: each rollout is one scoped
chat call (`/t/<trajectory>/g/<group>/v1`, the policy version in `X-Claw-Policy-Version`,
the version's folder as `model`; a group's rollouts at once), its reward posted to the
gateway when it is scored (`POST /v1/trajectories/<trajectory>/complete`).
"""

from __future__ import annotations

import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

PROMPTS = (
    "Say a few words.",
    "Tell me something.",
    "What comes to mind?",
    "Name some things you like.",
    "Describe your day.",
    "Give me a short list.",
    "Talk about the weather.",
    "What did you see today?",
)


@dataclass(frozen=True)
class WordTask:
    """Reply with words of `targets`; the reward is the share of the reply's words in it."""

    vocabulary: tuple[str, ...]  # the words the policy can say
    targets: frozenset[str]

    @classmethod
    def of_folder(cls, folder: Path, targets: int = 16, seed: int = 0) -> WordTask:
        """The task for a policy folder: its sampled words, `targets` of them drawn by `seed`."""
        from tokenizers import Tokenizer

        from claw_pipelines.simulation.model_folders import sampled_ids

        tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        special = {tokenizer.token_to_id(t.content) for t in _specials(tokenizer)}
        ids = [i for i in sampled_ids(Path(folder)) if i not in special]
        words = tuple(tokenizer.decode([i]).strip() for i in ids)
        if targets > len(words):
            raise ValueError(f"targets: {targets} is more than the {len(words)} words it says")
        return cls(words, frozenset(random.Random(seed).sample(sorted(words), targets)))

    @property
    def chance(self) -> float:
        """The expected reward of a policy that says every word alike."""
        return len(self.targets) / len(self.vocabulary)

    def reward(self, reply: str | None) -> float:
        """The share of the reply's words that are target words (0 for an empty reply)."""
        words = (reply or "").split()
        return sum(word in self.targets for word in words) / len(words) if words else 0.0

    def messages(self, rng: random.Random) -> list[dict[str, str]]:
        """A prompt: a system line and one of PROMPTS."""
        return [
            {"role": "system", "content": "Answer in a few words."},
            {"role": "user", "content": rng.choice(PROMPTS)},
        ]


def _specials(tokenizer) -> list:
    return [t for t in tokenizer.get_added_tokens_decoder().values() if t.special]


@dataclass(frozen=True)
class Rollout:
    """One scored reply: its trajectory, the policy version it was asked of, its reward."""

    trajectory: str
    group: str
    policy_version: int
    reward: float
    step_key: str


class WordAgent:
    """Agents on the word task that know only the gateway's URL and an API key."""

    def __init__(self, gateway: str, api_key: str, task: WordTask, max_tokens: int = 6) -> None:
        from openai import OpenAI

        self.gateway, self.task, self.max_tokens = gateway, task, max_tokens
        self.run = uuid.uuid4().hex[:8]  # group ids never repeat another run's, seed or not
        self.groups = 0
        self.client = OpenAI(base_url=f"{gateway}/v1", api_key=api_key, max_retries=2)
        auth = {"Authorization": f"Bearer {api_key}"}
        self.http = httpx.Client(base_url=gateway, headers=auth, timeout=60)

    def group(
        self, model: str, policy_version: int, rng: random.Random, rollouts: int = 8
    ) -> list[Rollout]:
        """A GRPO group: `rollouts` scoped chat calls at once for one prompt, each with its
        own sampling seed (drawn from `rng` in rollout order), asking `model` (the
        checkpoint folder of `policy_version`), each reply's reward posted as its
        trajectory completes."""
        self.groups += 1
        group = f"learn-{self.run}-{self.groups:05d}"
        messages = self.task.messages(rng)
        seeds = [rng.getrandbits(31) for _ in range(rollouts)]
        with ThreadPoolExecutor(rollouts, thread_name_prefix="rollout") as pool:
            calls = [
                pool.submit(self._rollout, model, policy_version, group, index, messages, seed)
                for index, seed in enumerate(seeds)
            ]
            return [call.result() for call in calls]

    def _rollout(
        self,
        model: str,
        policy_version: int,
        group: str,
        index: int,
        messages: list[dict[str, str]],
        seed: int,
    ) -> Rollout:
        """One scoped chat call, scored, its reward posted."""
        trajectory = f"{group}-r{index}"
        scoped = self.client.with_options(
            base_url=f"{self.gateway}/t/{trajectory}/g/{group}/v1",
            default_headers={"X-Claw-Policy-Version": str(policy_version)},
        )
        raw = scoped.chat.completions.with_raw_response.create(
            model=model, messages=messages, max_tokens=self.max_tokens, seed=seed
        )
        reward = self.task.reward(raw.parse().choices[0].message.content)
        completed = self.http.post(
            f"/v1/trajectories/{trajectory}/complete", json={"reward": reward}
        )
        completed.raise_for_status()
        key = raw.headers["X-Claw-Step-Keys"]
        return Rollout(trajectory, group, policy_version, reward, key)

    def close(self) -> None:
        """Close the clients."""
        self.client.close()
        self.http.close()

"""What agents send a real gateway and what lands of it: white-box step bodies, a JSON POST
that keeps out-of-range floats, a scoped chat trajectory through the official client, and
bronze rows read back (by event id, by trajectory)."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import polars as pl

from tests.support.servers import bronze, wait_landed, wait_until


def step(trajectory_uid="traj-1", step_index=0, **extra):
    body = {
        "trajectory_uid": trajectory_uid,
        "prompt_uid": "group-1",
        "step_index": step_index,
        "prompt_ids": [101, 7, 8, 9],
        "response_ids": [11, 12, 13],
        "rollout_log_probs": [-0.5, -0.25, -1.5],
        "response_mask": [1, 1, 0],
        "policy_version": 3,
    }
    body.update(extra)
    return body


def post(gateway, path, body, **headers):
    """POST JSON; out-of-range floats are sent as the overflowing literal 1e999."""
    text = json.dumps(body).replace("Infinity", "1e999")
    headers = {"content-type": "application/json", **headers}
    return httpx.post(gateway.url + path, content=text, headers=headers, timeout=10)


def rows(gw, event_ids) -> list[dict]:
    found = wait_landed(gw.lake, event_ids).to_dicts()
    by_id = {r["event_id"]: r | {"payload": json.loads(r["payload"])} for r in found}
    return [by_id[e] for e in event_ids]


def trajectory_rows(gw, trajectory: str, count: int) -> list[dict]:
    def landed():
        frame = bronze(gw.lake)
        if frame.is_empty() or "trajectory_uid" not in frame.columns:
            return None
        got = frame.filter(pl.col("trajectory_uid") == trajectory).sort("step_index")
        return got if got.height >= count else None

    found = wait_until(landed, 20, interval=0.1, what=f"{count} steps of {trajectory}")
    return [r | {"payload": json.loads(r["payload"])} for r in found.to_dicts()]


def nests(parent: dict, child: dict) -> bool:
    sequence = list(parent["prompt_ids"]) + list(parent["response_ids"])
    return list(child["prompt_ids"])[: len(sequence)] == sequence


def chat_trajectory(
    gateway_url: str, key: str, trajectory: str | None = None, turns: int = 2
) -> str:
    """A scoped trajectory of `turns` chat calls through a gateway (the official `openai`
    client, the bundled model's name), completed with reward 1.0; its uid."""
    trajectory = trajectory or f"traj-{uuid.uuid4().hex[:10]}"
    base = f"{gateway_url}/t/{trajectory}/g/group-{trajectory[-4:]}/v1"
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    with openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30) as agent:
        for _ in range(turns):
            answer = agent.chat.completions.create(model="claw-sim-llm", messages=messages)
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": "And times 2?"},
            ]
    done = httpx.post(
        f"{gateway_url}/v1/trajectories/{trajectory}/complete",
        json={"reward": 1.0},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    done.raise_for_status()
    return trajectory

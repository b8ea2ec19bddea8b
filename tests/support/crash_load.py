"""Load for crash tests: random white-box writes with client-chosen event ids, retried until
acknowledged, the acknowledged ids collected."""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx


def make_request(rng: random.Random) -> tuple[str, dict, list[str]]:
    """A random write with client-chosen event ids: a step batch, feedback or an event."""
    choice = rng.random()
    if choice < 0.6:
        trajectory = f"traj-{uuid.uuid4().hex}"  # unique: a reused key is a conflict
        steps = []
        for index in range(rng.randint(1, 3)):
            n = rng.randint(1, 50)
            steps.append(
                {
                    "trajectory_uid": trajectory,
                    "step_index": index,
                    "prompt_ids": [rng.randrange(50_000) for _ in range(rng.randint(1, 400))],
                    "response_ids": [rng.randrange(50_000) for _ in range(n)],
                    "rollout_log_probs": [-rng.random() for _ in range(n)],
                    "event_id": uuid.uuid4().hex,
                }
            )
        return "/v1/steps", {"steps": steps}, [s["event_id"] for s in steps]
    event_id = uuid.uuid4().hex
    if choice < 0.8:
        body = {
            "target": {"trajectory_uid": "t"},
            "kind": "reward",
            "value": rng.random(),
            "source": "rule",
            "event_id": event_id,
        }
        return "/v1/feedback", body, [event_id]
    return "/v1/events", {"type": "tick", "event_id": event_id}, [event_id]


async def client(
    url: str,
    seed: int,
    acked: list[str],
    stop: asyncio.Event,
    headers: dict[str, str] | None = None,
) -> int:
    """Send writes until told to stop; retry each (same event ids) until acknowledged."""
    rng = random.Random(seed)
    retries = 0
    async with httpx.AsyncClient(timeout=5, headers=headers) as http:
        while not stop.is_set():
            path, body, ids = make_request(rng)
            while True:
                try:
                    response = await http.post(url + path, json=body)
                    if response.status_code == 200:
                        acked.extend(ids)
                        break
                    assert response.status_code == 503, response.text
                except httpx.TransportError:
                    pass
                retries += 1
                await asyncio.sleep(0.05)
    return retries

"""Benchmark: token-in against re-rendering, on multi-turn scoped agents with tool calls.

`claw sim-llm --drift` splits one token of a share of its replies (a model may sample ids
that re-encoding the text never gives back), with the bundled tokenizer and its ChatML
template. Agents run 5 turns each (tools offered; a tool result or a user follow-up after
every reply), with a ~1,000-token system prompt, half with `X-Claw-Token-In: off` and half
`on`, side by side through one gateway, in several rounds. A trajectory's first turn goes
upstream as a chat call either way (nothing to continue yet); later token-in turns go as
token-id completions.

From bronze (the ids the gateway recorded), per arm: the share of consecutive turns that nest
(turn t+1's prompt starts with turn t's prompt + response), the prefix-tree tokens of each
trajectory's steps (the project's own prefix-tree merge) against the optimum (the
trajectory's final sequence: every earlier turn a prefix of it), and the extra tokens. From
the gateway's Server-Timing (its own time, the upstream's excluded): p50 per arm and round;
the headline added latency is the median over rounds of on minus off.
Prints one JSON line; targets: on nests 100 % with tree tokens = optimum, added p50 <= 0.5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

import httpx
import numpy as np
import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.transforms.prefix_tree import build_forest_from_parts  # noqa: E402
from tests.support.servers import GatewayProcess, bronze, wait_until  # noqa: E402
from tests.support.upstreams import (  # noqa: E402
    CALCULATOR,
    SimProcess,
    proxy_env,
)

TARGET_ADDED_P50_MS = 0.5
TURNS = 5
KEY = "bench-token-in"
SYSTEM = (
    "You are a careful assistant for arithmetic. Use the calculator tool when a question "
    "needs it, read its result, and answer briefly. "
) * 40
QUESTIONS = ("What is 12 + 7?", "What is 3 * 14?", "Compute 120 / 8.", "What is 45 - 17?")


async def agent(
    http: httpx.AsyncClient, base: str, mode: str, number: int, timings: list[float]
) -> str:
    """One scoped agent's conversation; returns its trajectory uid."""
    trajectory = f"bench-{mode}-{uuid.uuid4().hex[:12]}"
    url = f"{base}/t/{trajectory}/g/{trajectory}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY}", "X-Claw-Token-In": mode}
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]},
    ]
    for _ in range(TURNS):
        body = {"model": "claw-sim-llm", "messages": messages, "tools": [CALCULATOR]}
        response = await http.post(url, json=body, headers=headers)
        response.raise_for_status()
        timings.append(gateway_ms(response.headers["server-timing"]))
        message = response.json()["choices"][0]["message"]
        messages.append({k: v for k, v in message.items() if v is not None})
        if message.get("tool_calls"):
            call_id = message["tool_calls"][0]["id"]
            messages.append({"role": "tool", "tool_call_id": call_id, "content": "19"})
        else:
            messages.append({"role": "user", "content": "Thanks. Check it once more?"})
    return trajectory


def gateway_ms(header: str) -> float:
    """The gateway's own time from a Server-Timing header."""
    metrics = dict(part.strip().split(";dur=") for part in header.split(","))
    return float(metrics["gateway"])


async def one_round(base: str, agents: int) -> dict[str, tuple[list[str], list[float]]]:
    """`agents` agents per arm, all at once, arms interleaved."""
    timings: dict[str, list[float]] = {"off": [], "on": []}
    limits = httpx.Limits(max_connections=4 * agents, max_keepalive_connections=4 * agents)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        jobs = [
            agent(http, base, mode, number, timings[mode])
            for number in range(agents)
            for mode in ("off", "on")
        ]
        uids = await asyncio.gather(*jobs)
    return {
        mode: ([u for u in uids if u.startswith(f"bench-{mode}-")], timings[mode])
        for mode in ("off", "on")
    }


def arm_figures(steps: pl.DataFrame) -> dict[str, float | int]:
    """Nesting, tree tokens and optimum of one arm's trajectories (bronze rows)."""
    steps = steps.sort("trajectory_uid", "step_index")
    full = [
        np.concatenate([np.asarray(p, np.int32), np.asarray(r, np.int32)])
        for p, r in zip(steps["prompt_ids"], steps["response_ids"], strict=True)
    ]
    uids = steps["trajectory_uid"].to_list()
    pairs = nested = 0
    for i in range(1, len(full)):
        if uids[i] != uids[i - 1]:
            continue
        pairs += 1
        prompt = np.asarray(steps["prompt_ids"][i], np.int32)
        nested += len(prompt) >= len(full[i - 1]) and bool(
            np.array_equal(prompt[: len(full[i - 1])], full[i - 1])
        )
    tree = steps["trajectory_uid"].cast(pl.Categorical).to_physical().to_numpy()
    forest = build_forest_from_parts(
        tree, [steps["prompt_ids"].to_arrow(), steps["response_ids"].to_arrow()]
    )
    last = steps.group_by("trajectory_uid").agg(pl.all().sort_by("step_index").last())
    optimum = int((last["prompt_ids"].list.len() + last["response_ids"].list.len()).sum())
    return {
        "trajectories": steps["trajectory_uid"].n_unique(),
        "steps": steps.height,
        "turn_pairs": pairs,
        "nest_rate": round(nested / pairs, 4) if pairs else 1.0,
        "raw_tokens": forest.raw_tokens,
        "tree_tokens": forest.tree_tokens,
        "optimum_tokens": optimum,
        "extra_tokens": forest.tree_tokens - optimum,
        "extra_share": round(forest.tree_tokens / optimum - 1, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=8, help="per arm and round")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--drift", type=float, default=0.5)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="claw-token-in-bench-"))
    try:
        with (
            SimProcess(workdir, latency_ms=args.latency_ms, drift=args.drift) as sim,
            GatewayProcess(workdir / "lake", **proxy_env(sim.url, KEY, "bench")) as gw,
        ):
            asyncio.run(one_round(gw.url, 2))  # warm-up: connections, template, tokenizer
            rounds = [asyncio.run(one_round(gw.url, args.agents)) for _ in range(args.rounds)]
            uids = {mode: [u for r in rounds for u in r[mode][0]] for mode in ("off", "on")}
            expected = TURNS * sum(len(u) for u in uids.values())
            wanted = [u for group in uids.values() for u in group]

            def landed() -> pl.DataFrame | None:
                rows = bronze(gw.lake)
                if rows.is_empty():
                    return None
                rows = rows.filter(pl.col("trajectory_uid").is_in(wanted))
                return rows if rows.height >= expected else None

            steps = wait_until(landed, 60, interval=0.2, what="every step in bronze")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    arms = {
        mode: arm_figures(steps.filter(pl.col("trajectory_uid").is_in(uids[mode])))
        for mode in ("off", "on")
    }
    p50 = {
        mode: [round(float(np.percentile(r[mode][1], 50)), 3) for r in rounds]
        for mode in ("off", "on")
    }
    added = [round(on - off, 3) for on, off in zip(p50["on"], p50["off"], strict=True)]
    headline = round(statistics.median(added), 3)
    on, off = arms["on"], arms["off"]
    emit(
        "token_in",
        target="token-in on: every turn nests, the tree tokens equal the optimum, added p50 "
        f"<= {TARGET_ADDED_P50_MS} ms over token-in off (median of the rounds)",
        targets={
            "on_nest_rate": 1.0,
            "on_tree_tokens_equal_optimum": True,
            "added_p50_ms": TARGET_ADDED_P50_MS,
        },
        target_met=on["nest_rate"] == 1.0
        and on["tree_tokens"] == on["optimum_tokens"]
        and headline <= TARGET_ADDED_P50_MS,
        baseline="token_in_off",
        ratio=None,
        turns=TURNS,
        agents_per_arm=args.agents * args.rounds,
        sim_drift=args.drift,
        token_in_off=off | {"drift_rate": round(1 - off["nest_rate"], 4)},
        token_in_on=on,
        gateway_p50_ms=p50,
        added_p50_ms_by_round=added,
        added_p50_ms=headline,
    )


if __name__ == "__main__":
    main()

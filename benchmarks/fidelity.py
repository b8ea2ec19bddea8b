"""Benchmark: token fidelity through the gateway in front of real and simulated servers.

Arms, each a server with the gateway in front of it (the gateway started as users start it):
- `transformers-serve`: `transformers serve` running a tiny random Qwen2 built here (Qwen2's
  own tokenizer class, whose pre-tokenizer differs from the folder's tokenizer.json); it
  returns no ids and no log-probs; `CLAW_TOKENIZER` is the model folder;
- `sim-drift-local`: `claw sim-llm --drift` refusing `return_token_ids` as OpenAI does
  (`CLAW_TOKENIZER=bundled`): ids computed by the gateway, while the sim splits one token of
  a share of its replies, so re-encoding their text does not give the sampled ids back;
- `sim-drift-ids`: the same sim returning its ids (vLLM's `return_token_ids`).

Conversations through the gateway: single-turn and 3-turn scoped ones, streamed and not, with
`n=2` on some, each call with a seed; the same calls sent straight to the server, interleaved,
for the latency arm. Per arm, from bronze: steps, the share with exact ids (token source
`upstream`, `client`, `local`), the share flagged (`local_unverified`), and the wrong
unflagged steps: ids that differ from the model's truth while labelled exact. The truth:
for the simulated model, the ids it sampled (a twin sim with ids answers the same seeded
calls); for `transformers serve`, AutoTokenizer's prompt ids and the server's own counts.
Phantom steps: steps beyond the choices the client received. Latency: the median over calls
of (through the gateway - direct), paired by call (same seed, same reply; which goes first
alternates), and the gateway's own time from its Server-Timing header beside it. The server
keeps to one core (`OMP_NUM_THREADS=1`), the gateway has the other, as on separate hardware.
Prints one JSON line; targets: 0 unflagged wrong, 0 phantom, 100 % exact or flagged,
gateway p50 added <= 5 ms.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from benchmarks.token_in import gateway_ms  # noqa: E402
from claw_pipelines.app.processes import TransformersServe  # noqa: E402
from claw_pipelines.contracts.tables import EXACT_TOKEN_SOURCES  # noqa: E402
from claw_pipelines.simulation.model_folders import tiny_model_folder  # noqa: E402
from claw_pipelines.tokenization import load_chat_tokenizer, server_messages  # noqa: E402
from tests.support.servers import GatewayProcess, bronze, wait_until  # noqa: E402
from tests.support.upstreams import SimProcess, proxy_env  # noqa: E402

TARGET_ADDED_P50_MS = 5.0
KEY = "bench-fidelity"
QUESTIONS = (
    "What is 12 + 7?",
    "Count 12345 then say 678.",
    "Name three colours, one per line.",
    "Héllo wörld: repeat it  twice.",
)


def _post(http: httpx.Client, url: str, body: dict, headers: dict) -> tuple[dict, float, dict]:
    """One call (streamed or not): the answer as the client saw it (choices' text, usage),
    its wall time in ms and the response headers."""
    started = time.perf_counter()
    if not body.get("stream"):
        response = http.post(url, json=body, headers=headers)
        response.raise_for_status()
        answer = response.json()
        texts = {c["index"]: c["message"]["content"] or "" for c in answer["choices"]}
        return {"texts": texts}, (time.perf_counter() - started) * 1000, dict(response.headers)
    texts: dict[int, str] = {}
    with http.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or ():
                delta = choice.get("delta") or {}
                texts[choice["index"]] = texts.get(choice["index"], "") + (
                    delta.get("content") or ""
                )
        headers_seen = dict(response.headers)
    return {"texts": texts}, (time.perf_counter() - started) * 1000, headers_seen


def conversations(
    http: httpx.Client, gateway: str, direct: str, model: str, count: int
) -> tuple[list[dict], list[float]]:
    """`count` conversations through the gateway, each call also sent straight to the server
    (interleaved); the calls (idempotency key, body, choices received) and the paired
    latency differences in ms."""
    calls, added = [], []
    for number in range(count):
        turns = 3 if number % 2 else 1
        stream = number % 4 in (2, 3)
        n = 2 if number % 3 == 0 else 1
        trajectory = f"fid-{uuid.uuid4().hex[:12]}"
        messages = [{"role": "user", "content": QUESTIONS[number % len(QUESTIONS)]}]
        for turn in range(turns):
            body = {"model": model, "messages": messages, "max_tokens": 24, "seed": number}
            body |= {"n": n, "stream": stream}
            key = f"{trajectory}-{turn}"
            headers = {"Authorization": f"Bearer {KEY}", "Idempotency-Key": key}
            url = f"{gateway}/t/{trajectory}/g/{trajectory}/v1/chat/completions"
            if len(calls) % 2:  # which goes first alternates: neither pays for a cold start
                _, direct_ms, _ = _post(http, direct + "/chat/completions", body, {})
                through, through_ms, seen = _post(http, url, body, headers)
            else:
                through, through_ms, seen = _post(http, url, body, headers)
                _, direct_ms, _ = _post(http, direct + "/chat/completions", body, {})
            added.append(through_ms - direct_ms)
            own = None if stream else gateway_ms(seen["server-timing"])  # streams have none
            calls.append(
                {"key": key, "body": body, "choices": len(through["texts"]), "own_ms": own}
            )
            reply = through["texts"].get(0, "")
            messages = [
                *messages,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": f"And after {turn}?"},
            ]
    return calls, added


def sim_truth(http: httpx.Client, twin: str, calls: list[dict]) -> dict[str, list[list[int]]]:
    """What the simulated model sampled for each call (a twin that returns ids, same seed):
    per key, prompt + response ids per choice."""
    truth = {}
    for call in calls:
        body = call["body"] | {"stream": False, "return_token_ids": True}
        answer = http.post(twin + "/chat/completions", json=body).raise_for_status().json()
        truth[call["key"]] = [
            answer["prompt_token_ids"] + c["token_ids"]
            for c in sorted(answer["choices"], key=lambda c: c["index"])
        ]
    return truth


def figures(rows: pl.DataFrame, calls: list[dict], wrong: list[bool], added: list[float]) -> dict:
    """Shares, wrong unflagged and phantom steps, latency, from an arm's bronze rows."""
    sources = rows["token_source"].to_list()
    exact = [s in EXACT_TOKEN_SOURCES for s in sources]
    flagged = [s == "local_unverified" for s in sources]
    received = sum(c["choices"] for c in calls)
    steps = rows.height
    return {
        "calls": len(calls),
        "steps": steps,
        "by_token_source": dict(sorted(pl.Series(sources).value_counts().rows())),
        "exact_share": round(sum(exact) / steps, 4),
        "flagged_share": round(sum(flagged) / steps, 4),
        "exact_or_flagged_share": round(
            sum(e or f for e, f in zip(exact, flagged, strict=True)) / steps, 4
        ),
        "wrong_steps": sum(wrong),
        "unflagged_wrong_steps": sum(w and e for w, e in zip(wrong, exact, strict=True)),
        "phantom_steps": max(0, steps - received),
        "missing_steps": max(0, received - steps),
        "added_p50_ms": round(statistics.median(added), 3),
        "gateway_own_p50_ms": round(
            statistics.median(c["own_ms"] for c in calls if c["own_ms"] is not None), 3
        ),
    }


def landed(gateway: GatewayProcess, calls: list[dict]) -> pl.DataFrame:
    """The steps of the calls in bronze (event ids `key`, or `key:<i>` for several choices),
    once as many as the choices received have landed (and a moment for any beyond)."""
    keys = [c["key"] for c in calls]
    received = sum(c["choices"] for c in calls)
    call_key = pl.col("event_id").str.replace(r":\d+$", "")

    def mine() -> pl.DataFrame | None:
        frame = bronze(gateway.lake)
        if frame.is_empty():
            return None
        steps = frame.filter(call_key.is_in(keys) & (pl.col("kind") == "chat_completion"))
        return steps if steps.height >= received else None

    wait_until(mine, 60, interval=0.2, what="every step in bronze")
    time.sleep(1.0)  # a phantom step would land with the others: give it the time to
    return mine().sort("event_id")


def key_of(event_id: str) -> tuple[str, int]:
    """The call key and choice position of a step's event id (`key`, or `key:<i>`)."""
    head, colon, tail = event_id.rpartition(":")
    return (head, int(tail)) if colon and tail.isdigit() else (event_id, 0)


def sim_arm(workdir: Path, args: argparse.Namespace, token_ids: bool) -> dict:
    """The simulated model (drifting) in front of the gateway, with or without its ids."""
    with (
        SimProcess(workdir, drift=args.drift, token_ids=token_ids) as sim,
        SimProcess(workdir, drift=args.drift) as twin,
    ):
        env = proxy_env(sim.url, KEY, "bench", CLAW_TOKENIZER="bundled")
        with (
            GatewayProcess(workdir / f"lake-sim-{token_ids}", **env) as gateway,
            httpx.Client(timeout=120) as http,
        ):
            _post(http, gateway.url + "/v1/chat/completions", warm_up(), auth())
            calls, added = conversations(http, gateway.url, sim.url, "claw-sim-llm", args.calls)
            rows = landed(gateway, calls)
            truth = sim_truth(http, twin.url, calls)
    wrong = []
    for event_id, prompt, response in rows.select(
        "event_id", "prompt_ids", "response_ids"
    ).iter_rows():
        key, choice = key_of(event_id)
        wrong.append(prompt + response != truth[key][choice])
    return figures(rows, calls, wrong, added)


def serve_arm(workdir: Path, args: argparse.Namespace) -> dict:
    """`transformers serve` with a tiny random Qwen2, the model folder as CLAW_TOKENIZER."""
    model = tiny_model_folder(workdir / "tiny-qwen2")
    chat = load_chat_tokenizer(str(model))
    with TransformersServe(model, workdir) as server:
        env = proxy_env(server.base_url, KEY, "bench", CLAW_TOKENIZER=str(model))
        with (
            GatewayProcess(workdir / "lake-serve", **env) as gateway,
            httpx.Client(timeout=120) as http,
        ):
            _post(http, gateway.url + "/v1/chat/completions", warm_up(str(model)), auth())
            calls, added = conversations(http, gateway.url, server.base_url, str(model), args.calls)
            rows = landed(gateway, calls)
    wrong = []
    for payload, prompt, response in rows.select(
        "payload", "prompt_ids", "response_ids"
    ).iter_rows():
        record = json.loads(payload)
        truth = chat.hf.apply_chat_template(
            server_messages(record["request"]["messages"]),
            add_generation_prompt=True,
            return_dict=False,
        )
        check = record["metadata"]["token_check"]
        counts = (check["prompt_tokens"][1], check["completion_tokens"][1])
        wrong.append(
            prompt != list(truth)
            or len(prompt) != counts[0]
            # the server counts every choice's reply together: one choice per call here
            or len(response) != counts[1]
        )
    return figures(rows, calls, wrong, added)


def warm_up(model: str = "claw-sim-llm") -> dict:
    """A first call: connections, template and tokenizer warm."""
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def auth() -> dict:
    """The benchmark's key."""
    return {"Authorization": f"Bearer {KEY}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=24, help="conversations per arm")
    parser.add_argument("--drift", type=float, default=0.3)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="claw-fidelity-bench-"))
    try:
        arms = {
            "transformers-serve": serve_arm(workdir, args),
            "sim-drift-local": sim_arm(workdir, args, token_ids=False),
            "sim-drift-ids": sim_arm(workdir, args, token_ids=True),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    unflagged = sum(a["unflagged_wrong_steps"] for a in arms.values())
    phantom = sum(a["phantom_steps"] for a in arms.values())
    covered = min(a["exact_or_flagged_share"] for a in arms.values())
    added = max(a["added_p50_ms"] for a in arms.values())
    emit(
        "fidelity",
        target="0 unflagged wrong steps, 0 phantom steps, every step exact or flagged, added "
        f"p50 <= {TARGET_ADDED_P50_MS} ms in every arm",
        targets={
            "unflagged_wrong_steps": 0,
            "phantom_steps": 0,
            "exact_or_flagged_share": 1.0,
            "added_p50_ms": TARGET_ADDED_P50_MS,
        },
        target_met=unflagged == 0
        and phantom == 0
        and covered == 1.0
        and added <= TARGET_ADDED_P50_MS,
        baseline=None,
        ratio=None,
        arms=arms,
        unflagged_wrong_steps=unflagged,
        phantom_steps=phantom,
        exact_or_flagged_share=covered,
        added_p50_ms=added,
    )


if __name__ == "__main__":
    main()

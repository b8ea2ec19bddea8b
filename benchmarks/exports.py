"""Benchmark: SFT exports in the model's own language, exact and as fast as before.

Round trip: for tokenizer folders of several template families built here (ChatML with
Qwen2's own tokenizer class, Llama 3, Mistral, named templates), chat logs whose ids the
folder's tokenizer made (two-turn conversations, a system prompt where the template keeps
it apart) are imported with `--tokenizer`, materialized and exported as `sft-messages`; the
share of exported conversations equal to the originals, message for message.

Throughput: one gold partition of ChatML steps (the bundled tokenizer, the demo's model),
exported as `sft-messages` by today's path (the step's tokenizer resolved from the lake,
each prompt read back with its template and checked) and by the decoder before it (the
bundled tokenizer's ChatML turns cut by a regex, unchecked), in the same run, alternating;
median of the runs. Prints one JSON line; targets: round trip 100 %, throughput >= 0.8 x.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.app.cli import main as claw  # noqa: E402
from claw_pipelines.consume.dataset import open_dataset  # noqa: E402
from claw_pipelines.contracts.specs import CurationSpec  # noqa: E402
from claw_pipelines.interop.export import CHUNK_ROWS, export, sft_record  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.lake.specs import save_spec  # noqa: E402
from claw_pipelines.materialize.gold import build_partition  # noqa: E402
from claw_pipelines.materialize.silver import build_silver  # noqa: E402
from claw_pipelines.simulation.model_folders import tokenizer_folder  # noqa: E402
from claw_pipelines.tokenization import IM_END, decode_lists, load_chat_tokenizer  # noqa: E402

TARGET_SHARE = 1.0
TARGET_THROUGHPUT_RATIO = 0.8
EVERYTHING = CurationSpec(name="everything", reward_status=["final", "missing", "pending"])
WORDS = [
    "the",
    "model",
    "answers",
    "a",
    "question",
    "about",
    "numbers",
    "and",
    "tools",
    "with",
    "care",
    "then",
    "checks",
]
FAMILIES = {"chatml": "qwen2", "llama3": None, "mistral": None, "chatml-named": None}
TURN = r"<\|im_start\|>(?s:.*?)<\|im_end\|>"


def sentence(rng: random.Random, words: int) -> str:
    """A made-up sentence."""
    return " ".join(rng.choices(WORDS, k=words)).capitalize() + "."


def chat_log(chat, path: Path, conversations: int, system: bool, seed: int) -> list[list[dict]]:
    """A chat log of two-turn conversations in `chat`'s ids; the conversations as sent (each
    step's prompt messages and its reply)."""
    rng = random.Random(seed)
    eos = chat.encode(chat.eos_token)
    lines, expected = [], []
    for number in range(conversations):
        messages = [{"role": "system", "content": "Be brief."}] if system else []
        messages.append({"role": "user", "content": sentence(rng, 12)})
        for turn in range(2):
            reply = sentence(rng, 8)
            choice = {"index": 0, "token_ids": chat.encode(reply) + eos, "finish_reason": "stop"}
            response = {"prompt_token_ids": chat.prompt_ids(messages), "choices": [choice]}
            record = {"trajectory_uid": f"c{number}", "step_index": turn, "response": response}
            lines.append(record | {"policy_version": 1, "is_last": turn == 1})
            expected.append([*messages, {"role": "assistant", "content": reply}])
            messages = [*messages, expected[-1][-1], {"role": "user", "content": sentence(rng, 6)}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return expected


def materialized(lake: Lake) -> None:
    """Silver, and the one dataset of everything, policy version 1."""
    build_silver(lake)
    save_spec(lake, EVERYTHING)
    build_partition(lake, EVERYTHING, 1)


def round_trip(workdir: Path, family: str, conversations: int) -> dict:
    """One family: import with its tokenizer, export, compare with what was sent."""
    model_type = FAMILIES[family]
    folder = tokenizer_folder(workdir / family, family, "v5", model_type=model_type)
    chat = load_chat_tokenizer(str(folder))
    log = workdir / f"{family}.jsonl"
    # Mistral's template folds a system prompt into the last user turn: none for it here
    expected = chat_log(chat, log, conversations, system=family != "mistral", seed=1)
    lake = Lake(str(workdir / f"lake-{family}"))
    command = ["import", str(log), "--lake", lake.uri, "--create", "--tokenizer", str(folder)]
    assert claw(command) == 0
    materialized(lake)
    out = workdir / f"{family}-sft.jsonl"
    started = time.perf_counter()
    written = export(open_dataset("everything", lake.uri), 1, "sft-messages", out)
    seconds = time.perf_counter() - started
    records = {r["step_key"]: r for r in map(json.loads, out.read_text().splitlines())}
    equal = sum(
        records.get(f"c{i // 2}:{i % 2}", {}).get("messages") == messages
        for i, messages in enumerate(expected)
    )
    return {
        "steps": written,
        "equal": equal,
        "share": round(equal / len(expected), 4),
        "steps_per_s": round(written / seconds),
    }


def before(steps: pl.DataFrame) -> pl.DataFrame:
    """The SFT frame as the export made it before: the bundled tokenizer's ChatML turns cut
    by a regex (unchecked)."""
    texts = decode_lists(steps["prompt_ids"].to_arrow())
    turn = pl.element().str.strip_suffix(IM_END)
    prompts = (
        pl.DataFrame({"text": texts})
        .select(
            pl.col("text")
            .str.extract_all(TURN)
            .list.eval(
                pl.struct(
                    role=turn.str.extract(r"^<\|im_start\|>([^\n]*)\n"),
                    content=turn.str.extract(r"^<\|im_start\|>[^\n]*\n((?s:.*))$"),
                )
            )
        )
        .to_series()
    )
    replies = decode_lists(steps["response_ids"].to_arrow()).str.strip_suffix(IM_END)
    reply = pl.concat_list(pl.struct(role=pl.lit("assistant"), content=pl.lit(replies)))
    framed = steps.with_columns(prompt_messages=prompts)
    return framed.select(sft_record(pl.concat_list("prompt_messages", reply)))


def write_before(dataset, out: Path) -> int:
    """The export before, whole: read the partition, decode, write JSON lines."""
    frame = before(dataset.steps(1))
    with out.open("w", encoding="utf-8") as handle:
        for chunk in frame.iter_slices(CHUNK_ROWS):
            for row in chunk.iter_rows(named=True):
                handle.write(json.dumps(row) + "\n")
    return frame.height


def throughput(workdir: Path, conversations: int, runs: int) -> dict:
    """Steps per second of the export now and before, on one ChatML partition."""
    chat = load_chat_tokenizer()
    log = workdir / "bundled.jsonl"
    chat_log(chat, log, conversations, system=True, seed=2)
    lake = Lake(str(workdir / "lake-bundled"))
    assert claw(["import", str(log), "--lake", lake.uri, "--create", "--tokenizer", "bundled"]) == 0
    materialized(lake)
    dataset = open_dataset("everything", lake.uri)
    now, then = [], []
    for _ in range(runs):
        started = time.perf_counter()
        steps = export(dataset, 1, "sft-messages", workdir / "now.jsonl")
        now.append(steps / (time.perf_counter() - started))
        started = time.perf_counter()
        steps = write_before(dataset, workdir / "before.jsonl")
        then.append(steps / (time.perf_counter() - started))
    return {
        "steps": steps,
        "steps_per_s": round(statistics.median(now)),
        "before_steps_per_s": round(statistics.median(then)),
        "ratio": round(statistics.median(now) / statistics.median(then), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conversations", type=int, default=200, help="per family")
    parser.add_argument("--partition-conversations", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="claw-exports-bench-"))
    try:
        families = {f: round_trip(workdir, f, args.conversations) for f in FAMILIES}
        speed = throughput(workdir, args.partition_conversations, args.runs)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    share = min(f["share"] for f in families.values())
    emit(
        "exports",
        target=f"every family's round trip share >= {TARGET_SHARE}; export throughput >= "
        f"{TARGET_THROUGHPUT_RATIO} x the export before",
        targets={"round_trip_share": TARGET_SHARE, "throughput_ratio": TARGET_THROUGHPUT_RATIO},
        target_met=share >= TARGET_SHARE and speed["ratio"] >= TARGET_THROUGHPUT_RATIO,
        baseline={"before_steps_per_s": speed["before_steps_per_s"]},
        ratio=speed["ratio"],
        round_trip=families,
        round_trip_share=share,
        throughput=speed,
    )


if __name__ == "__main__":
    main()

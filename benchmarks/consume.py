"""Benchmark: trainer consumption.

In one run:
  (a) tokens/s of producing tree batches from a gold partition vs reading the same
      partition's token columns with polars (the ceiling). Target >= 0.5x. The partition
      holds partial rollouts (a quarter of the trajectories' first turns were aborted under
      policy 0 and resumed under policy 1), and batches are produced both with per-token
      policy versions (`token_policy_versions`, the default) and without
      (`Dataset.token_versions = False`). Target: with >= 0.9 x the tokens/s of without.
  (b) forward + backward time of a small transformer on tree batches vs flat batches of the
      same steps (tree: each token attends to its ancestors through the block-sparse tree
      attention; flat: each step alone, causal; both torch's fused CPU attention kernel).
      Target: tree/flat time <= 1.25 x token_ratio.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.consume.dataset import open_dataset  # noqa: E402
from claw_pipelines.contracts.specs import CurationSpec  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.lake.prompts import read_steps  # noqa: E402
from claw_pipelines.materialize.gold import build_partition  # noqa: E402
from claw_pipelines.materialize.silver import build_silver  # noqa: E402
from tests.support.lakes import completion, land, partial_rollout, step  # noqa: E402

PRODUCTION_TARGET = 0.5
TOKEN_VERSIONS_TARGET = 0.9
COMPUTE_SLACK = 1.25


def grpo_lake(
    root: Path,
    groups: int,
    rollouts: int,
    turns: int,
    scale: int,
    vocab: int,
    prompt_tokens: int | None = None,
) -> Lake:
    """Multi-turn GRPO groups landed in bronze, built into silver and one gold partition:
    a shared prompt (`prompt_tokens`, default 5 × scale), `scale` response tokens a turn and
    scale/2 observation tokens between turns."""
    rng = np.random.default_rng(11)
    lake = Lake(str(root))
    rows: list[dict] = []
    for g in range(groups):
        prompt = rng.integers(1, vocab, prompt_tokens or 5 * scale).tolist()
        for r in range(rollouts):
            trajectory, history = f"g{g}-r{r}", prompt
            for turn in range(turns):
                response = rng.integers(1, vocab, scale).tolist()
                if turn == 0 and r % 4 == 0:  # aborted by a policy bump, resumed after it
                    cut = scale // 3
                    parts = [response[:cut], response[cut:]]
                    rows += partial_rollout(trajectory, history, parts, [0, 1], group=f"g{g}")
                else:
                    index = turn + (1 if r % 4 == 0 else 0)
                    rows.append(step(trajectory, index, history, response, group=f"g{g}"))
                history = [*history, *response, *rng.integers(1, vocab, scale // 2).tolist()]
            rows.append(completion(trajectory, float(rng.random())))
        if len(rows) > 2000:
            land(lake, rows)
            rows = []
    if rows:
        land(lake, rows)
    build_silver(lake)
    spec = CurationSpec(
        name="bench", reward_status=["final", "missing"], merge="prompt_group", advantage="grpo"
    )
    build_partition(lake, spec, 1)
    return lake


def production(lake: Lake, rounds: int) -> dict:
    """(a): tree batches (with and without per-token policy versions) vs reading the token
    columns, raw tokens per second."""
    ds = open_dataset("bench", lake.uri)
    bare = open_dataset("bench", lake.uri)
    bare.token_versions = False
    steps = ds.steps(1)
    raw = int(steps.select(pl.col("prompt_len").sum() + pl.col("response_len").sum()).item())
    reads, builds, bares = [], [], []
    for _ in range(rounds):  # the arms alternate, so noise hits them alike
        started = time.perf_counter()
        read_steps(  # whole prompts: gold keeps them relative (docs/DESIGN.md §18)
            lake,
            "gold/datasets/bench",
            columns=["prompt_ids", "response_ids"],
            where=pl.col("policy_version") == 1,
        )
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        batches = list(ds.batches(1, batch_size=64, layout="tree"))
        builds.append(time.perf_counter() - started)
        started = time.perf_counter()
        without = list(bare.batches(1, batch_size=64, layout="tree"))
        bares.append(time.perf_counter() - started)
    tree_tokens = sum(b.num_tokens for b in batches)
    assert all(b.token_policy_versions.size == b.num_tokens for b in batches)
    assert all(b.token_policy_versions.size == 0 for b in without)
    read, build, bare_s = min(reads), min(builds), min(bares)
    return {
        "raw_tokens": raw,
        "tree_tokens": tree_tokens,
        "joined_steps": int(steps["policy_version_runs"].is_not_null().sum()),
        "read_tokens_per_s": round(raw / read),
        "batch_tokens_per_s": round(raw / build),
        "batch_tokens_per_s_without_token_versions": round(raw / bare_s),
        "production_vs_read": round(read / build, 3),
        "token_versions_vs_without": round(bare_s / build, 3),
    }


def compute(lake: Lake, rounds: int, vocab: int) -> dict:
    """(b): forward + backward on tree batches vs flat batches of the same steps, both through
    torch's fused attention kernel (tree: the block-sparse tree attention; flat: causal SDPA)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    from claw_pipelines.train.block_attention import tree_attention, tree_plan
    from tests.support.tiny_transformer import TinyLM

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = TinyLM(vocab, width=256, heads=4, layers=2, positions=8192)
    ds = open_dataset("bench", lake.uri)
    trees = [b.to_torch() for b in ds.batches(1, batch_size=1, layout="tree")]  # one group each
    flats = list(ds.batches(1, batch_size=1, layout="flat"))
    flat_inputs = [
        (b.to_torch()["input_ids"][i], torch.arange(len(i)))
        for b in flats
        for i in b.to_torch()["step_token_index"]
    ]

    def causal(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True)

    def run_trees() -> None:
        for t in trees:  # the plan is built inside: its cost is the tree arm's
            plan = tree_plan(t["subtree_end"])
            model.zero_grad()
            logits = model.forward_with(
                t["input_ids"], t["position_ids"], partial(tree_attention, plan=plan)
            )
            logits.logsumexp(-1).sum().backward()

    def run_flat() -> None:
        for ids, positions in flat_inputs:
            model.zero_grad()
            model.forward_with(ids, positions, causal).logsumexp(-1).sum().backward()

    tree_times, flat_times = [], []
    for _ in range(rounds):  # alternate, so noise hits both alike
        started = time.perf_counter()
        run_trees()
        tree_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        run_flat()
        flat_times.append(time.perf_counter() - started)
    tree_tokens = sum(t["input_ids"].numel() for t in trees)
    flat_tokens = sum(ids.numel() for ids, _ in flat_inputs)
    return {
        "tree_s": round(min(tree_times), 3),
        "flat_s": round(min(flat_times), 3),
        "compute_ratio": round(min(tree_times) / min(flat_times), 3),
        "token_ratio": round(tree_tokens / flat_tokens, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=100)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--scale", type=int, default=300, help="response tokens per turn")
    parser.add_argument("--compute-groups", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the compute arms")
    parser.add_argument(
        "--production-rounds",
        type=int,
        default=25,
        help="rounds of the production arms (~0.1 s each: the fastest of many is the figure)",
    )
    args = parser.parse_args()
    vocab = 4096
    with tempfile.TemporaryDirectory(prefix="claw-bench-consume-") as tmp:
        big = grpo_lake(
            Path(tmp) / "big", args.groups, args.rollouts, args.turns, args.scale, vocab
        )
        produced = production(big, args.production_rounds)
        small = grpo_lake(Path(tmp) / "small", args.compute_groups, 4, 3, 40, vocab)
        computed = compute(small, args.rounds, vocab)
    compute_target = COMPUTE_SLACK * computed["token_ratio"]
    emit(
        "consume",
        target=f"tree batches produced at >= {PRODUCTION_TARGET} x the tokens/s of reading the "
        f"partition's token columns, and with per-token policy versions at >= "
        f"{TOKEN_VERSIONS_TARGET} x without; tree/flat forward + backward time <= "
        f"{COMPUTE_SLACK} x the token ratio",
        targets={
            "production_vs_read": PRODUCTION_TARGET,
            "token_versions_vs_without": TOKEN_VERSIONS_TARGET,
            "compute_ratio": round(compute_target, 3),
        },
        target_met=produced["production_vs_read"] >= PRODUCTION_TARGET
        and produced["token_versions_vs_without"] >= TOKEN_VERSIONS_TARGET
        and computed["compute_ratio"] <= compute_target,
        baseline={
            "read_tokens_per_s": produced["read_tokens_per_s"],
            "batch_tokens_per_s_without_token_versions": produced[
                "batch_tokens_per_s_without_token_versions"
            ],
            "flat_s": computed["flat_s"],
        },
        ratio={
            "production_vs_read": produced["production_vs_read"],
            "token_versions_vs_without": produced["token_versions_vs_without"],
            "compute_ratio": computed["compute_ratio"],
        },
        production=produced,
        compute=computed,
    )


if __name__ == "__main__":
    main()

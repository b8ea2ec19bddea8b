"""Benchmark: prefix-tree merge of multi-turn GRPO groups against a one-pass numpy floor.

Generates >= 100 M raw tokens: prompt groups of G rollouts sharing one prompt, each a
multi-turn trajectory whose turn t+1 repeats turn t and adds a response and a tool/user
message. Merges them per prompt group (as `merge: prompt_group` does) and prints one JSON
line: raw tokens, tree tokens, token_ratio, whether the trees are optimal (every stored token
a distinct trie node, so tree tokens = U), build throughput, and the floor: a numpy pass that
reads every token once. Target: optimal, and build time <= 10x the floor.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.transforms.prefix_tree import build_forest  # noqa: E402
from claw_pipelines.transforms.quality import trees_are_minimal  # noqa: E402

TARGET_RATIO = 10.0
VOCAB = 150_000


def workload(raw_tokens: int, rollouts: int, turns: int, seed: int) -> tuple[np.ndarray, pa.Array]:
    """(tree id per sequence, sequences) until `raw_tokens` are generated."""
    rng = np.random.default_rng(seed)
    sequences, trees, total, group = [], [], 0, 0
    while total < raw_tokens:
        prompt = rng.integers(0, VOCAB, int(rng.integers(500, 2000)), dtype=np.int32)
        for _ in range(rollouts):
            history = prompt
            for _ in range(turns):
                response = rng.integers(0, VOCAB, int(rng.integers(50, 400)), dtype=np.int32)
                sequence = np.concatenate([history, response])
                sequences.append(sequence)
                trees.append(group)
                total += len(sequence)
                message = rng.integers(0, VOCAB, int(rng.integers(20, 300)), dtype=np.int32)
                history = np.concatenate([sequence, message])
        group += 1
    lengths = np.array([len(s) for s in sequences])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    lists = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(sequences)))
    return np.array(trees, dtype=np.int64), lists.cast(pa.list_(pa.int32()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--raw-tokens", type=int, default=110_000_000)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()

    trees, sequences = workload(args.raw_tokens, args.rollouts, args.turns, args.seed)
    values = np.asarray(sequences.values)
    builds, floors = [], []
    for _ in range(args.rounds):  # alternate, so noise hits both alike
        started = time.perf_counter()
        values.sum(dtype=np.int64)
        floors.append(time.perf_counter() - started)
        started = time.perf_counter()
        forest = build_forest(trees, sequences)
        builds.append(time.perf_counter() - started)
    build, floor = min(builds), min(floors)
    optimal = trees_are_minimal(forest)
    ratio = build / floor
    emit(
        "prefix_tree",
        target=f"the forest built in <= {TARGET_RATIO} x the floor (one pass summing the token "
        "ids), every tree minimal",
        targets={"build_vs_floor": TARGET_RATIO, "optimal": True},
        target_met=optimal.passed and ratio <= TARGET_RATIO,
        baseline="floor_s",
        ratio=round(ratio, 2),
        sequences=len(trees),
        trees=len(np.unique(trees)),
        raw_tokens=forest.raw_tokens,
        tree_tokens=forest.tree_tokens,
        saved_tokens=forest.raw_tokens - forest.tree_tokens,
        token_ratio=round(forest.tree_tokens / forest.raw_tokens, 5),
        optimal=optimal.passed,
        build_s=round(build, 3),
        build_raw_tokens_per_s=round(forest.raw_tokens / build),
        floor_s=round(floor, 4),
        floor_raw_tokens_per_s=round(forest.raw_tokens / floor),
        build_vs_floor=round(ratio, 2),
        rounds={
            "build_s": [round(b, 3) for b in builds],
            "floor_s": [round(f, 4) for f in floors],
        },
    )


if __name__ == "__main__":
    main()

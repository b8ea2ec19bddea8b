"""Benchmark: each DDP rank packs only its share of a partition's batches.

In one run, on one gold partition of multi-turn GRPO groups (benchmarks/consume.py's lake):
  baseline: what every rank paid before batch plans: `Dataset.batches` packs the whole
            partition, then the rank turns its 1/w of the batches into tensors;
  per rank: `BatchDataset(..., rank=r, world_size=w)` plans (no tokens read), packs its
            share only and turns it into tensors; the slowest rank is timed.
Target: slowest rank / baseline <= 2 / w (w = 4: half the baseline, the ideal being 1/w
plus reading the partition's token columns, which every rank still does).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.consume import grpo_lake  # noqa: E402
from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.consume.dataset import open_dataset  # noqa: E402
from claw_pipelines.train.adapters import BatchDataset  # noqa: E402


def baseline(ds, world: int, rank: int, batch_size: int) -> float:
    """The old way for one rank: pack every batch, keep the rank's, make its tensors."""
    started = time.perf_counter()
    batches = list(ds.batches(1, batch_size, layout="tree"))
    per_rank = -(-len(batches) // world)
    for turn in range(per_rank):
        batches[(rank + turn * world) % len(batches)].to_torch()
    return time.perf_counter() - started


def share(ds, world: int, rank: int, batch_size: int) -> tuple[float, int]:
    """The plan's way for one rank: seconds, and the steps it packed."""
    started = time.perf_counter()
    source = BatchDataset(ds, 1, batch_size=batch_size, rank=rank, world_size=world)
    for _ in source:
        pass
    return time.perf_counter() - started, source.plan.packed_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--groups", type=int, default=256)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--scale", type=int, default=300, help="response tokens per turn")
    parser.add_argument("--batch-size", type=int, default=32, help="steps per batch")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="claw-bench-ranks-") as tmp:
        lake = grpo_lake(Path(tmp), args.groups, args.rollouts, args.turns, args.scale, 4096)
        ds = open_dataset("bench", lake.uri)
        steps = ds.steps(1).height
        batches = len(ds.batch_plan(1, args.batch_size))
        old, new, packed = [], [], []
        for _ in range(args.rounds):  # alternate, so noise hits both alike
            old.append(baseline(ds, args.world, 0, args.batch_size))  # every rank alike
            timed = [share(ds, args.world, r, args.batch_size) for r in range(args.world)]
            new.append(max(t for t, _ in timed))
            packed = [n for _, n in timed]
    ratio = min(new) / min(old)
    target = 2 / args.world
    emit(
        "ranks",
        target=f"the slowest of {args.world} ranks <= 2/world x the time of packing the whole "
        "partition (every rank alike, the baseline); no rank packs every step",
        targets={"rank_vs_baseline": round(target, 3)},
        target_met=ratio <= target and max(packed) < steps,
        baseline="baseline_s",
        ratio=round(ratio, 3),
        steps=steps,
        batches=batches,
        world_size=args.world,
        baseline_s=round(min(old), 3),
        slowest_rank_s=round(min(new), 3),
        packed_steps_per_rank=packed,
        rank_vs_baseline=round(ratio, 3),
    )


if __name__ == "__main__":
    main()

"""Benchmark: the learning loop of `claw demo --learn`, end to end on this machine.

A tiny random Qwen2 served by `transformers serve` (one checkpoint folder per policy
version), word-task agents through a real `claw gateway`, the live materializer, and a GRPO
trainer pulling with `Dataset.next_batch` through the tree attention
(`claw_pipelines.app.learn`). Reports reward by policy version (read back from silver), the
wall time until the mean reward of the latest groups reached the target, the share of wall time the
trainer waited for data, the staleness of the tokens it trained on, the behaviour/trainer
mismatch (when the server returns log-probs; `transformers serve` returns none), and the
reply tokens generated and never trained on. The waiting is split: `trainer_wait_share_lake`
is its part after a group of the awaited batch was scored (gateway, bronze, silver, gold,
delivery); the rest is generation.

The loop trains on to 40 published versions (a whole run: the first group's generation and
its first trip through the lake, a second, are then not most of the wall time), reporting
when the target was first reached and the waiting until then too (`--stop-at-target` stops
there, as the demo does).

Targets: mean reward >= 0.8 within 40 published versions; the trainer waiting <= 20 % of
the loop's wall time; batch production with per-token policy versions >= 0.9 x without
(`benchmarks/consume.py` run both ways in this run, `per_token_versions`). Prints one JSON
line (progress and the loop's summary on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit  # noqa: E402
from claw_pipelines.app.learn import LearnOptions, LearnSummary, run_learn  # noqa: E402
from claw_pipelines.settings import ClawSettings  # noqa: E402

TARGET_REWARD = 0.8
TARGET_VERSIONS = 40
TARGET_WAIT_SHARE = 0.20
TARGET_TOKEN_VERSIONS = 0.9  # batch production with per-token versions vs without
TARGET = (
    f"mean reward >= {TARGET_REWARD} within {TARGET_VERSIONS} published versions; the "
    f"trainer waiting for data <= {TARGET_WAIT_SHARE:.0%} of the loop's wall time; batch "
    f"production with per-token policy versions >= {TARGET_TOKEN_VERSIONS} x without"
)


def per_token_versions_arm() -> dict:
    """Batch production with per-token policy versions vs without, in this run:
    `benchmarks/consume.py` (which builds tree batches both ways on one lake) in a child
    process, its figures read from its JSON line."""
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "consume.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    line = json.loads(done.stdout.strip().splitlines()[-1])
    ratio = line["ratio"]["token_versions_vs_without"]
    return {
        "token_versions_vs_without": ratio,
        "target": TARGET_TOKEN_VERSIONS,
        "met": ratio >= TARGET_TOKEN_VERSIONS,
        "batch_tokens_per_s": line["production"]["batch_tokens_per_s"],
        "batch_tokens_per_s_without_token_versions": line["production"][
            "batch_tokens_per_s_without_token_versions"
        ],
    }


def figures(summary: LearnSummary) -> dict:
    """The JSON line's figures of one run."""
    by_version = {
        int(row["policy_version"]): {
            "mean_reward": None if row["mean_reward"] is None else round(row["mean_reward"], 4),
            "rewarded_steps": int(row["rewarded"]),
        }
        for row in summary.reward_by_version.iter_rows(named=True)
    }
    stale = summary.staleness_tokens()
    trained = sum(stale.values())
    reached_version, reached_s = summary.reached if summary.reached else (None, None)
    return {
        "reward_by_version": by_version,
        "reached_version": reached_version,
        "seconds_to_target": None if reached_s is None else round(reached_s, 1),
        "versions_published": summary.versions_published,
        "wall_s": round(summary.wall_s, 1),
        "trainer_steps": len(summary.trained),
        "trainer_wait_share": round(summary.wait_share, 4),
        "trainer_wait_share_until_target": None
        if summary.wait_share_until_target is None
        else round(summary.wait_share_until_target, 4),
        "stopped_at_target": summary.options.stop_at_target,
        "trainer_wait_share_after_first_batch": round(summary.steady_wait_share, 4),
        "trainer_wait_share_lake": round(summary.lake_wait_share, 4),
        "first_batch_s": round(summary.first_batch_wait_s, 2),
        "trainer_step_s_mean": round(
            sum(t.step_s for t in summary.trained) / max(1, len(summary.trained)), 4
        ),
        "staleness_of_trained_tokens": {str(k): round(v / trained, 4) for k, v in stale.items()},
        "mismatch": summary.mismatch(),
        "tokens_discarded": summary.discarded_tokens,
        "served_by_own_checkpoint": list(summary.served_by_own_checkpoint),
        "token_sources": summary.token_sources,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--versions", type=int, default=TARGET_VERSIONS)
    parser.add_argument("--workdir", help="keep the lake, checkpoints and logs here")
    parser.add_argument("--updates", type=int, default=LearnOptions.updates)
    parser.add_argument("--max-uses", type=int, default=LearnOptions.max_uses)
    parser.add_argument("--cooldown", type=int, default=LearnOptions.cooldown)
    parser.add_argument(
        "--stop-at-target",
        action="store_true",
        help="stop when the target is reached, as `claw demo --learn` does (default: train "
        "on to --versions versions, a whole run, so the start-up is not most of it)",
    )
    args = parser.parse_args()
    options = LearnOptions(
        seed=args.seed,
        max_versions=args.versions,
        max_uses=args.max_uses,
        cooldown=args.cooldown,
        updates=args.updates,
        stop_at_target=args.stop_at_target,
    )
    # first, on a quiet machine: after the loop, its processes' exit and its checkpoints'
    # writeback would land on one arm's rounds more than the other's
    versions_arm = per_token_versions_arm()
    with contextlib.ExitStack() as stack:
        work = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory()))
        settings = ClawSettings().with_overrides(lake_uri=str(work / "lake"))
        with contextlib.redirect_stdout(sys.stderr):  # the loop's summary: stdout is the line
            summary = run_learn(settings, workdir=str(work / "run"), options=options)
        found = figures(summary)
    reached = summary.reached is not None and summary.reached[0] <= TARGET_VERSIONS
    waited = summary.wait_share <= TARGET_WAIT_SHARE
    emit(
        "learning_loop",
        target=TARGET,
        targets={
            "mean_reward": TARGET_REWARD,
            "within_versions": TARGET_VERSIONS,
            "trainer_wait_share": TARGET_WAIT_SHARE,
            "token_versions_vs_without": TARGET_TOKEN_VERSIONS,
        },
        target_met=reached and waited and versions_arm["met"],
        baseline=None,
        ratio=None,
        seed=args.seed,
        **found,
        per_token_versions=versions_arm,
    )


if __name__ == "__main__":
    main()

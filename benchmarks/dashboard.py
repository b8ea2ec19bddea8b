"""Benchmark: every dashboard page on a 200,000-step lake, in headless Chromium.

Writes a simulated lake (GRPO groups of multi-turn rollouts, straight to bronze in gateway
micro-batches; then silver and the `default` gold dataset over every policy version), starts
`claw dashboard` on it, and times each page in the browser until its script has finished
(title and main content drawn): the first load of each page after start (cold caches), then
five loads each (warm). The same is timed on an empty lake in the same run as the baseline.
Peak RSS is the Streamlit process's high-water mark (VmHWM). Prints one JSON line.
Targets: every page's warm p50 <= 2 s, cold <= 5 s; peak RSS <= 1 GiB.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.harness import emit, status_kib  # noqa: E402
from claw_pipelines.contracts.specs import DEFAULT_SPEC  # noqa: E402
from claw_pipelines.contracts.tables import SILVER_STEPS  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.materialize.gold import build_partition, policy_versions  # noqa: E402
from claw_pipelines.materialize.silver import build_silver  # noqa: E402
from claw_pipelines.simulation.bulk import write_bulk_bronze  # noqa: E402
from tests.support.browser import PAGES, DashboardProcess, browser  # noqa: E402

WARM_TARGET_S = 2.0
COLD_TARGET_S = 5.0
RSS_TARGET_BYTES = 1 << 30


def fill(lake: Lake, steps: int) -> dict:
    """A simulated lake of at least `steps` steps, with silver and gold built."""
    started = time.perf_counter()
    records = write_bulk_bronze(lake, steps)
    build_silver(lake)
    versions = policy_versions(lake)
    for version in versions:
        build_partition(lake, DEFAULT_SPEC, version)
    return {
        "records": records,
        "steps": lake.read(SILVER_STEPS, columns=["step_key"]).height,
        "policy_versions": len(versions),
        "build_s": round(time.perf_counter() - started, 1),
    }


def peak_rss(pid: int) -> int:
    """The process's resident-set high-water mark, in bytes."""
    return (status_kib(pid, "VmHWM") or 0) * 1024


def time_pages(lake: Path, loads: int, log: Path) -> dict:
    """Cold and warm page times (s) on one lake, and the dashboard's peak RSS."""
    process = DashboardProcess(lake, log).start()
    try:
        with browser(process.url) as tab:
            cold = {name: tab.visit(name) for name in PAGES}
            warm = {name: [tab.visit(name) for _ in range(loads)] for name in PAGES}
        rss = peak_rss(process.proc.pid)
    finally:
        process.stop()
    visits = [*cold.values(), *(visit for page in warm.values() for visit in page)]
    exceptions = sum(v.exceptions for v in visits)
    return {
        "cold_s": {name: round(v.done_s, 3) for name, v in cold.items()},
        "warm_p50_s": {
            name: round(statistics.median(v.done_s for v in visits), 3)
            for name, visits in warm.items()
        },
        "peak_rss_bytes": rss,
        "exceptions": exceptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200_000)
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--lake", help="reuse (or create) the big lake here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="claw-bench-dashboard-") as tmp:
        root = Path(tmp)
        lake = Path(args.lake) if args.lake else root / "lake"
        built = {"reused": True}
        if not (lake / "silver").exists():
            built = fill(Lake(str(lake)), args.steps)
        big = time_pages(lake, args.loads, root / "dashboard.log")
        empty = time_pages(root / "empty", args.loads, root / "dashboard-empty.log")
    worst_warm = max(big["warm_p50_s"].values())
    worst_cold = max(big["cold_s"].values())
    warm_vs_empty = round(worst_warm / max(empty["warm_p50_s"].values()), 3)
    emit(
        "dashboard",
        target=f"every page <= {WARM_TARGET_S} s warm (p50) and <= {COLD_TARGET_S} s cold on the "
        f"big lake, the dashboard's peak RSS <= {RSS_TARGET_BYTES >> 20} MiB, no exception",
        targets={
            "warm_p50_s": WARM_TARGET_S,
            "cold_s": COLD_TARGET_S,
            "peak_rss_bytes": RSS_TARGET_BYTES,
        },
        target_met=worst_warm <= WARM_TARGET_S
        and worst_cold <= COLD_TARGET_S
        and big["peak_rss_bytes"] <= RSS_TARGET_BYTES
        and big["exceptions"] == 0,
        baseline="baseline_empty_lake",
        ratio=warm_vs_empty,
        lake=built,
        pages=big,
        baseline_empty_lake=empty,
        worst_warm_p50_s=worst_warm,
        worst_cold_s=worst_cold,
        peak_rss_mib=round(big["peak_rss_bytes"] / 2**20, 1),
        warm_vs_empty_lake=warm_vs_empty,
    )


if __name__ == "__main__":
    main()

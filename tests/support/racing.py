"""Real lakes that force the worst interleavings of concurrent writers, for tests.

`BarrierLake` holds a writer at its first commit until every racer has reached its own (so
all of them computed from the same state); `KillingLake` SIGKILLs its own process right
after one table's commit. Both are the real `Lake`, only timed. The `race_*` functions are
racers: silver runs, gold builds, trainers of one consumer rank.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.contracts.specs import DEFAULT_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver

BARRIER_TIMEOUT_S = 60


class BarrierLake(Lake):
    """A lake whose first write (of this object) waits at `barrier`."""

    def __init__(self, uri: str, barrier: Any) -> None:
        super().__init__(uri)
        self.barrier = barrier
        self.waited = False

    def _hold(self) -> None:
        if not self.waited:
            self.waited = True
            self.barrier.wait(BARRIER_TIMEOUT_S)

    def append(self, *args, **kwargs) -> int:
        """Wait for the other racers before the first commit, then append."""
        self._hold()
        return super().append(*args, **kwargs)

    def overwrite(self, *args, **kwargs) -> int:
        """Wait for the other racers before the first commit, then overwrite."""
        self._hold()
        return super().overwrite(*args, **kwargs)


# a silver run on a KillingLake, in a process of its own: argv = lake uri, victim table
KILL_SCRIPT = """
import sys
from claw_pipelines.materialize.silver import build_silver
from tests.support.racing import KillingLake
build_silver(KillingLake(sys.argv[1], sys.argv[2]))
"""


class KillingLake(Lake):
    """A lake whose process dies (SIGKILL) right after its commit to table `victim`."""

    def __init__(self, uri: str, victim: str) -> None:
        super().__init__(uri)
        self.victim = victim

    def _after(self, spec: Any, version: int) -> int:
        if getattr(spec, "name", spec) == self.victim:
            os.kill(os.getpid(), signal.SIGKILL)
        return version

    def append(self, spec, *args, **kwargs) -> int:
        """Append, then die if this was the victim's commit."""
        return self._after(spec, super().append(spec, *args, **kwargs))

    def overwrite(self, spec, *args, **kwargs) -> int:
        """Overwrite, then die if this was the victim's commit."""
        return self._after(spec, super().overwrite(spec, *args, **kwargs))


def race_silver_in_process(uri: str, barrier: Any, results: Any) -> None:
    """A racer for multiprocessing (spawn): one silver build that commits after the others
    computed; puts its summary on `results`."""
    results.put(build_silver(BarrierLake(uri, barrier)).summary())


def race_gold_in_process(uri: str, barrier: Any, results: Any) -> None:
    """A racer for multiprocessing (spawn): one build of `default` policy version 1 that
    commits after the others computed; puts how often it lost on `results`."""
    results.put(build_partition(BarrierLake(uri, barrier), DEFAULT_SPEC, 1).write_conflicts)


def race_next_batch_in_process(
    uri: str, barrier: Any, results: Any, train_s: float = 0.0, **selection: Any
) -> None:
    """A racer for multiprocessing (spawn): a trainer of consumer `racer` rank 0 pulling one
    group per `next_batch` of dataset `live` (with `selection`: max_uses, cooldown, order),
    `train_s` seconds between pulls, until none is left, its first delivery committed after
    the others chose theirs; puts its deliveries, [(batch index, group, use)], on `results`."""
    dataset, delivered = Dataset(BarrierLake(uri, barrier), "live"), []
    while (batch := dataset.next_batch(1, consumer="racer", timeout=0, **selection)) is not None:
        delivered.append((batch.batch_index, batch.groups[0], batch.uses[0]))
        time.sleep(train_s)
    results.put(delivered)


def race_in_processes(target: Callable[..., None], uri: str, racers: int = 2) -> list:
    """`racers` processes running `target(uri, barrier, results)`; what each put."""
    context = multiprocessing.get_context("spawn")  # delta-rs runtimes do not survive fork
    barrier, results = context.Barrier(racers), context.Queue()
    processes = [
        context.Process(target=target, args=(uri, barrier, results)) for _ in range(racers)
    ]
    for process in processes:
        process.start()
    answers = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(30)
        assert process.exitcode == 0
    return answers


def race_silver_in_threads(uri: str, racers: int) -> list[dict]:
    """`racers` silver builds in threads of this process, released together at their first
    commit; their summaries."""
    barrier = threading.Barrier(racers)
    summaries: list[dict] = []
    errors: list[BaseException] = []

    def racer() -> None:
        try:
            summaries.append(build_silver(BarrierLake(uri, barrier)).summary())
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=racer) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BARRIER_TIMEOUT_S * 2)
    if errors:
        raise errors[0]
    return summaries

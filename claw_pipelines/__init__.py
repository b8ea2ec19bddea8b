"""The Claw lakehouse: agents' LLM calls, as exact token ids with rewards and lineage, into
Delta tables (bronze → silver → gold), curated and merged into prefix-tree training sets.

The front door holds what a trainer and an operator use; the packages are the design's boxes
(docs/DESIGN.md §2), each `__init__` a map of its modules:

- `contracts`: schemas, wire models, limits and the error family (imports nothing of ours);
- `settings`: every `CLAW_` knob;
- `lake`: Delta tables, the object store, specs, policy versions, tokenizers, the catalog;
- `transforms`: pure frame transforms (steps, stitching, rewards, curation, trees, quality);
- `tokenization`: chat templates and tokenizers, the bundled one included;
- `materialize`: silver and gold, whole or in increments, and the live materializer;
- `consume`: datasets, batches and live delivery for trainers;
- `train`: tree attention and trainer adapters (the only room that imports torch);
- `interop`: `claw export` and `claw import`;
- `ops`: `claw check` / `claw repair` and the waste ledger;
- `simulation`: the bundled simulated model and agents (test doubles that say so);
- `defs`, `definitions`: the Dagster code location;
- `app`: the `claw` CLI, `claw up`, `claw demo`.

The names below load their module on first use (`import claw_pipelines` stays light: the
gateway's processes import it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "open_dataset": "claw_pipelines.consume.dataset",
    "Dataset": "claw_pipelines.consume.dataset",
    "Batch": "claw_pipelines.consume.batch",
    "BatchPlan": "claw_pipelines.consume.offline",
    "publish_policy_version": "claw_pipelines.consume.dataset",
    "current_policy_version": "claw_pipelines.consume.dataset",
    "ClawSettings": "claw_pipelines.settings",
    "ClawError": "claw_pipelines.contracts.errors",
    "NotFound": "claw_pipelines.contracts.errors",
    "Forbidden": "claw_pipelines.contracts.errors",
    "SpecError": "claw_pipelines.contracts.errors",
    "JudgeError": "claw_pipelines.contracts.errors",
    "ChatLogError": "claw_pipelines.contracts.errors",
    "ContractViolation": "claw_pipelines.contracts.errors",
    "Undecodable": "claw_pipelines.contracts.errors",
    "UnsafeStore": "claw_pipelines.contracts.errors",
    "WriteConflict": "claw_pipelines.contracts.errors",
}
__all__ = [
    "Batch",
    "BatchPlan",
    "ChatLogError",
    "ClawError",
    "ClawSettings",
    "ContractViolation",
    "Dataset",
    "Forbidden",
    "JudgeError",
    "NotFound",
    "SpecError",
    "Undecodable",
    "UnsafeStore",
    "WriteConflict",
    "__version__",
    "current_policy_version",
    "open_dataset",
    "publish_policy_version",
]

if TYPE_CHECKING:  # what type checkers and editors see
    from claw_pipelines.consume.batch import Batch
    from claw_pipelines.consume.dataset import (
        Dataset,
        current_policy_version,
        open_dataset,
        publish_policy_version,
    )
    from claw_pipelines.consume.offline import BatchPlan
    from claw_pipelines.contracts.errors import (
        ChatLogError,
        ClawError,
        ContractViolation,
        Forbidden,
        JudgeError,
        NotFound,
        SpecError,
        Undecodable,
        UnsafeStore,
        WriteConflict,
    )
    from claw_pipelines.settings import ClawSettings


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'claw_pipelines' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

"""Trainers' side: gold partitions by policy version, exact and reproducible (docs/DESIGN.md §8).

- `dataset`: `open_dataset`, `Dataset` (offline batches, live `next_batch`, packing) and
  `Batch`, `BatchPlan`, policy-version publishing for trainers;
- `delivery`: live delivery: which prompt groups a consumer rank gets next, each once,
  recorded in `gold/consumption`;
- `report`: a batch's contract report, computed as it is handed out.

The names below are the consumption API (`from claw_pipelines.consume import open_dataset`).
"""

from claw_pipelines.consume.dataset import (
    Batch,
    BatchPlan,
    Dataset,
    NotFound,
    current_policy_version,
    open_dataset,
    publish_policy_version,
)

__all__ = [
    "Batch",
    "BatchPlan",
    "Dataset",
    "NotFound",
    "current_policy_version",
    "open_dataset",
    "publish_policy_version",
]

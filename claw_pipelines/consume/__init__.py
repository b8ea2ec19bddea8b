"""Trainers' side: gold partitions by policy version, exact and reproducible (docs/DESIGN.md §8).

- `dataset`: `open_dataset`, `Dataset` (the front: each method hands its job to a module
  below), policy-version publishing for trainers;
- `batch`: `Batch` (whole trees, or flat sequences, as numpy arrays) and its slicing out of
  a packed partition;
- `source`: a dataset's rows, tokens and stored trees at a version, and packing steps for
  training (the one place: offline and live alike);
- `offline`: `BatchPlan`, a partition's batches planned without a token read, then packed
  only for the batches asked for; the consumption rows `batches` writes;
- `live`: `next_batch` and `replay`, and what delivery keeps between calls;
- `delivery`: live delivery: which prompt groups a consumer rank gets next, each once or,
  with a `Selection`, up to `max_uses` times, a cooldown apart, in an order; recorded in
  `gold/consumption` with each group's use number;
- `feedback`: what a trainer feeds back on a delivered batch (its log-probs, loss, step),
  recorded once in `gold/trainer_feedback`, and the behaviour-vs-trainer mismatch report;
- `judge`: what a batch's contract is judged against (spec, staleness floor, rejections);
- `report`: a batch's contract report, computed as it is handed out;
- `lineage`: which spec wrote each partition, read by `gold/lineage`'s change feed;
- `kept`: `Kept`, a value kept while the table versions it was read from stand.

The names below are the consumption API (`from claw_pipelines.consume import open_dataset`).
"""

from claw_pipelines.consume.batch import Batch
from claw_pipelines.consume.dataset import (
    Dataset,
    current_policy_version,
    open_dataset,
    publish_policy_version,
)
from claw_pipelines.consume.offline import BatchPlan
from claw_pipelines.contracts.errors import Forbidden, NotFound

__all__ = [
    "Batch",
    "BatchPlan",
    "Dataset",
    "Forbidden",
    "NotFound",
    "current_policy_version",
    "open_dataset",
    "publish_policy_version",
]

"""Training on gold batches: the only part of the lakehouse that imports torch (the `train`
extra installs it).

- `attention`: tree attention as a FlexAttention `BlockMask` from a batch's O(T) mask
  description (the GPU path);
- `block_attention`: tree attention with a backward pass on any device, CPU included,
  without a T×T mask;
- `adapters`: gold steps in the shapes trainers consume (verl's `DataProto`, TRL-style
  rows, a torch `IterableDataset` of batches for every rank);
- `grpo`: GRPO on tree batches for a Hugging Face checkpoint through the tree attention,
  with truncated importance sampling against the batch's behaviour log-probs
  (`TreeGRPO`; `claw demo --learn`);
- `tiny_policy`: the demo's policy-gradient learner (`claw demo --loop`).

The entry points below load their module (and torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "tree_block_mask": "claw_pipelines.train.attention",
    "tree_plan": "claw_pipelines.train.block_attention",
    "tree_attention": "claw_pipelines.train.block_attention",
    "register_hf_tree_attention": "claw_pipelines.train.block_attention",
    "BatchDataset": "claw_pipelines.train.adapters",
    "verl_batch": "claw_pipelines.train.adapters",
    "trl_records": "claw_pipelines.train.adapters",
    "TinyPolicy": "claw_pipelines.train.tiny_policy",
    "TreeGRPO": "claw_pipelines.train.grpo",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'claw_pipelines.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

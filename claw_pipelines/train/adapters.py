"""Gold steps in the shapes trainers consume: verl's `DataProto` fields, TRL-style per-step
records, and `BatchDataset`, a torch `IterableDataset` over a dataset's batches (torch: the
`train` extra).

verl (`verl_batch`; `DataProto.from_dict(**verl_batch(steps))` builds the real object), one
row per step, B steps, P = longest prompt, R = longest response:

| field | shape | from gold |
|---|---|---|
| `prompts` | [B, P] int64, left-padded with `pad_id` | `prompt_ids` |
| `responses` | [B, R] int64, right-padded | `response_ids` |
| `input_ids` | [B, P+R] | prompts then responses |
| `attention_mask` | [B, P+R] int64, 1 on real tokens | |
| `position_ids` | [B, P+R] int64, 0 at the first real token | |
| `response_mask` | [B, R] int64, the step's `response_mask` (1 = trained), 0 on padding | |
| `old_log_probs` | [B, R] float32, 0 where not captured | `rollout_log_probs` |
| `token_level_rewards` | [B, R] float32, the reward on the last response token | `reward` |
| `token_policy_versions` | [B, R] int64, each token's policy version, -1 padding | runs |
| `uid` (non-tensor) | [B] object: the GRPO group | `prompt_uid`, else `trajectory_uid` |
| `step_key` (non-tensor) | [B] object: provenance back to the lake | `step_key` |

TRL (`trl_records`): dicts with `prompt_ids`, `completion_ids`, `completion_mask`, `reward`,
`advantage`, `old_per_token_logps`, `token_policy_versions` (per completion token) and the
step's provenance, as GRPO-style trainers take a generation's tokens.

Packed batches (`Batch.to_torch()`, which `BatchDataset` yields) carry the same behaviour
log-probs per packed token: `old_log_probs` (0 where not captured) and `old_log_probs_mask`
(where captured); at each step's response tokens they are the values verl's `old_log_probs`
and TRL's `old_per_token_logps` hold for it (in the tree layout, the mean where several steps'
responses share a token).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import polars as pl

from claw_pipelines.consume.dataset import BatchPlan, Dataset, Layout
from claw_pipelines.transforms.partials import response_version_lists
from claw_pipelines.transforms.shapes import verl_frame

try:
    from torch.utils.data import IterableDataset as _IterableDataset
except ImportError:  # torch is the `train` extra; the records adapters work without it
    _IterableDataset = object


def _padded(lists: pl.Series, width: int, left: bool, fill: float, dtype) -> np.ndarray:
    """A list column as a [rows, width] array, left- or right-aligned (no per-token loop)."""
    lengths = lists.list.len().fill_null(0).to_numpy().astype(np.int64)
    flat = lists.explode().fill_null(fill).to_numpy().astype(dtype)
    flat = flat[np.repeat(lengths > 0, np.maximum(lengths, 1))]  # drop empty lists' nulls
    out = np.full((len(lengths), width), fill, dtype=dtype)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = within + (width - lengths[rows] if left else 0)
    out[rows, cols] = flat
    return out


def verl_batch(steps: pl.DataFrame, pad_id: int = 0) -> dict[str, Any]:
    """`tensors`, `non_tensors` and `meta_info` for verl's `DataProto.from_dict` (module doc)."""
    import torch

    frame = verl_frame(steps)
    prompt_len = frame["prompts"].list.len().fill_null(0).to_numpy()
    response_len = frame["responses"].list.len().fill_null(0).to_numpy()
    width_p, width_r = int(prompt_len.max(initial=0)), int(response_len.max(initial=0))
    prompts = _padded(frame["prompts"], width_p, True, pad_id, np.int64)
    responses = _padded(frame["responses"], width_r, False, pad_id, np.int64)
    real_p = np.arange(width_p)[None, :] >= (width_p - prompt_len)[:, None]
    real_r = np.arange(width_r)[None, :] < response_len[:, None]
    attention = np.concatenate([real_p, real_r], axis=1).astype(np.int64)
    positions = np.maximum(np.cumsum(attention, axis=1) - 1, 0)
    response_mask = _padded(frame["response_mask"], width_r, False, 0, np.int64) * real_r
    old = frame["old_log_probs"]
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": positions,
        "response_mask": response_mask,
        "old_log_probs": _padded(old, width_r, False, 0.0, np.float32),
        "token_level_rewards": _padded(frame["token_level_rewards"], width_r, False, 0, np.float32),
        "token_policy_versions": _padded(
            response_version_lists(steps), width_r, False, -1, np.int64
        ),
    }
    return {
        "tensors": {k: torch.from_numpy(v) for k, v in tensors.items()},
        "non_tensors": {
            "uid": np.array(frame["uid"].to_list(), dtype=object),
            "step_key": np.array(frame["step_key"].to_list(), dtype=object),
        },
        "meta_info": {"policy_versions": sorted(set(frame["policy_version"].drop_nulls()))},
    }


def trl_records(steps: pl.DataFrame) -> list[dict[str, Any]]:
    """One TRL-style record per step (module doc)."""
    frame = verl_frame(steps).with_columns(response_version_lists(steps))
    return frame.select(
        prompt_ids="prompts",
        completion_ids="responses",
        completion_mask="response_mask",
        old_per_token_logps="old_log_probs",
        token_policy_versions="token_policy_versions",
        reward="reward",
        advantage="advantage",
        group="uid",
        step_key="step_key",
        policy_version="policy_version",
    ).to_dicts()


def _distributed_rank() -> tuple[int, int]:
    """(rank, world size) of torch.distributed when initialized, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


Uneven = Literal["repeat", "drop"]


class BatchDataset(_IterableDataset):
    """A torch IterableDataset of `to_torch()` dicts of one partition's batches (each with its
    `batch_index` and `repeated`). Rank r of world size w (default: torch.distributed's, else
    0 of 1) takes batches r, r+w, r+2w..., and each DataLoader worker of a rank a disjoint
    share of those. Every rank gets the same number of batches (a collective such as DDP's
    all-reduce would otherwise wait forever on the rank that ran out): with `uneven="repeat"`
    (the default, as torch's DistributedSampler pads) ceil(n / w), the last ranks' extra
    batches being the partition's first ones again (`repeated` true: every batch once, a few
    twice); with `uneven="drop"` floor(n / w), the last n mod w batches left out (every batch
    at most once). Every rank and worker plans the same batches (`Dataset.batch_plan`: no
    tokens read) and packs only those it yields (`plan.packed_steps` counts them). Use
    `DataLoader(ds, batch_size=None)`, and with workers `multiprocessing_context="spawn"`:
    polars is not fork-safe."""

    def __init__(
        self,
        dataset: Dataset,
        policy_version: int,
        batch_size: int | None = None,
        max_tokens: int | None = None,
        layout: Layout = "tree",
        seed: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        uneven: Uneven = "repeat",
    ) -> None:
        if uneven not in ("repeat", "drop"):
            raise ValueError(f"uneven must be 'repeat' or 'drop', not {uneven!r}")
        if _IterableDataset is object:
            raise ImportError("BatchDataset needs torch: pip install 'claw-lakehouse[train]'")
        self.dataset, self.policy_version, self.layout, self.seed = (
            dataset,
            policy_version,
            layout,
            seed,
        )
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.rank, self.world_size, self.uneven = rank, world_size, uneven
        self._plan: BatchPlan | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (into a spawned worker) without its plan: the worker plans again, alike."""
        return {**self.__dict__, "_plan": None}

    @property
    def plan(self) -> BatchPlan:
        """The partition's batch plan (the same on every rank and worker): the one the last
        iteration packed from, else a new one. Each iteration (epoch) plans again, so the
        contract's staleness floor is that of now."""
        if self._plan is None:
            self._plan = self._new_plan()
        return self._plan

    def _new_plan(self) -> BatchPlan:
        return self.dataset.batch_plan(
            self.policy_version,
            self.batch_size,
            layout=self.layout,
            seed=self.seed,
            max_tokens=self.max_tokens,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        from torch.utils.data import get_worker_info

        if self.rank is None:
            rank, world = _distributed_rank()
        else:
            rank, world = self.rank, self.world_size or 1
        worker = get_worker_info()
        workers, me = (1, 0) if worker is None else (worker.num_workers, worker.id)
        self._plan = plan = self._new_plan()
        total = len(plan)
        per_rank = -(-total // world) if self.uneven == "repeat" else total // world
        mine = [rank + turn * world for turn in range(me, per_rank, workers)]
        batches = plan.batches(index % total for index in mine)
        for index, batch in zip(mine, batches, strict=True):
            tensors = batch.to_torch()
            tensors["batch_index"], tensors["repeated"] = index % total, index >= total
            yield tensors

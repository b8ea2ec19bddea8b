"""Tree attention with a backward pass on any device, CPU included, that never builds a T×T
mask or score matrix (imports torch: the `train` extra).

FlexAttention is the GPU path; on CPU, torch's flex has no backward. Here a tree batch is cut
into query blocks of `block` tokens; each query block attends only to the key blocks whose
tiles hold an allowed pair (`attention.tile_masks`, from `subtree_end`), with the exact
ancestor-or-self mask `k <= q < subtree_end[k]` inside them. The forward keeps per-row
log-sum-exps, the backward recomputes the block's probabilities from them (as flash
attention does), so memory is O(T·d) plus one block's scores at a time. Work is
proportional to the allowed tiles: a shared 4k-token prompt is read by every rollout's
queries, as in the flat steps, but computed once per tree token, not once per step.

With a Hugging Face model, register it once and pass the plan as a forward keyword:

```python
register_hf_tree_attention()                       # as attn_implementation "claw_tree"
model.set_attn_implementation("claw_tree")
t = batch.to_torch()
out = model(input_ids=t["input_ids"][None], position_ids=t["position_ids"][None],
            tree_plan=tree_plan(t["subtree_end"]))
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from claw_pipelines.train.attention import tile_masks

HF_NAME = "claw_tree"
PLAN_BLOCK = 256


@dataclass(frozen=True)
class TreePlan:
    """Which keys each query block reads, built once per batch and shared by every layer's
    forward and backward: per query block, its parts, each (keys, allowed): keys of full
    tiles (every pair allowed: `allowed` is None, no mask) and of partial tiles (with the
    exact [rows, keys] ancestor-or-self mask)."""

    subtree_end: Any  # torch int64 [T]
    block: int
    blocks: list[list[tuple[Any, Any]]]  # per query block: its non-empty parts

    @property
    def num_tokens(self) -> int:
        """T, the tokens of the tree batch."""
        return int(self.subtree_end.shape[0])

    def pairs_computed(self) -> int:
        """Query-key pairs the kernel scores (allowed or not): its work, against T² dense."""
        total = self.num_tokens
        return sum(
            min(self.block, total - i * self.block) * sum(len(keys) for keys, _ in parts)
            for i, parts in enumerate(self.blocks)
        )

    def parts(self, i: int) -> list[tuple[Any, Any]]:
        """Query block i's (keys, allowed [rows, keys] or None when all allowed), non-empty."""
        return self.blocks[i]


def tree_plan(subtree_end: Any, block: int = PLAN_BLOCK) -> TreePlan:
    """The plan of a batch's `subtree_end` (numpy or torch): the key blocks per query block
    (256-token blocks: fewest calls for little waste on CPU; 70.3M pairs scored for 68.2M
    allowed on a 4k-prompt GRPO group)."""
    end = np.asarray(subtree_end.cpu() if hasattr(subtree_end, "cpu") else subtree_end)
    end = torch.from_numpy(end.astype(np.int64))
    total = len(end)
    partial, full = tile_masks(end.numpy(), block)
    offsets = np.arange(block)

    def positions(row: np.ndarray) -> Any:
        starts = np.flatnonzero(row) * block
        keys = (starts[:, None] + offsets[None, :]).ravel()
        return torch.from_numpy(keys[keys < total])

    blocks = []
    for i, (full_row, partial_row) in enumerate(zip(full, partial, strict=True)):
        parts = []
        if full_row.any():
            parts.append((positions(full_row), None))
        if partial_row.any():
            keys = positions(partial_row)
            q_pos = torch.arange(i * block, min((i + 1) * block, total))[:, None]
            parts.append((keys, (keys[None, :] <= q_pos) & (q_pos < end[keys][None, :])))
        blocks.append(parts)
    return TreePlan(end, block, blocks)


def _flash_bias(allowed, groups: int, dtype):
    """The additive mask of torch's CPU flash kernel: 0 where allowed, -inf elsewhere,
    repeated over the query-head groups (rows are group-major)."""
    bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return bias.repeat(groups, 1)[None, None]


def _flash_forward(q_blk, k, v, parts, groups: int, scale: float):
    """One query block through torch's fused CPU flash kernel, a call per part (full tiles
    unmasked), merged by their log-sum-exps: (out, lse)."""
    outs, lses = [], []
    for keys, allowed in parts:
        bias = None if allowed is None else _flash_bias(allowed, groups, q_blk.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_blk[None],
            k.index_select(1, keys)[None],
            v.index_select(1, keys)[None],
            attn_mask=bias,
            scale=scale,
        )
        outs.append(out[0])
        lses.append(lse[0])
    if len(outs) == 1:
        return outs[0], lses[0]
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(
        o * torch.exp(part - lse)[..., None].to(o.dtype) for o, part in zip(outs, lses, strict=True)
    )
    return out, lse


def _flash_backward(do_blk, q_blk, k, v, o_blk, lse_blk, parts, groups: int, scale: float):
    """(dq, [(keys, dk, dv) per part]) of one query block: each part's gradients from the
    block's whole output and log-sum-exp, so the parts' softmax stays one softmax."""
    dq, per_part = None, []
    for keys, allowed in parts:
        bias = None if allowed is None else _flash_bias(allowed, groups, q_blk.dtype)
        dq_part, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do_blk[None],
            q_blk[None],
            k.index_select(1, keys)[None],
            v.index_select(1, keys)[None],
            o_blk[None],
            lse_blk[None],
            0.0,
            False,
            attn_mask=bias,
            scale=scale,
        )
        dq = dq_part[0] if dq is None else dq + dq_part[0]
        per_part.append((keys, dk[0], dv[0]))
    return dq, per_part


def _joined(parts, rows: int):
    """The parts as one key set and one [rows, keys] allowed mask (matmul path)."""
    keys = torch.cat([keys for keys, _ in parts])
    allowed = torch.cat(
        [torch.ones(rows, len(keys), dtype=torch.bool) if a is None else a for keys, a in parts],
        dim=1,
    )
    return keys, allowed


def _masked_scores(q_blk, ks, allowed, groups: int, scale: float):
    """Scores [kv heads, groups·rows, keys] with -inf where not allowed (matmul path)."""
    scores = torch.matmul(q_blk, ks.transpose(-1, -2)) * scale
    heads, rows = scores.shape[0], scores.shape[1]
    scores = scores.view(heads, groups, rows // groups, -1).masked_fill(~allowed, float("-inf"))
    return scores.view(heads, rows, -1).to(torch.promote_types(q_blk.dtype, torch.float32))


def _matmul_forward(q_blk, k, v, parts, groups: int, scale: float):
    """One query block with plain matmuls (any device): (out, lse)."""
    keys, allowed = _joined(parts, q_blk.shape[1] // groups)
    vs = v.index_select(1, keys)
    scores = _masked_scores(q_blk, k.index_select(1, keys), allowed, groups, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(vs.dtype)
    return torch.matmul(probs, vs), lse


def _matmul_backward(do_blk, q_blk, k, v, o_blk, lse_blk, parts, groups: int, scale: float):
    """(dq, [(keys, dk, dv)]) of one query block, its probabilities recomputed from lse."""
    keys, allowed = _joined(parts, q_blk.shape[1] // groups)
    ks, vs = k.index_select(1, keys), v.index_select(1, keys)
    probs = torch.exp(_masked_scores(q_blk, ks, allowed, groups, scale) - lse_blk[..., None])
    delta = (do_blk.to(probs.dtype) * o_blk.to(probs.dtype)).sum(-1, keepdim=True)
    dv = torch.matmul(probs.transpose(-1, -2).to(vs.dtype), do_blk)
    dp = torch.matmul(do_blk, vs.transpose(-1, -2)).to(probs.dtype)
    ds = (probs * (dp - delta) * scale).to(q_blk.dtype)
    return torch.matmul(ds, ks), [(keys, torch.matmul(ds.transpose(-1, -2), q_blk), dv)]


_KERNELS = {
    "flash": (_flash_forward, _flash_backward),
    "matmul": (_matmul_forward, _matmul_backward),
}


def _query_block(q, start: int, stop: int):
    """[kv heads, groups, T, d] → the block's rows as [kv heads, groups·rows, d]."""
    heads, groups = q.shape[0], q.shape[1]
    return q[:, :, start:stop].reshape(heads, groups * (stop - start), q.shape[-1])


def _put_block(target, start: int, stop: int, value) -> None:
    """Write [kv heads, groups·rows, ...] back into target [kv heads, groups, T, ...]."""
    target[:, :, start:stop] = value.view(target.shape[0], target.shape[1], stop - start, -1)


def _grouped(t, kv_heads: int):
    """[heads, T, d] → [kv heads, groups, T, d] (grouped-query attention)."""
    return t.view(kv_heads, t.shape[0] // kv_heads, t.shape[1], t.shape[2])


class _TreeAttention(torch.autograd.Function):
    """Block-sparse tree attention over (q [H, T, d], k and v [H_kv, T, d])."""

    @staticmethod
    def forward(ctx, q, k, v, plan: TreePlan, scale: float, kernel: str):
        forward, _ = _KERNELS[kernel]
        qg = _grouped(q, k.shape[0])
        out = torch.empty_like(qg)
        lse = torch.empty((*qg.shape[:-1], 1), dtype=torch.promote_types(q.dtype, torch.float32))
        for i, (start, stop) in enumerate(_blocks(plan)):
            q_blk = _query_block(qg, start, stop)
            o, row_lse = forward(q_blk, k, v, plan.parts(i), qg.shape[1], scale)
            _put_block(out, start, stop, o)
            _put_block(lse, start, stop, row_lse.to(lse.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.kernel = plan, scale, kernel
        return out.view_as(q)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        _, backward = _KERNELS[ctx.kernel]
        qg, dog = _grouped(q, k.shape[0]), _grouped(grad_out.contiguous(), k.shape[0])
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(k), torch.zeros_like(v)
        for i, (start, stop) in enumerate(_blocks(plan)):
            dq_blk, per_part = backward(
                _query_block(dog, start, stop),
                _query_block(qg, start, stop),
                k,
                v,
                _query_block(out, start, stop),
                _query_block(lse, start, stop)[..., 0],
                plan.parts(i),
                qg.shape[1],
                scale,
            )
            _put_block(dq, start, stop, dq_blk)
            for keys, dk_part, dv_part in per_part:
                dk.index_add_(1, keys, dk_part)
                dv.index_add_(1, keys, dv_part)
        return dq.view_as(q), dk, dv, None, None, None


def _blocks(plan: TreePlan):
    """(start, stop) of each query block."""
    total = plan.num_tokens
    return [(i, min(i + plan.block, total)) for i in range(0, total, plan.block)]


def tree_attention(q, k, v, plan: TreePlan, scale: float | None = None, kernel: str | None = None):
    """Attention of q [H, T, d] over k, v [H_kv, T, d] (H a multiple of H_kv) in which each
    token attends to its ancestors-or-self; differentiable in q, k and v. `kernel`: "flash"
    (torch's fused CPU flash-attention kernel per block, the default on CPU) or "matmul"
    (plain matmuls, any device)."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if kernel is None:
        kernel = "flash" if q.device.type == "cpu" else "matmul"
    if kernel not in _KERNELS:
        raise ValueError(f"kernel must be one of {sorted(_KERNELS)}, got {kernel!r}")
    return _TreeAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), plan, float(scale), kernel
    )


def hf_tree_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
) -> tuple[Any, None]:
    """A transformers attention implementation: q, k, v [1, H, T, d] → ([1, T, H, d], None);
    the batch's `tree_plan` arrives as a forward keyword."""
    plan = kwargs.get("tree_plan")
    if plan is None:
        raise ValueError(
            "attn_implementation 'claw_tree' needs model(..., tree_plan=tree_plan(...))"
        )
    if query.shape[0] != 1:
        raise ValueError(f"a tree batch is one sequence: batch dimension 1, got {query.shape[0]}")
    if dropout:
        raise ValueError("claw_tree attention has no dropout; train with attention_dropout=0")
    out = tree_attention(query[0], key[0], value[0], plan, scaling)
    return out.transpose(0, 1)[None].contiguous(), None


def register_hf_tree_attention(name: str = HF_NAME) -> str:
    """Register `hf_tree_attention` with transformers under `name` (idempotent); returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, hf_tree_attention)
    return name

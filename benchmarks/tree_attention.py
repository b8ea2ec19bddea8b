"""Benchmark: training a small Hugging Face model on tree batches vs the same steps flat.

GRPO groups with a long shared context (a 4096-token prompt, 8 rollouts, 3 turns) go through
the real pipeline (bronze, silver, one gold partition); one tree batch (one group, >= 16k
tree tokens) is trained forward + backward on a randomly initialised 2-layer Qwen2 (RoPE,
RMSNorm, grouped-query attention; by default Qwen2.5-0.5B's layer shape, see SHAPES), against
the same steps flat through the same model: right-padded micro-batches of at most the tree
batch's tokens, SDPA causal, gradients accumulated.

The tree arm attends through FlexAttention with the tree BlockMask where flex has a
backward (CUDA); on CPU (torch 2.13 flex has no backward) through the block-sparse tree
attention (`claw_pipelines.train.block_attention`): neither builds a T×T mask.

Each arm runs in a fresh process so its peak RSS is its own. Targets: tree/flat time <=
1.25 × token_ratio; the tree step's peak RSS increase <= 1.5 × the flat step's; no tensor of
T×T or more elements in the tree step (every op's output watched). Prints one JSON line.

Tokens are not the whole cost: each token attends to all its ancestors in both layouts, so
attention work falls by `attention_pairs_ratio` (the shared prompt's pairs are computed
once instead of once per step), not by `token_ratio`; the more of the flat time attention
takes (a narrow model on long contexts: most), the closer the time ratio comes to it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import polars as pl  # noqa: E402

from benchmarks.consume import grpo_lake  # noqa: E402
from benchmarks.harness import emit, reset_peak_rss, status_kib  # noqa: E402
from claw_pipelines.consume.dataset import open_dataset  # noqa: E402
from tests.support.small_qwen2 import small_qwen2  # noqa: E402

TIME_SLACK = 1.25
MEMORY_LIMIT = 1.5
VOCAB = 4096


def rss_mib(field: str) -> float:
    """This process's VmRSS or VmHWM (peak), in MiB."""
    kib = status_kib("self", field)
    if kib is None:
        raise LookupError(field)
    return kib / 1024


# Layer shapes. "qwen2.5-0.5b" is that model's layer (hidden 896, MLP 4864, 14 query heads of
# 64 over 2 key-value heads) with 2 layers and the small vocabulary: the share of attention
# in a training step is a real model's. "narrow" (hidden 128, 4 heads of 32) spends most of
# its time in attention, as no real model at these lengths does.
LAYERS = 2
SHAPES = {
    "qwen2.5-0.5b": {"hidden": 896, "intermediate": 4864, "heads": 14, "kv_heads": 2},
    "narrow": {"hidden": 128, "intermediate": 384, "heads": 4, "kv_heads": 2},
}


def qwen2(attention: str, shape: str):
    """The benchmark's model: LAYERS layers of `SHAPES[shape]` (see `small_qwen2`), training."""
    return small_qwen2(attention, VOCAB, positions=16384, layers=LAYERS, **SHAPES[shape]).train()


def flex_has_backward() -> bool:
    """Whether FlexAttention differentiates on this machine (torch 2.13: not on CPU)."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    q = torch.randn(1, 1, 128, 16, requires_grad=True)
    try:
        flex_attention(q, q, q).sum().backward()
    except NotImplementedError:
        return False
    return True


def tree_step(model, t: dict, attention: dict) -> None:
    """Forward + backward of one tree batch (GRPO-style loss on each token's log-prob)."""
    import torch

    out = model(input_ids=t["input_ids"][None], position_ids=t["position_ids"][None], **attention)
    logp = out.logits[0].log_softmax(-1)[t["parent"].clamp(min=0), t["input_ids"]]
    logp = torch.where(t["parent"] >= 0, logp, torch.zeros_like(logp))
    (-(t["advantages"] * logp).sum()).backward()


def flat_step(model, micro_batches: list[tuple]) -> None:
    """Forward + backward of the flat steps, micro-batch by micro-batch."""
    for ids, positions, weight in micro_batches:
        logits = model(input_ids=ids, position_ids=positions).logits[:, :-1]
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(weight[:, 1:] * logp).sum()).backward()


def flat_micro_batches(steps, budget: int) -> list[tuple]:
    """Right-padded [n, L] micro-batches of at most `budget` padded tokens; `weight` is the
    step's advantage on its response tokens, 0 on prompt and padding."""
    import torch

    batches, current = [], []

    def close() -> None:
        width = max(len(p) + len(r) for p, r, _ in current)
        ids = torch.zeros(len(current), width, dtype=torch.long)
        weight = torch.zeros(len(current), width)
        for row, (prompt, response, advantage) in enumerate(current):
            sequence = torch.tensor(prompt + response)
            ids[row, : len(sequence)] = sequence
            weight[row, len(prompt) : len(sequence)] = advantage
        positions = torch.arange(width)[None].expand(len(current), width)
        batches.append((ids, positions, weight))

    rows = steps.select("prompt_ids", "response_ids", "advantage").rows()
    for prompt, response, advantage in sorted(rows, key=lambda r: len(r[0]) + len(r[1])):
        width = max([len(prompt) + len(response)] + [len(p) + len(r) for p, r, _ in current])
        if current and width * (len(current) + 1) > budget:
            close()
            current = []
        current.append((prompt, response, advantage or 0.0))
    close()
    return batches


class LargestTensor:
    """A dispatch mode that records the largest tensor any op produces (forward and backward)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        watcher = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch

                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.numel() > watcher.elements:
                        watcher.elements, watcher.op = t.numel(), str(func)
                return out

        self.elements, self.op, self._mode = 0, "", Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def run_arm(arm: str, lake_uri: str, rounds: int, shape: str) -> dict:
    """One arm in this process: times, peak RSS increase, and (tree) the largest tensor."""
    import torch

    from claw_pipelines.train.attention import tree_block_mask
    from claw_pipelines.train.block_attention import register_hf_tree_attention, tree_plan

    torch.set_num_threads(2)
    ds = open_dataset("bench", lake_uri)
    batch = next(ds.batches(1, batch_size=1, layout="tree"))  # one prompt group
    t = batch.to_torch()
    tree_tokens = batch.num_tokens
    flex = flex_has_backward()
    if arm == "tree":
        implementation = "flex_attention" if flex else register_hf_tree_attention()
        model = qwen2(implementation, shape)

        def step() -> None:
            mask = (
                {"attention_mask": tree_block_mask(t["subtree_end"])}
                if flex
                else {"tree_plan": tree_plan(t["subtree_end"])}
            )
            tree_step(model, t, mask)
    else:
        implementation = "sdpa"
        model = qwen2("sdpa", shape)
        steps = ds.steps(1).filter(pl.col("step_key").is_in(batch.step_keys))
        micro = flat_micro_batches(steps, tree_tokens)
        flat_tokens = int(
            steps.select(pl.col("prompt_len").sum() + pl.col("response_len").sum()).item()
        )

        def step() -> None:
            flat_step(model, micro)

    times, peaks = [], []
    for _ in range(rounds):
        model.zero_grad(set_to_none=True)
        base = rss_mib("VmRSS")
        reset_peak_rss()
        started = time.perf_counter()
        step()  # the mask or plan is built inside: its cost is the tree arm's
        times.append(time.perf_counter() - started)
        peaks.append(rss_mib("VmHWM") - base)
    result = {
        "attention": implementation,
        "seconds": round(min(times), 3),
        "peak_rss_increase_mib": round(min(peaks), 1),
        "peak_rss_mib": round(rss_mib("VmHWM"), 1),
        "flex_backward": flex,
    }
    if arm == "tree":
        model.zero_grad(set_to_none=True)
        with LargestTensor() as largest:
            step()
        result |= {
            "tree_tokens": tree_tokens,
            "attention_pairs": int((batch.subtree_size).sum()),  # ancestor-or-self pairs
            "largest_tensor_elements": largest.elements,
            "largest_tensor_op": largest.op,
            "dense_mask_elements": tree_tokens * tree_tokens,
        }
    else:
        result |= {
            "flat_tokens": flat_tokens,
            "attention_pairs": int(
                steps.select((pl.col("prompt_len") + pl.col("response_len")).alias("n"))
                .select((pl.col("n") * (pl.col("n") + 1) // 2).sum())
                .item()
            ),  # causal pairs of each step alone
            "padded_tokens": int(sum(ids.numel() for ids, _, _ in micro)),
            "micro_batches": len(micro),
        }
    return result


def spawn_arm(arm: str, lake_uri: str, rounds: int, shape: str) -> dict:
    """`run_arm` in a fresh interpreter; its one JSON line."""
    done = subprocess.run(
        [
            *(sys.executable, __file__, "--arm", arm, "--lake", lake_uri),
            *("--rounds", str(rounds), "--shape", shape),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompt-tokens", type=int, default=4096)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--response-tokens", type=int, default=384, help="per turn")
    parser.add_argument("--rounds", type=int, default=2, help="timed steps per arm (best kept)")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--arm", choices=["tree", "flat"], help=argparse.SUPPRESS)
    parser.add_argument("--lake", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.lake, args.rounds, args.shape)))
        return
    with tempfile.TemporaryDirectory(prefix="claw-bench-tree-attention-") as tmp:
        lake = grpo_lake(
            Path(tmp) / "lake",
            groups=1,
            rollouts=args.rollouts,
            turns=args.turns,
            scale=args.response_tokens,
            vocab=VOCAB,
            prompt_tokens=args.prompt_tokens,
        )
        tree = spawn_arm("tree", lake.uri, args.rounds, args.shape)
        flat = spawn_arm("flat", lake.uri, args.rounds, args.shape)
    token_ratio = tree["tree_tokens"] / flat["flat_tokens"]
    time_ratio = tree["seconds"] / flat["seconds"]
    memory_ratio = tree["peak_rss_increase_mib"] / flat["peak_rss_increase_mib"]
    no_dense = tree["largest_tensor_elements"] < tree["dense_mask_elements"]
    emit(
        "tree_attention",
        target=f"tree/flat step time <= {TIME_SLACK} x the token ratio, peak memory increase "
        f"<= {MEMORY_LIMIT} x flat's, no tensor as large as the dense mask, >= 16,000 tree tokens",
        targets={
            "time_ratio": round(TIME_SLACK * token_ratio, 4),
            "memory_ratio": MEMORY_LIMIT,
            "largest_tensor_elements_below": tree["dense_mask_elements"],
        },
        target_met=time_ratio <= TIME_SLACK * token_ratio
        and memory_ratio <= MEMORY_LIMIT
        and no_dense
        and tree["tree_tokens"] >= 16_000,
        baseline="flat",
        ratio={"time": round(time_ratio, 4), "memory": round(memory_ratio, 3)},
        model={
            "shape": args.shape,
            "layers": LAYERS,
            "vocab": VOCAB,
            **SHAPES[args.shape],
        },
        tree=tree,
        flat=flat,
        token_ratio=round(token_ratio, 4),
        time_ratio=round(time_ratio, 4),
        memory_ratio=round(memory_ratio, 3),
        attention_pairs_ratio=round(tree["attention_pairs"] / flat["attention_pairs"], 4),
        no_dense_mask=no_dense,
    )


if __name__ == "__main__":
    main()

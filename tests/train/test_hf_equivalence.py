"""Tree batches on a real Hugging Face architecture (a small randomly initialised Qwen2:
RoPE, RMSNorm, grouped-query attention; the bundled tokenizer's vocabulary): per-token
log-probs and gradients of one tree forward equal those of the flat steps, through SDPA with
the dense tree mask and through the block-sparse tree attention (no T×T mask), and the
log-probs through FlexAttention with the tree BlockMask (CPU flex has no backward)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from claw_pipelines.tokenization import load_tokenizer  # noqa: E402
from claw_pipelines.train.attention import tree_block_mask  # noqa: E402
from claw_pipelines.train.block_attention import register_hf_tree_attention, tree_plan  # noqa: E402
from tests.support.small_qwen2 import small_qwen2  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"),  # in transformers
]


def qwen2(attention: str) -> torch.nn.Module:
    """Hidden 64, MLP 128, the bundled tokenizer's vocabulary, evaluation mode."""
    vocab = load_tokenizer().get_vocab_size()
    return small_qwen2(attention, vocab, hidden=64, intermediate=128, positions=512).eval()


def picked(logits: torch.Tensor, ids: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """Each token's log-prob, read from its parent's row (0 at a root)."""
    logp = logits.log_softmax(-1)[parent.clamp(min=0), ids]
    return torch.where(parent >= 0, logp, torch.zeros_like(logp))


def tree_logprobs(model, t: dict, mask) -> torch.Tensor:
    """One forward over the whole tree batch."""
    out = model(input_ids=t["input_ids"][None], position_ids=t["position_ids"][None], **mask)
    return picked(out.logits[0], t["input_ids"], t["parent"])


def flat_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """One step alone: its own sequence, causal."""
    out = model(input_ids=ids[None], position_ids=torch.arange(len(ids))[None])
    return picked(out.logits[0], ids, torch.arange(len(ids)) - 1)


@pytest.mark.slow  # ~25 s: the model, and flex compiling its kernel on first use
def test_a_qwen2_tree_forward_and_backward_equal_the_flat_steps(dataset):
    steps = {r["step_key"]: r for r in dataset.steps(1).to_dicts()}
    tree = next(dataset.batches(1, batch_size=100, layout="tree"))
    t = tree.to_torch(dense_mask=True)
    sdpa = qwen2("sdpa")
    dense = {"attention_mask": t["attention_mask"][None, None]}  # True = attend

    def each_step(lp_tree: torch.Tensor):
        for key, index in zip(tree.step_keys, t["step_token_index"], strict=True):
            start = steps[key]["prompt_len"]
            yield key, lp_tree[index][start:], flat_logprobs(sdpa, t["input_ids"][index])[start:]

    with torch.no_grad():
        lp = tree_logprobs(sdpa, t, dense)
        worst = max((a - b).abs().max().item() for _, a, b in each_step(lp))
        assert worst <= 1e-4
        flex_lp = tree_logprobs(
            qwen2("flex_attention"), t, {"attention_mask": tree_block_mask(t["subtree_end"])}
        )
    trained = t["loss_mask"]
    torch.testing.assert_close(flex_lp[trained], lp[trained], rtol=0, atol=1e-4)

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        sdpa.zero_grad()
        loss.backward()
        return [p.grad.detach().clone() for p in sdpa.parameters()]

    tree_grads = grads(-(t["advantages"] * tree_logprobs(sdpa, t, dense)).sum())
    flat_loss = sum(
        -steps[key]["advantage"] * alone.sum()
        for key, _, alone in each_step(torch.zeros(tree.num_tokens))
    )
    flat_grads = grads(flat_loss)
    for a, b in zip(tree_grads, flat_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    # the CPU training path: block-sparse tree attention, no T×T mask, same log-probs and grads
    block = qwen2(register_hf_tree_attention())
    plan = {"tree_plan": tree_plan(t["subtree_end"], block=16)}
    block_lp = tree_logprobs(block, t, plan)
    torch.testing.assert_close(block_lp[trained], lp[trained].detach(), rtol=0, atol=1e-4)
    block.zero_grad()
    (-(t["advantages"] * block_lp).sum()).backward()
    for p, b in zip(block.parameters(), flat_grads, strict=True):
        torch.testing.assert_close(p.grad, b, rtol=1e-4, atol=1e-6)

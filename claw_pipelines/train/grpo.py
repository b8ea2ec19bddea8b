"""GRPO on tree batches for a Hugging Face causal LM, through the block-sparse tree attention
(`claw_tree`: the CPU path with a backward pass), with a truncated importance-sampling
correction between the behaviour policy (the one that sampled) and the trained one.

```python
trainer = TreeGRPO(checkpoint_folder)            # the served checkpoint: same weights, same
batch = ds.next_batch(4, consumer="run-1")       # sampling distribution (generation config)
report = trainer.step(batch)                     # one optimizer step; report.line()
trainer.save(next_folder)                        # a folder `transformers serve` can load
```

Per trained token t (the batch's `loss_mask`), read from its parent's row:
`logp_t = log softmax(logits / temperature + support)`, where `support` is -inf on the tokens
the generation config suppresses: the trainer's log-probs are those of the distribution the
server sampled from. The loss is `-sum_t w_t * A_t * logp_t / steps` with `A_t` the batch's
advantages (GRPO's group-normalized ones, summed over the steps sharing the token) and
`w_t = min(exp(logp_t - behaviour_t), IS_CAP)` (detached: truncated IS). The behaviour
log-probs come from the batch where it carries them (`Batch.behaviour_log_probs` and
`Batch.has_behaviour_log_probs`, see `behaviour_log_probs`); a server that returns none
(`transformers serve`) leaves `w_t = 1`: the update is then the on-policy one, exact only
for steps of the trainer's own version, and the report says so. With `updates_per_step`
= mu > 1 (GRPO's iterations), the updates after the first minimize `-sum_t w_t min(r_t A_t,
clip(r_t, 1 - CLIP, 1 + CLIP) A_t) / steps`, `r_t` the ratio of the current log-prob to the
one the step started from.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from claw_pipelines.consume.batch import Batch
from claw_pipelines.train.block_attention import register_hf_tree_attention, tree_plan

IS_CAP = 2.0  # truncated importance sampling: ratios above this weigh this much
CLIP = 0.2  # PPO's clip of the ratio to the step's starting policy (updates after the first)
BAND = (0.8, 1.25)  # mismatch report: the share of ratios outside this band


def behaviour_log_probs(batch: Batch) -> tuple[np.ndarray, np.ndarray] | None:
    """(log-probs, present) per packed token: the behaviour policy's log-probs as the batch
    carries them (`behaviour_log_probs`, `has_behaviour_log_probs`), or None when it carries
    none for any trained token (the server returned no log-probs)."""
    captured = batch.has_behaviour_log_probs
    if len(captured) != len(batch.loss_mask):  # a batch built without them
        return None
    present = captured & batch.loss_mask.astype(bool)
    if not present.any():
        return None
    return batch.behaviour_log_probs.astype(np.float32, copy=False), present


@dataclass(frozen=True)
class StepReport:
    """One optimizer step: its loss, what it trained on and the behaviour/trainer mismatch
    (None when the batch carried no behaviour log-probs: every ratio was 1)."""

    loss: float
    steps: int
    trained_tokens: int
    log_probs: np.ndarray  # float32 per packed token: the trainer's, before the update (0 off)
    behaviour_tokens: int  # trained tokens with a behaviour log-prob
    mean_abs_diff: float | None = None  # mean |trainer - behaviour|
    kl_k1: float | None = None  # mean (behaviour - trainer): KL(behaviour || trainer), k1
    kl_k3: float | None = None  # mean (ratio - 1 - log ratio), k3
    outside_band: float | None = None  # share of ratios outside BAND
    truncated: float | None = None  # share of ratios above IS_CAP

    def line(self) -> str:
        """The step as one line."""
        if self.mean_abs_diff is None:
            mismatch = "no behaviour log-probs: IS ratio 1 (on-policy)"
        else:
            mismatch = (
                f"|Δlogp| {self.mean_abs_diff:.4f}, k3 {self.kl_k3:.5f}, "
                f"{self.outside_band:.1%} outside {BAND}, {self.truncated:.1%} truncated"
            )
        return f"loss {self.loss:.4f} on {self.trained_tokens} tokens; {mismatch}"


class TreeGRPO:
    """A causal LM loaded from a checkpoint folder, trained with GRPO on tree batches through
    the `claw_tree` attention; `save` writes the next checkpoint folder."""

    def __init__(
        self,
        folder: Path,
        lr: float = 1e-2,
        seed: int = 0,
        threads: int | None = None,
        is_cap: float = IS_CAP,
        updates_per_step: int = 1,
        clip: float = CLIP,
    ) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.source = Path(folder)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), attn_implementation=register_hf_tree_attention(), dtype=torch.float32
        )
        self.model.train()
        self.generation = GenerationConfig.from_pretrained(str(folder))
        vocab = self.model.config.vocab_size
        self.support = torch.zeros(vocab)
        suppressed = list(self.generation.suppress_tokens or ())
        self.support[suppressed] = float("-inf")
        self.temperature = float(self.generation.temperature or 1.0)
        self.is_cap = is_cap
        if updates_per_step < 1:
            raise ValueError(f"updates_per_step must be at least 1, not {updates_per_step}")
        self.updates_per_step, self.clip = updates_per_step, clip
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.updates = 0

    def token_log_probs(self, t: dict[str, Any]) -> torch.Tensor:
        """Log-probs [T] of each token given its path (0 at roots), as the server samples:
        temperature and suppressed tokens applied. Differentiable."""
        plan = tree_plan(t["subtree_end"])
        out = self.model(
            input_ids=t["input_ids"][None], position_ids=t["position_ids"][None], tree_plan=plan
        )
        parent = t["parent"]
        has_parent = parent >= 0
        rows = out.logits[0][parent.clamp(min=0)] / self.temperature + self.support
        picked = rows.log_softmax(-1).gather(-1, t["input_ids"][:, None])[:, 0]
        return torch.where(has_parent, picked, torch.zeros_like(picked))

    def step(self, batch: Batch) -> StepReport:
        """One GRPO step on `batch` (see the module doc): `updates_per_step` optimizer
        updates, the first the plain truncated-IS one, the others PPO's clipped surrogate
        against the log-probs the step started from (GRPO's mu iterations)."""
        if batch.layout != "tree":
            raise ValueError(f"batch: TreeGRPO trains on tree batches, not {batch.layout!r}")
        t = batch.to_torch()
        trained = t["loss_mask"]
        advantages = t["advantages"]
        steps = max(1, len(batch.step_keys))
        logp = self.token_log_probs(t)
        before = logp.detach()
        weight, figures = self._weights(batch, before, trained)
        loss = -(weight * advantages * logp)[trained].sum() / steps
        self._update(loss)
        for _ in range(self.updates_per_step - 1):
            # the ratio where trained only: untrained tokens may be -inf on both sides
            moved = torch.where(trained, self.token_log_probs(t) - before, 0.0)
            ratio = moved.exp()
            clipped = ratio.clamp(1 - self.clip, 1 + self.clip)
            surrogate = torch.minimum(ratio * advantages, clipped * advantages)
            self._update(-(weight * surrogate)[trained].sum() / steps)
        kept = torch.where(trained, before, torch.zeros_like(before)).numpy()
        return StepReport(
            loss=float(loss.detach()),
            steps=len(batch.step_keys),
            trained_tokens=int(trained.sum()),
            log_probs=kept.astype(np.float32),
            **figures,
        )

    def _update(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.updates += 1

    def _weights(
        self, batch: Batch, logp: torch.Tensor, trained: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Per token the truncated IS weight (1 where no behaviour log-prob), and the
        mismatch figures over the trained tokens that have one."""
        found = behaviour_log_probs(batch)
        if found is None:
            return torch.ones_like(logp), {"behaviour_tokens": 0}
        values, present = found
        has = torch.from_numpy(present) & trained
        behaviour = torch.from_numpy(values)
        log_ratio = torch.where(has, logp - behaviour, torch.zeros_like(logp))
        ratio = log_ratio.exp()
        weight = torch.where(has, ratio.clamp(max=self.is_cap), torch.ones_like(ratio))
        d, r = log_ratio[has].double(), ratio[has].double()
        figures = {
            "behaviour_tokens": int(has.sum()),
            "mean_abs_diff": float(d.abs().mean()),
            "kl_k1": float((-d).mean()),
            "kl_k3": float((r - 1 - d).mean()),
            "outside_band": float(((r < BAND[0]) | (r > BAND[1])).double().mean()),
            "truncated": float((r > self.is_cap).double().mean()),
        }
        return weight, figures

    def save(self, folder: Path) -> Path:
        """The current weights as a checkpoint folder a server loads (`save_pretrained`, the
        source folder's generation config kept, its tokenizer files copied); returns it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(folder))  # config.json names no attention: servers pick
        for path in self.source.iterdir():  # the tokenizer's files: what save_pretrained left
            if path.is_file() and not (folder / path.name).exists():
                shutil.copy2(path, folder / path.name)
        return folder

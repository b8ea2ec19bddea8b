"""GRPO on tree batches (`claw_pipelines.train.grpo`) for a served checkpoint: the trainer's
log-probs through the tree attention are those of the distribution the server samples from
(the generation config's suppressed tokens masked), equal to the plain model's per step; a
step raises the advantage-weighted log-likelihood; the truncated IS weights and the mismatch
figures follow the behaviour log-probs a batch carries (the seam: `behaviour_log_probs`,
`has_behaviour_log_probs`), and without them every weight is 1; a saved checkpoint loads
as a server loads it, with the same weights and tokenizer."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from claw_pipelines.consume.dataset import open_dataset  # noqa: E402
from claw_pipelines.contracts.specs import CurationSpec  # noqa: E402
from claw_pipelines.lake.delta import Lake  # noqa: E402
from claw_pipelines.materialize.gold import build_partition  # noqa: E402
from claw_pipelines.materialize.silver import build_silver  # noqa: E402
from claw_pipelines.simulation.model_folders import sampled_ids, word_policy_folder  # noqa: E402
from claw_pipelines.train.grpo import IS_CAP, TreeGRPO  # noqa: E402
from tests.support.lakes import completion, land, step  # noqa: E402

RETURNS = [1.0, 0.0, 0.5, 0.25]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A word policy's first checkpoint (32 words, 6 per reply)."""
    return word_policy_folder(tmp_path_factory.mktemp("policy") / "v1", words=32, seed=0)


@pytest.fixture(scope="module")
def batch(policy, tmp_path_factory):
    """Two GRPO groups of four replies of the policy's words (two share their first word),
    as one tree batch; no behaviour log-probs, as from a server that returns none."""
    chat = transformers.AutoTokenizer.from_pretrained(str(policy))
    words = sampled_ids(policy)
    rng = np.random.default_rng(0)
    rows = []
    for g in range(2):
        question = [{"role": "user", "content": f"Say something, {g}."}]
        prompt = list(
            chat.apply_chat_template(question, add_generation_prompt=True, return_dict=False)
        )
        opening = int(rng.choice(words))
        for r, value in enumerate(RETURNS):
            reply = rng.choice(words, 6).tolist()
            reply[0] = opening if r < 2 else reply[0]
            row = step(f"g{g}-r{r}", 0, prompt, reply, group=f"g{g}")
            rows += [row | {"rollout_log_probs": None}, completion(f"g{g}-r{r}", value)]
    lake = Lake(str(tmp_path_factory.mktemp("grpo") / "lake"))
    land(lake, rows)
    build_silver(lake)
    spec = CurationSpec(
        name="words", reward_status=["final"], merge="prompt_group", advantage="grpo"
    )
    build_partition(lake, spec, 1)
    return next(open_dataset("words", lake.uri).batches(1, batch_size=100, layout="tree"))


def objective(trainer: TreeGRPO, batch) -> float:
    """The advantage-weighted log-likelihood of the batch's trained tokens."""
    t = batch.to_torch()
    with torch.no_grad():
        logp = trainer.token_log_probs(t)
    return float((t["advantages"] * logp)[t["loss_mask"]].sum())


def test_tree_log_probs_are_the_served_distributions_per_step(policy, batch):
    trainer = TreeGRPO(policy)
    t = batch.to_torch()
    with torch.no_grad():
        tree = trainer.token_log_probs(t)
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        str(policy), attn_implementation="sdpa"
    )
    support = torch.full((plain.config.vocab_size,), float("-inf"))
    support[sampled_ids(policy)] = 0.0
    assert batch.num_tokens < sum(len(i) for i in t["step_token_index"])  # prompts merged
    for index in t["step_token_index"]:
        ids = t["input_ids"][index]
        with torch.no_grad():
            logits = plain(input_ids=ids[None]).logits[0, :-1] + support
        alone = logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
        trained = t["loss_mask"][index][1:]
        assert trained.sum() == 6
        torch.testing.assert_close(tree[index][1:][trained], alone[trained], rtol=0, atol=1e-4)
        assert torch.isfinite(alone[trained]).all()  # every reply token is in the support


def test_a_step_raises_the_advantage_weighted_likelihood(policy, batch):
    trainer = TreeGRPO(policy, lr=1e-2)
    before = objective(trainer, batch)
    report = trainer.step(batch)
    assert report.steps == 8 and report.trained_tokens == int(batch.loss_mask.sum())
    assert report.behaviour_tokens == 0 and report.mean_abs_diff is None
    assert "IS ratio 1 (on-policy)" in report.line()
    assert objective(trainer, batch) > before


def test_more_updates_per_step_start_alike_and_stay_within_the_clip(policy, batch):
    one = TreeGRPO(policy, lr=1e-2, seed=0)
    several = TreeGRPO(policy, lr=1e-2, seed=0, updates_per_step=4, clip=0.2)
    start = objective(one, batch)
    first, report = one.step(batch), several.step(batch)
    # the step's first update is the single-update step: same loss, same starting log-probs
    assert report.loss == pytest.approx(first.loss, rel=1e-6)
    np.testing.assert_array_equal(report.log_probs, first.log_probs)
    assert several.updates == 4 and one.updates == 1
    assert objective(several, batch) > objective(one, batch) > start
    # the clip holds the later updates near the step's start: without it they go further
    unclipped = TreeGRPO(policy, lr=1e-2, seed=0, updates_per_step=4, clip=1e6)
    unclipped.step(batch)
    t = batch.to_torch()
    start_logp = torch.from_numpy(report.log_probs)[t["loss_mask"]]

    def moved(trainer: TreeGRPO) -> float:
        with torch.no_grad():
            logp = trainer.token_log_probs(t)[t["loss_mask"]]
        assert torch.isfinite(logp).all()
        return float((logp - start_logp).abs().mean())

    assert moved(several) < moved(unclipped)
    with pytest.raises(ValueError, match="updates_per_step"):
        TreeGRPO(policy, updates_per_step=0)


def with_behaviour(batch, log_probs: np.ndarray):
    """The batch carrying `log_probs` as its behaviour log-probs on its trained tokens."""
    carried = copy.copy(batch)
    carried.behaviour_log_probs = log_probs.astype(np.float32)
    carried.has_behaviour_log_probs = batch.loss_mask.astype(bool)
    return carried


def test_truncated_is_weights_follow_the_behaviour_log_probs(policy, batch):
    on_policy = TreeGRPO(policy).step(batch)
    same = TreeGRPO(policy).step(with_behaviour(batch, on_policy.log_probs))
    assert same.behaviour_tokens == on_policy.trained_tokens
    assert same.mean_abs_diff < 1e-5 and abs(same.kl_k3) < 1e-8
    assert same.outside_band == 0 and same.truncated == 0
    assert same.loss == pytest.approx(on_policy.loss, rel=1e-5)
    # a behaviour policy three times less likely than the trainer: every ratio is 3,
    # truncated to IS_CAP, so the loss is IS_CAP times the on-policy one
    lower = TreeGRPO(policy).step(with_behaviour(batch, on_policy.log_probs - math.log(3)))
    assert lower.truncated == 1 and lower.outside_band == 1
    assert lower.kl_k1 == pytest.approx(-math.log(3), abs=1e-5)
    assert lower.kl_k3 == pytest.approx(3 - 1 - math.log(3), abs=1e-4)
    assert lower.loss == pytest.approx(IS_CAP * on_policy.loss, rel=1e-4)
    assert "truncated" in lower.line()


def test_a_saved_checkpoint_loads_as_a_server_loads_it(policy, batch, tmp_path):
    trainer = TreeGRPO(policy, lr=1e-2)
    trainer.step(batch)
    saved = trainer.save(tmp_path / "v2")
    config = json.loads((saved / "config.json").read_text())
    assert "claw_tree" not in json.dumps(config)  # a server without it loads the folder
    kept = json.loads((saved / "generation_config.json").read_text())
    assert (
        kept["suppress_tokens"]
        == json.loads((policy / "generation_config.json").read_text())["suppress_tokens"]
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (saved / name).read_bytes() == (policy / name).read_bytes()
    loaded = TreeGRPO(saved)
    assert objective(loaded, batch) == pytest.approx(objective(trainer, batch), abs=1e-4)
    served = transformers.AutoModelForCausalLM.from_pretrained(str(saved))
    for mine, theirs in zip(trainer.model.parameters(), served.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)

"""Per-token policy versions in batches (tree and flat layouts, `to_torch()`), and staleness
judged per step or per token: a partial rollout joined across a policy bump carries the
version of each of its tokens; with `staleness: token` the tokens older than the floor are
masked out of the loss (offline and live alike, and replayed the same), with `staleness:
step` the whole step is left out; the waste ledger counts the masked tokens."""

from __future__ import annotations

import shutil

import numpy as np
import polars as pl
import pytest

from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import GOLD_CONSUMPTION, gold_rejection_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import publish_policy_version
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.ops.ledger import waste_ledger
from tests.support.lakes import completion, land, partial_rollout, step

PROMPT = [3, 4, 5, 6]
FIRST, REST = [40, 41, 42], [50, 51]  # the partial reply (v1), its continuation (v2)


def spec(name: str, staleness: str) -> CurationSpec:
    return CurationSpec(
        name=name,
        reward_status=["final", "missing"],
        merge="prompt_group",
        advantage="grpo",
        max_policy_staleness=1,
        staleness=staleness,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> Lake:
    """A group of three rollouts finished under policy 2, one of them begun under policy 1,
    aborted by the bump and resumed (joined in silver); datasets `tok` and `stp` over it."""
    lake = Lake(str(tmp_path_factory.mktemp("versions") / "lake"))
    rows = partial_rollout("g-r0", PROMPT, [FIRST, REST], [1, 2], group="g")
    rows += [step(f"g-r{n}", 0, PROMPT, [60 + n, 61], group="g", version=2) for n in (1, 2)]
    rows += [completion(f"g-r{n}", value) for n, value in enumerate([1.0, 0.0, 0.5])]
    land(lake, rows)
    build_silver(lake)
    for made in (spec("tok", "token"), spec("stp", "step")):
        save_spec(lake, made)
        build_partition(lake, made, 2)
    return lake


def versions_of(batch, key: str) -> list[int]:
    index = batch.step_keys.index(key)
    return batch.token_policy_versions[batch.step_token_index[index]].tolist()


@pytest.mark.parametrize("layout", ["tree", "flat"])
def test_batches_carry_each_tokens_policy_version(lake, layout):
    (batch,) = open_dataset("tok", lake.uri).batches(2, batch_size=8, layout=layout)
    assert len(batch.token_policy_versions) == batch.num_tokens
    prompt = [-1] * len(PROMPT)  # tokens no step generated
    assert versions_of(batch, "g-r0:1") == prompt + [1] * len(FIRST) + [2] * len(REST)
    assert versions_of(batch, "g-r1:0") == [*prompt, 2, 2]
    generated = batch.token_policy_versions >= 0
    assert (batch.loss_mask.astype(bool) == generated).all()  # nothing stale yet: all trained
    tensors = batch.to_torch()
    assert tensors["token_policy_versions"].tolist() == batch.token_policy_versions.tolist()
    assert str(tensors["token_policy_versions"].dtype) == "torch.int64"
    assert batch.token_policy_versions.dtype == np.int32  # as input_ids; int64 in torch


def test_token_versions_can_be_left_out(lake):
    ds = open_dataset("tok", lake.uri)
    ds.token_versions = False
    (batch,) = ds.batches(2, batch_size=8)
    assert batch.token_policy_versions.size == 0 and batch.num_tokens > 0
    assert batch.to_torch()["token_policy_versions"].numel() == 0


def test_token_staleness_masks_old_tokens_where_step_staleness_drops_the_step(lake, tmp_path):
    stale = Lake(str(tmp_path / "stale"))
    shutil.copytree(lake.uri, stale.uri)
    publish_policy_version(stale, 3)  # the floor is now 2: policy 1's tokens are stale
    for name, staleness in (("tok", "token"), ("stp", "step")):
        build_partition(stale, spec(name, staleness), 2)
    rejected = stale.read(gold_rejection_table("stp")).select("step_key", "reason").rows()
    assert rejected == [("g-r0:1", "stale")]  # step: its oldest token decides
    assert "g-r0:1" not in open_dataset("stp", stale.uri).steps(2)["step_key"].to_list()

    ds = open_dataset("tok", stale.uri)
    assert "g-r0:1" in ds.steps(2)["step_key"].to_list()  # token: the step stays
    (offline,) = ds.batches(2, batch_size=8, layout="flat")
    live = open_dataset("tok", stale.uri).next_batch(1, consumer="trainer", timeout=0)
    assert live is not None
    for batch in (offline, live):
        tokens = batch.step_token_index[batch.step_keys.index("g-r0:1")]
        response = tokens[len(PROMPT) :]
        old, new = response[: len(FIRST)], response[len(FIRST) :]
        assert batch.loss_mask[old].tolist() == [0] * len(FIRST)  # masked out of the loss
        assert batch.advantages[old].tolist() == [0.0] * len(FIRST)
        assert batch.loss_mask[new].tolist() == [1] * len(REST)
        assert batch.token_policy_versions[response].tolist() == [1, 1, 1, 2, 2]
    record = stale.read(GOLD_CONSUMPTION).filter(pl.col("kind") == "next")
    assert record["token_floor"].to_list() == [2]
    (again,) = open_dataset("tok", stale.uri).replay("trainer")
    assert np.array_equal(again.loss_mask, live.loss_mask)

    ledger = waste_ledger(stale, ["tok"]).filter(pl.col("outcome") == "masked")
    assert ledger.select("policy_version", "reason", "steps", "generated_tokens").rows() == [
        (2, "stale", 1, len(FIRST))
    ]

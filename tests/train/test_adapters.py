"""Adapters: verl's DataProto fields, TRL-style records and a DDP-aware IterableDataset,
checked against the gold steps they come from."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

torch = pytest.importorskip("torch")

from claw_pipelines.consume.dataset import open_dataset  # noqa: E402
from claw_pipelines.train.adapters import BatchDataset, trl_records, verl_batch  # noqa: E402
from tests.support.lakes import behaviour_lake  # noqa: E402
from tests.support.real_servers import import_or_skip  # noqa: E402


def test_verl_batch_holds_each_step_exactly_padded_as_verl_expects(lake):
    steps = open_dataset("train", lake.uri).steps(1)
    out = verl_batch(steps, pad_id=0)
    t, uid = out["tensors"], out["non_tensors"]["uid"]
    rows = steps.to_dicts()
    width_p = max(len(r["prompt_ids"]) for r in rows)
    assert t["prompts"].shape == (len(rows), width_p)
    assert t["input_ids"].shape[1] == width_p + t["responses"].shape[1]
    for i, row in enumerate(rows):
        real = t["attention_mask"][i].bool()
        assert t["input_ids"][i][real].tolist() == row["prompt_ids"] + row["response_ids"]
        assert t["prompts"][i, width_p - len(row["prompt_ids"]) :].tolist() == row["prompt_ids"]
        assert t["position_ids"][i][real].tolist() == list(range(int(real.sum())))
        n = len(row["response_ids"])
        mask = row["response_mask"] or [1] * n
        assert t["response_mask"][i, :n].tolist() == mask and t["response_mask"][i, n:].sum() == 0
        rewards = t["token_level_rewards"][i]
        if n:
            assert rewards[n - 1].item() == pytest.approx(row["reward"] or 0.0)
            assert rewards.abs().sum().item() == pytest.approx(abs(row["reward"] or 0.0))
        if row["rollout_log_probs"] is not None:
            expected = np.array(row["rollout_log_probs"], np.float32)
            assert np.allclose(t["old_log_probs"][i, :n].numpy(), expected)
        assert uid[i] == (row["prompt_uid"] or row["trajectory_uid"])
    assert out["non_tensors"]["step_key"].tolist() == steps["step_key"].to_list()
    assert out["meta_info"]["policy_versions"] == [1]


def test_trl_records_are_the_steps(lake):
    steps = open_dataset("train", lake.uri).steps(1)
    records = trl_records(steps)
    assert [r["step_key"] for r in records] == steps["step_key"].to_list()
    assert [r["completion_ids"] for r in records] == steps["response_ids"].to_list()
    assert [r["prompt_ids"] for r in records] == steps["prompt_ids"].to_list()


def test_packed_batches_carry_the_behaviour_log_probs_verl_and_trl_get(tmp_path):
    ds = open_dataset("behaviour", behaviour_lake(tmp_path / "lake").uri)
    steps = ds.steps(1)
    verl = verl_batch(steps)["tensors"]["old_log_probs"]
    trl = {r["step_key"]: r["old_per_token_logps"] for r in trl_records(steps)}
    row_of = {key: i for i, key in enumerate(steps["step_key"])}
    prompt_len = dict(zip(steps["step_key"], steps["prompt_len"], strict=True))
    seen = 0
    for t in BatchDataset(ds, 1, batch_size=6, layout="flat"):
        for key, index in zip(t["step_keys"], t["step_token_index"], strict=True):
            response = index[prompt_len[key] :]
            old, mask = t["old_log_probs"][response], t["old_log_probs_mask"][response]
            assert torch.equal(old, verl[row_of[key], : len(response)])
            assert bool(mask.all()) == (trl[key] is not None) == bool(mask.any())
            if trl[key] is not None:
                assert np.allclose(old.numpy(), np.array(trl[key], np.float32))
            seen += 1
    assert seen == steps.height and any(v is None for v in trl.values())


def test_the_iterable_dataset_gives_every_batch_once_across_ranks_and_workers(lake):
    ds = open_dataset("train", lake.uri)
    everything = [b.step_keys for b in ds.batches(1, batch_size=1)]
    assert len(everything) >= 3

    def taken(rank: int, world: int, workers: int = 0) -> dict[int, list[str]]:
        source = BatchDataset(ds, 1, batch_size=1, rank=rank, world_size=world)
        loader = torch.utils.data.DataLoader(
            source,
            batch_size=None,
            num_workers=workers,
            multiprocessing_context="spawn" if workers else None,
        )
        return {t["batch_index"]: t["step_keys"] for t in loader if not t["repeated"]}

    ranks = [taken(0, 2), taken(1, 2)]
    assert not ranks[0].keys() & ranks[1].keys()
    merged = ranks[0] | ranks[1]
    assert [merged[i] for i in range(len(everything))] == everything
    assert taken(0, 2, workers=2) == ranks[0]  # workers split a rank's share, not repeat it
    single = taken(0, 1)
    assert [single[i] for i in range(len(everything))] == everything


def test_verl_takes_the_batch_as_its_own_dataproto_and_agrees_on_grpo_advantages(lake):
    """Against verl itself where it is installed (it imports on CPU): DataProto.from_dict
    accepts the fields, and verl's GRPO outcome advantage over them equals the gold
    dataset's, one step per trajectory (the last turns, which carry the outcome reward)."""
    verl = import_or_skip("verl")
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    steps = open_dataset("train", lake.uri).steps(1)
    steps = steps.filter(pl.col("step_index") == pl.col("step_index").max().over("trajectory_uid"))
    batch = verl.DataProto.from_dict(**verl_batch(steps))
    assert len(batch) == steps.height
    assert batch.batch["input_ids"].shape[1] == batch.batch["attention_mask"].shape[1]
    advantages, _ = compute_grpo_outcome_advantage(
        batch.batch["token_level_rewards"],
        batch.batch["response_mask"],
        batch.non_tensor_batch["uid"],
    )
    first_token = advantages[:, 0].numpy()
    assert np.allclose(first_token, steps["advantage"].to_numpy(), atol=1e-5)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("uneven", ["repeat", "drop"])
def test_every_rank_gets_as_many_batches_and_every_group_goes_once(lake, world, uneven):
    """Equal counts per rank (a DDP all-reduce never waits on a rank that ran out): the
    last ranks repeat the first batches (marked), or the last n mod w batches are dropped."""
    ds = open_dataset("train", lake.uri)
    everything = [b.step_keys for b in ds.batches(1, batch_size=1)]
    n = len(everything)
    assert n % 2 or n % 3  # at least one of the two worlds leaves batches over
    got = [
        list(BatchDataset(ds, 1, batch_size=1, rank=r, world_size=world, uneven=uneven))
        for r in range(world)
    ]
    expected = -(-n // world) if uneven == "repeat" else n // world
    assert [len(share) for share in got] == [expected] * world
    first = [t for share in got for t in share if not t["repeated"]]
    kept = n if uneven == "repeat" else n - n % world
    assert sorted(t["batch_index"] for t in first) == list(range(kept))  # each once
    assert sorted(k for t in first for k in t["step_keys"]) == sorted(
        k for keys in everything[:kept] for k in keys
    )
    again = [t["batch_index"] for share in got for t in share if t["repeated"]]
    assert again == list(range(expected * world - n)) if uneven == "repeat" else not again


def same_tensors(got: dict, want: dict) -> None:
    """Two `to_torch()` dicts hold the same batch: token ids, tree, weights, step indices."""
    assert got["step_keys"] == want["step_keys"]
    for name in ("input_ids", "parent", "position_ids", "loss_mask", "token_rewards"):
        assert torch.equal(got[name], want[name]), name
    for name in ("advantages", "subtree_end", "tree_offsets"):
        assert torch.equal(got[name], want[name]), name
    assert len(got["step_token_index"]) == len(want["step_token_index"])
    for a, b in zip(got["step_token_index"], want["step_token_index"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("uneven", ["repeat", "drop"])
@pytest.mark.parametrize(
    "sizing",
    [{"batch_size": 1}, {"max_tokens": 1, "seed": 7}, {"max_tokens": 1, "layout": "flat"}],
    ids=["steps", "tokens-seeded", "tokens-flat"],
)
def test_each_rank_packs_only_its_share_and_its_batches_are_those_batches_gives(
    lake,
    world,
    uneven,
    sizing,
):
    """Every rank plans the same batches (no tokens read) and packs only those it yields:
    the plan's packed-steps count is its share's steps, less than the partition's; each
    batch equals, tensor for tensor, the one `Dataset.batches` gives at that index; counts
    per rank are equal and every group is delivered once (drop: at most once)."""
    ds = open_dataset("train", lake.uri)
    everything = {i: b.to_torch() for i, b in enumerate(ds.batches(1, **sizing))}
    n, partition = len(everything), ds.steps(1).height
    assert n >= 3
    shares = []
    for rank in range(world):
        source = BatchDataset(ds, 1, rank=rank, world_size=world, uneven=uneven, **sizing)
        share = list(source)
        shares.append(share)
        held = {t["batch_index"] for t in share}
        assert source.plan.packed_steps == sum(len(everything[i]["step_keys"]) for i in held)
        assert source.plan.packed_steps < partition  # not the whole partition
        for tensors in share:
            same_tensors(tensors, everything[tensors["batch_index"]])
    expected = -(-n // world) if uneven == "repeat" else n // world
    assert [len(share) for share in shares] == [expected] * world
    delivered = sorted(t["batch_index"] for share in shares for t in share if not t["repeated"])
    assert delivered == list(range(n if uneven == "repeat" else n - n % world))
    groups = [g for share in shares for t in share if not t["repeated"] for g in t["step_keys"]]
    assert len(groups) == len(set(groups))  # no step twice, unless marked repeated
    repeats = [t["batch_index"] for share in shares for t in share if t["repeated"]]
    assert repeats == (list(range(expected * world - n)) if uneven == "repeat" else [])

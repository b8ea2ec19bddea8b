"""The consumption API on a real gold dataset: batches, their fields, the attention mask,
reproducible order, the consumption log and resuming, time travel, exports."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from claw_pipelines.consume.dataset import open_dataset, subtree_ends
from claw_pipelines.contracts.tables import GOLD_CONSUMPTION, gold_dataset_spec, gold_tree_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import TRAIN_SPEC as SPEC
from tests.support.lakes import group_of, land
from tests.support.servers import REPO
from tests.support.trees import ancestors_brute_force


def sequences(lake: Lake) -> dict[str, list[int]]:
    steps = open_dataset("train", lake.uri).steps()
    return {
        k: p + r for k, p, r in steps.select("step_key", "prompt_ids", "response_ids").iter_rows()
    }


def test_open_dataset_versions_partitions_and_steps(lake):
    ds = open_dataset("train", lake_uri=lake.uri)
    assert ds.version == lake.version("gold/datasets/train")
    assert ds.policy_versions() == [1, 2]
    assert ds.steps(1).height == 27 and set(ds.steps(1)["policy_version"]) == {1}
    assert ds.steps().height == 54
    with pytest.raises(LookupError, match="no gold dataset 'nope'"):
        open_dataset("nope", lake_uri=lake.uri)


@pytest.mark.parametrize("layout", ["tree", "flat"])
def test_batches_keep_trees_whole_count_steps_and_carry_exact_sequences(lake, layout):
    ds, full = open_dataset("train", lake.uri), sequences(lake)
    batches = list(ds.batches(1, batch_size=10, layout=layout))
    taken = [k for b in batches for k in b.step_keys]
    assert sorted(taken) == sorted(ds.steps(1)["step_key"])  # every step once
    groups = [{k.split("-")[0] for k in b.step_keys} for b in batches]
    assert all(len(b.step_keys) <= 10 for b in batches)  # groups of 9 steps: one per batch
    assert sum(len(g) for g in groups) == len(set().union(*groups))  # no group split
    for batch in batches:
        assert batch.input_ids.dtype == np.int32 and batch.parent.dtype == np.int32
        for key, index in zip(batch.step_keys, batch.step_token_index, strict=True):
            assert batch.input_ids[index].tolist() == full[key]
            assert batch.parent[index[0]] == -1 and (batch.parent[index[1:]] == index[:-1]).all()
            assert (batch.position_ids[index] == np.arange(len(index))).all()
        assert (batch.attention_mask() == ancestors_brute_force(batch.parent)).all()


def test_tree_and_flat_carry_the_same_training_signal(lake):
    ds = open_dataset("train", lake.uri)
    tree = next(ds.batches(2, batch_size=9, layout="tree"))
    flat = next(ds.batches(2, batch_size=9, layout="flat"))
    assert tree.step_keys == flat.step_keys
    assert tree.num_tokens < flat.num_tokens  # the shared prompt and turns are stored once
    steps = ds.steps(2).filter(pl.col("step_key").is_in(tree.step_keys))
    assert tree.advantages.sum() == pytest.approx(flat.advantages.sum(), abs=1e-5)
    assert tree.token_rewards.sum() == pytest.approx(steps["reward"].fill_null(0).sum())
    for key, t_index, f_index in zip(
        tree.step_keys, tree.step_token_index, flat.step_token_index, strict=True
    ):
        assert (tree.position_ids[t_index] == flat.position_ids[f_index]).all()
        trained = flat.loss_mask[f_index].astype(bool)
        assert tree.loss_mask[t_index][trained].all(), key


def test_a_seed_fixes_the_order(lake):
    ds = open_dataset("train", lake.uri)
    order = lambda seed: [b.step_keys for b in ds.batches(1, 9, seed=seed)]  # noqa: E731
    assert order(5) == order(5)
    assert sorted(map(tuple, order(5))) == sorted(map(tuple, order(6)))
    assert any(order(s) != order(5) for s in range(6, 12))


def test_consumption_is_logged_and_a_run_resumes_without_repeats(lake):
    ds = open_dataset("train", lake.uri)
    before = lake.read("gold/datasets/train").height
    first = next(ds.batches(1, 9, consumer="run-a"))
    log = ds.consumed("run-a")
    assert log.height == 1 and log["step_keys"].to_list()[0] == first.step_keys
    assert log["dataset_version"].to_list() == [ds.version] and log["policy_version"].to_list() == [
        1
    ]
    rest = [
        k for b in ds.batches(1, 9, consumer="run-a", skip_consumed_by="run-a") for k in b.step_keys
    ]
    assert not set(rest) & set(first.step_keys)
    assert len(rest) + len(first.step_keys) == ds.steps(1).height
    assert lake.read("gold/datasets/train").height == before  # consumption deletes nothing
    assert lake.read(GOLD_CONSUMPTION).filter(pl.col("consumer") == "run-a").height == 3


def test_an_old_dataset_version_is_consumed_exactly(lake):
    old = open_dataset("train", lake.uri)
    keys = sorted(old.steps(1)["step_key"])
    land(lake, group_of("late", [9, 9], [1.0, 0.0], version=1, turns=2))
    build_silver(lake)
    build_partition(lake, SPEC, 1)
    new = open_dataset("train", lake.uri)
    assert new.version > old.version and new.steps(1).height == len(keys) + 4
    pinned = open_dataset("train", lake.uri, version=old.version)
    assert sorted(k for b in pinned.batches(1, 100) for k in b.step_keys) == keys


def test_to_torch_gives_tensors_and_the_dense_mask_only_when_asked(lake, monkeypatch):
    torch = pytest.importorskip("torch")
    batch = next(open_dataset("train", lake.uri).batches(1, 9))
    tensors = batch.to_torch()
    assert (
        tensors["input_ids"].dtype == torch.int64 and tensors["advantages"].dtype == torch.float32
    )
    assert "attention_mask" not in tensors  # O(T): the intervals describe it
    assert tensors["subtree_end"].shape == (batch.num_tokens,)
    assert tensors["tree_offsets"][-1] == batch.num_tokens
    dense = batch.to_torch(dense_mask=True)["attention_mask"]
    assert dense.dtype == torch.bool and dense.shape == (batch.num_tokens, batch.num_tokens)
    assert (dense.numpy() == ancestors_brute_force(batch.parent)).all()
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match=r"pip install 'claw-lakehouse\[train\]'"):
        batch.to_torch()


def test_claw_export_writes_verl_parquet_and_jsonl(lake, tmp_path):
    base = [sys.executable, "-m", "claw_pipelines.app.cli", "export", "--lake", lake.uri]
    base += ["--dataset", "train", "--policy-version", "1"]
    out = tmp_path / "train-v1.parquet"
    done = subprocess.run([*base, "--out", str(out)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    table = pq.read_table(out).to_pylist()
    steps = {r["step_key"]: r for r in open_dataset("train", lake.uri).steps(1).to_dicts()}
    assert len(table) == len(steps)
    for row in table:
        step = steps[row["step_key"]]
        assert row["prompts"] == step["prompt_ids"] and row["responses"] == step["response_ids"]
        assert row["uid"] == step["prompt_uid"]
        assert row["response_mask"] == [1] * len(step["response_ids"])
        assert row["token_level_rewards"][-1] == (step["reward"] or 0.0)
        assert sum(row["token_level_rewards"][:-1]) == 0
    lines = tmp_path / "train-v1.jsonl"
    done = subprocess.run(
        [*base, "--format", "jsonl", "--out", str(lines)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert [json.loads(x)["step_key"] for x in lines.read_text().splitlines()] == [
        r["step_key"] for r in table
    ]
    missing = subprocess.run([*base[:-1], "9", "--out", str(out)], capture_output=True, text=True)
    assert missing.returncode == 1
    current = open_dataset("train", lake.uri).version  # another test may have built one more
    assert missing.stderr == (
        f"claw: error: dataset 'train' (version {current}) has policy versions 1, 2; "
        "policy version 9 does not exist\n"
    )


def test_tree_batches_from_the_stored_trees_equal_rebuilt_ones(lake):
    """Batches are read from gold/trees (U tokens, not raw); rebuilding from the raw tokens
    gives the very same arrays."""
    from claw_pipelines.transforms.packing import pack

    ds = open_dataset("train", lake.uri)
    steps = ds.steps(2)
    segments = ds.stored_trees(2, steps)
    assert segments is not None and segments.height == steps.height
    rank = steps.select(pl.col("tree_id").rank("dense") - 1)["tree_id"].to_numpy()
    stored, rebuilt = pack(steps, rank, "tree", segments), pack(steps, rank, "tree")
    for field in (
        "input_ids",
        "parent",
        "position_ids",
        "loss_mask",
        "advantages",
        "token_rewards",
        "behaviour_log_probs",
        "has_behaviour_log_probs",
        "step_prompt_lens",
    ):
        assert np.array_equal(getattr(stored, field), getattr(rebuilt, field)), field
    assert stored.step_keys == rebuilt.step_keys
    assert all(np.array_equal(a, b) for a, b in zip(stored.token_of, rebuilt.token_of, strict=True))


def test_an_unexpected_cli_error_is_one_line_and_its_traceback_is_logged(lake, tmp_path):
    log, blocker = tmp_path / "errors.log", tmp_path / "a-file"
    blocker.write_text("")  # --out beneath a file: an OSError no verb expects
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "export", "--lake", lake.uri]
    command += ["--dataset", "train", "--policy-version", "1", "--out", str(blocker / "x")]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "CLAW_ERROR_LOG": str(log)},
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("claw: error: ")
    assert f"(traceback: {log})" in done.stderr
    logged = log.read_text()
    assert "Traceback (most recent call last)" in logged and "export" in logged


def test_subtree_ends_describe_the_ancestor_mask_in_linear_memory():
    """k is an ancestor-or-self of q iff k <= q < subtree_end[k]: checked on random forests
    in depth-first order, and a 200k-token chain (a long shared context) needs no T x T."""
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 60))
        parent = np.full(n, -1, np.int64)
        for t in range(1, n):  # depth-first order: the parent is on the path to t-1
            path = [t - 1]
            while parent[path[-1]] >= 0:
                path.append(int(parent[path[-1]]))
            parent[t] = -1 if rng.random() < 0.1 else path[int(rng.integers(len(path)))]
        end = subtree_ends(parent)
        q, k = np.arange(n)[:, None], np.arange(n)[None, :]
        assert ((k <= q) & (q < end[None, :]) == ancestors_brute_force(parent)).all()
    chain = np.arange(-1, 200_000 - 1)
    started = time.perf_counter()
    assert (subtree_ends(chain) == 200_000).all()
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("layout", ["tree", "flat"])
def test_batches_packed_by_tokens_keep_trees_whole_and_report_padding(lake, layout):
    ds = open_dataset("train", lake.uri)
    everything = list(ds.batches(1, batch_size=10_000, layout=layout))
    assert len(everything) == 1
    whole = everything[0]
    tree_of = dict(zip(ds.steps(1)["step_key"], ds.steps(1)["tree_id"], strict=True))

    def tree_tokens(batch) -> dict[str, int]:
        """Each tree's tokens in this layout: the distinct token indices of its steps."""
        held: dict[str, set[int]] = {}
        for key, index in zip(batch.step_keys, batch.step_token_index, strict=True):
            held.setdefault(tree_of[key], set()).update(index.tolist())
        return {tree: len(tokens) for tree, tokens in held.items()}

    sizes = sorted(tree_tokens(whole).values())
    budget = sizes[-1] + sizes[0]  # the largest tree plus a bit
    batches = list(ds.batches(1, layout=layout, max_tokens=budget))
    assert len(batches) > 1
    keys = [k for b in batches for k in b.step_keys]
    assert sorted(keys) == sorted(whole.step_keys)  # every step once
    trees = [{tree_of[k] for k in b.step_keys} for b in batches]
    assert sum(len(t) for t in trees) == len(set().union(*trees))  # no tree split
    for batch in batches:
        report = batch.token_report()
        assert report["tokens"] == batch.num_tokens <= budget and not report["over_budget"]
        assert report["padding_tokens"] == budget - batch.num_tokens
        assert report["largest_block_tokens"] <= budget

    # the greedy cut: no batch could have taken the next batch's first tree
    for this, after in itertools.pairwise(batches):
        assert this.num_tokens + tree_tokens(after)[tree_of[after.step_keys[0]]] > budget
    # a budget below one tree: that tree alone, flagged
    tiny = next(ds.batches(1, layout=layout, max_tokens=1))
    assert tiny.token_report()["over_budget"] and len({tree_of[k] for k in tiny.step_keys}) == 1
    # steps and tokens together: whichever limit comes first
    both = list(ds.batches(1, batch_size=2, layout=layout, max_tokens=budget))
    assert all(len(b.step_keys) <= 2 or len({tree_of[k] for k in b.step_keys}) == 1 for b in both)
    with pytest.raises(ValueError, match="batch_size"):
        next(ds.batches(1))


TREE_ARRAYS = (  # a batch's token ids, tree and weights
    "input_ids",
    "parent",
    "position_ids",
    "loss_mask",
    "token_rewards",
    "advantages",
    "tree_offsets",
    "subtree_end",
    "step_starts",
)


def same_batch(got, want) -> None:
    """Two batches are the same: token ids, tree, weights, step indices, contract."""
    assert got.step_keys == want.step_keys and got.layout == want.layout
    for name in TREE_ARRAYS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert all(
        np.array_equal(a, b)
        for a, b in zip(got.step_token_index, want.step_token_index, strict=True)
    )
    assert (got.batch_index, got.max_tokens) == (want.batch_index, want.max_tokens)
    assert got.contract.to_dict() == want.contract.to_dict()


@pytest.mark.parametrize(
    "sizing",
    [
        {"batch_size": 9},
        {"batch_size": 9, "layout": "flat", "seed": 4},
        {"max_tokens": 1},
        {"max_tokens": 1, "layout": "flat"},
    ],
    ids=["steps", "steps-flat-seeded", "tokens", "tokens-flat"],
)
def test_a_batch_plan_packs_only_the_batches_asked_for_as_batches_gives_them(lake, sizing):
    """The plan reads no token; `batches(indexes)` packs the trees of those batches alone
    (its count of packed steps says so) and they equal `Dataset.batches`'s, in the order
    asked, a repeated index included."""
    ds = open_dataset("train", lake.uri)
    everything = list(ds.batches(1, **sizing))
    plan = ds.batch_plan(1, **sizing)
    assert len(plan) == len(everything) >= 3 and plan.packed_steps == 0
    assert [plan.step_keys(i) for i in range(len(plan))] == [b.step_keys for b in everything]
    tree_of = dict(zip(ds.steps(1)["step_key"], ds.steps(1)["tree_id"], strict=True))
    assert plan.tree_ids(0) == list(dict.fromkeys(tree_of[k] for k in everything[0].step_keys))
    last = len(plan) - 1
    asked = [last, 0, last]
    got = list(plan.batches(asked))
    assert plan.packed_steps == len(plan.step_keys(0)) + len(plan.step_keys(last))
    assert plan.packed_steps < ds.steps(1).height
    for index, batch in zip(asked, got, strict=True):
        same_batch(batch, everything[index])
    with pytest.raises(IndexError, match="out of range"):
        plan.batches([len(plan)])


def test_without_stored_trees_a_token_budget_plan_packs_the_partition_and_agrees(lake, tmp_path):
    """Tree sizes for a token budget come from the stored trees; a lake without them (here:
    a copy with gold/trees removed) makes the plan pack the whole partition to count them,
    and its batches are still those of the lake with stored trees."""
    copy = tmp_path / "lake"
    shutil.copytree(lake.uri, copy)
    shutil.rmtree(copy / gold_tree_table("train"))
    with_trees, without = open_dataset("train", lake.uri), open_dataset("train", str(copy))
    assert without.stored_trees(1, without.steps(1)) is None
    budget = max(b.num_tokens for b in with_trees.batches(1, max_tokens=1)) + 1
    plan = without.batch_plan(1, max_tokens=budget)
    assert plan.packed_steps == without.steps(1).height  # packed once, to size the trees
    want = list(with_trees.batches(1, max_tokens=budget))
    assert len(plan) == len(want) >= 2
    got = list(plan.batches([1, 0]))
    assert plan.packed_steps == without.steps(1).height  # and not again
    for batch, index in zip(got, [1, 0], strict=True):
        for name in ("input_ids", "parent", "position_ids", "loss_mask", "subtree_end"):
            assert np.array_equal(getattr(batch, name), getattr(want[index], name)), name
        assert batch.step_keys == want[index].step_keys


def behaviour_of_gold(step_keys, token_of, total: int, gold: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per token, from the gold rows one token at a time: the mean behaviour log-prob of the
    steps whose response holds it, and whether any of them captured one."""
    sums, counts = np.zeros(total), np.zeros(total, dtype=np.int64)
    for key, index in zip(step_keys, token_of, strict=True):
        row = gold[key]
        if row["rollout_log_probs"] is None:
            continue
        response = index[row["prompt_len"] :].tolist()
        for position, value in zip(response, row["rollout_log_probs"], strict=True):
            sums[position] += value
            counts[position] += 1
    return np.where(counts > 0, sums / np.maximum(counts, 1), 0.0), counts


@pytest.mark.parametrize("layout", ["tree", "flat"])
def test_behaviour_log_probs_sit_at_each_steps_response_tokens(behaviour, layout):
    ds = open_dataset("behaviour", behaviour.uri)
    gold = {row["step_key"]: row for row in ds.steps().to_dicts()}
    offline = [b for v in ds.policy_versions() for b in ds.batches(v, 6, layout=layout)]
    live = ds.next_batch(4, consumer=f"behaviour-{layout}", layout=layout, timeout=0)
    assert live is not None and set(live.step_policy_versions.tolist()) == {1, 2}
    shared = 0
    for batch in [*offline, live]:
        expected, counts = behaviour_of_gold(
            batch.step_keys, batch.step_token_index, batch.num_tokens, gold
        )
        assert batch.behaviour_log_probs.dtype == np.float32
        assert np.array_equal(batch.has_behaviour_log_probs, counts > 0)
        assert np.allclose(batch.behaviour_log_probs, expected, atol=1e-6)
        prompts = [gold[k]["prompt_len"] for k in batch.step_keys]
        assert batch.step_prompt_lens.tolist() == prompts
        assert not batch.has_behaviour_log_probs[~batch.loss_mask.astype(bool)].any()
        shared += int((counts > 1).sum())
        tensors = batch.to_torch()
        assert np.array_equal(tensors["old_log_probs"].numpy(), batch.behaviour_log_probs)
        assert np.array_equal(tensors["old_log_probs_mask"].numpy(), counts > 0)
    # the tree holds r0's and r1's shared opening once: the two steps' values averaged there
    assert (shared > 0) == (layout == "tree")
    none = [k for k in live.step_keys if gold[k]["rollout_log_probs"] is None]
    assert none and all(k.endswith("-r2:0") for k in none)


def test_rebuilt_trees_carry_the_behaviour_log_probs_of_stored_ones(behaviour):
    from claw_pipelines.transforms.packing import pack

    ds = open_dataset("behaviour", behaviour.uri)
    steps = ds.steps(1)
    gold = {row["step_key"]: row for row in steps.to_dicts()}
    segments = ds.stored_trees(1, steps)
    assert segments is not None
    rank = steps.select(pl.col("tree_id").rank("dense") - 1)["tree_id"].to_numpy()
    stored, rebuilt = pack(steps, rank, "tree", segments), pack(steps, rank, "tree")
    expected, counts = behaviour_of_gold(
        rebuilt.step_keys, rebuilt.token_of, len(rebuilt.input_ids), gold
    )
    assert (counts > 1).any()
    for packed in (stored, rebuilt):
        assert np.allclose(packed.behaviour_log_probs, expected, atol=1e-6)
        assert np.array_equal(packed.has_behaviour_log_probs, counts > 0)


BATCH_ARRAYS = (
    *TREE_ARRAYS,
    "token_policy_versions",
    "behaviour_log_probs",
    "has_behaviour_log_probs",
    "step_prompt_lens",
)


def test_batches_from_stored_references_equal_those_of_whole_prompts(lake, tmp_path):
    """Gold keeps a prompt relative to an earlier step of its tree (docs/DESIGN.md §18): a
    trainer's batches, flat and tree, offline and live, and `steps()` are bit-identical to
    those of the same dataset stored with whole prompts (as a table written before the
    layout holds them), which also still reads right."""
    table = "gold/datasets/train"
    stored = lake.read(table)
    assert stored["prefix_step_key"].drop_nulls().len() > 0  # later turns refer to earlier ones
    assert stored["prompt_ids"].null_count() == stored.height
    shutil.copytree(lake.uri, tmp_path / "whole")
    whole = Lake(str(tmp_path / "whole"))
    rows = read_steps(whole, table)  # every prompt whole, the layout columns left out
    for version in (1, 2):  # the partitions rewritten as before the layout (same lineage)
        part = rows.filter(pl.col("policy_version") == version)
        spec = gold_dataset_spec("train")
        whole.overwrite(spec, part.to_arrow(), where=f"policy_version = {version}")
    assert whole.read(table)["prefix_step_key"].null_count() == stored.height
    ours, theirs = open_dataset("train", lake.uri), open_dataset("train", whole.uri)
    assert ours.steps().drop("landed_at").equals(theirs.steps().drop("landed_at"))
    for layout, version in itertools.product(("tree", "flat"), (1, 2)):
        mine = list(ours.batches(version, 2, layout=layout, seed=1))
        old = list(theirs.batches(version, 2, layout=layout, seed=1))
        assert len(mine) == len(old) > 0
        for a, b in zip(mine, old, strict=True):
            assert a.step_keys == b.step_keys
            for name in BATCH_ARRAYS:
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and np.array_equal(x, y), name
            assert all(
                np.array_equal(i, j)
                for i, j in zip(a.step_token_index, b.step_token_index, strict=True)
            )
    for dataset in (ours, theirs):  # live delivery: the same groups, the same tokens
        batch = dataset.next_batch(2, consumer="refs", timeout=0)
        assert batch is not None
    first = ours.replay("refs")
    second = theirs.replay("refs")
    for a, b in zip(first, second, strict=True):
        assert a.step_keys == b.step_keys and np.array_equal(a.input_ids, b.input_ids)

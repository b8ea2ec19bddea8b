"""The train folder's fixtures: the lakes the attention, adapter and equivalence tests read."""

from __future__ import annotations

import pytest

from tests.support.lakes import equivalence_dataset, train_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """The `train` dataset's lake (tests/support/lakes.py: train_lake)."""
    return train_lake(tmp_path_factory.mktemp("consume") / "lake")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Two GRPO groups of two-turn trajectories; some rollouts share their first response
    tokens, so a shared token is a trained response token of several steps."""
    return equivalence_dataset(tmp_path_factory.mktemp("equivalence") / "lake")

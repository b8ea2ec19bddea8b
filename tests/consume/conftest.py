"""The consume folder's fixtures."""

from __future__ import annotations

import pytest

from tests.support.lakes import behaviour_lake, train_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """The `train` dataset's lake (tests/support/lakes.py: train_lake)."""
    return train_lake(tmp_path_factory.mktemp("consume") / "lake")


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory):
    """The `behaviour` dataset's lake: a behaviour log-prob of its own on every response token,
    shared tree positions holding two steps' values, a step that captured none
    (tests/support/lakes.py: behaviour_lake)."""
    return behaviour_lake(tmp_path_factory.mktemp("behaviour") / "lake")

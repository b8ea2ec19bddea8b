"""The consume folder's fixtures."""

from __future__ import annotations

import pytest

from tests.support.lakes import train_lake


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """The `train` dataset's lake (tests/support/lakes.py: train_lake)."""
    return train_lake(tmp_path_factory.mktemp("consume") / "lake")

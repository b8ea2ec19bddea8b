"""Third-party packages the real-server tests import (vLLM's protocol modules, verl): skipped
where absent, except under `CLAW_REAL_SERVERS=required` (CI's `make real-servers`, which
installs them), where an import that fails is a test failure, not a skip."""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import pytest

REQUIRED = os.environ.get("CLAW_REAL_SERVERS") == "required"


def import_or_skip(name: str) -> ModuleType:
    """The module `name`; a skip where it is not installed, unless real servers are required.
    Their own deprecation warnings on import (vLLM's torch.jit use) are not ours to fail on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if REQUIRED:
            return importlib.import_module(name)
        return pytest.importorskip(name)

"""The front doors: `claw_pipelines` exports what a trainer and an operator use, and
`claw_pipelines.train` the attention and adapter entry points; each name resolves to the
object its module defines, and importing the package alone stays light."""

from __future__ import annotations

import subprocess
import sys

import claw_pipelines
import claw_pipelines.train
from claw_pipelines.contracts import errors

TRAINER_AND_OPERATOR = {
    "open_dataset", "Dataset", "Batch", "BatchPlan", "publish_policy_version",
    "current_policy_version", "ClawSettings", "ClawError", "NotFound", "SpecError",
    "JudgeError", "ChatLogError", "ContractViolation", "Undecodable", "UnsafeStore",
    "WriteConflict", "Forbidden", "__version__",
}  # fmt: skip


def test_the_front_door_exports_the_trainer_and_operator_names():
    assert set(claw_pipelines.__all__) == TRAINER_AND_OPERATOR
    assert set(claw_pipelines._EXPORTS) | {"__version__"} == TRAINER_AND_OPERATOR
    from claw_pipelines.consume.dataset import Dataset, open_dataset

    assert claw_pipelines.open_dataset is open_dataset
    assert claw_pipelines.Dataset is Dataset
    for name in claw_pipelines.__all__:
        assert getattr(claw_pipelines, name) is not None


def test_every_error_is_a_claw_error_and_still_its_builtin():
    family = [getattr(errors, name) for name in dir(errors) if name[0].isupper()]
    family = [cls for cls in family if isinstance(cls, type) and issubclass(cls, Exception)]
    assert len(family) == 11
    assert all(issubclass(cls, errors.ClawError) for cls in family)
    assert issubclass(errors.NotFound, LookupError)
    assert issubclass(errors.SpecError, ValueError)
    assert issubclass(errors.Forbidden, PermissionError)
    assert claw_pipelines.NotFound is errors.NotFound


def test_the_train_door_exports_its_entry_points():
    from claw_pipelines.train.adapters import BatchDataset
    from claw_pipelines.train.block_attention import tree_attention

    assert set(claw_pipelines.train.__all__) >= {"tree_block_mask", "tree_attention"}
    assert claw_pipelines.train.tree_attention is tree_attention
    assert claw_pipelines.train.BatchDataset is BatchDataset


def test_importing_the_package_loads_no_data_stack():
    heavy = "{'polars', 'deltalake', 'torch'}"
    code = f"import sys, claw_pipelines; print(sorted({heavy} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

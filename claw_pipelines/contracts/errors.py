"""Every error the lakehouse raises on purpose, one family (each message is one line that
names what is wrong: the file, the field, the step, what does exist):

    ClawError
    ├── NotFound (LookupError)          no such lake, dataset, dataset or policy version
    ├── Undecodable (LookupError)       a step whose messages cannot be had back
    ├── SpecError (ValueError)          a curation spec that does not validate or build
    ├── JudgeError (ValueError)         a judge that cannot be loaded, or answered wrongly
    ├── ChatLogError (ValueError)       a chat log line that cannot be imported
    ├── UnsafeStore (ValueError)        a store that would let concurrent commits be lost
    ├── ContractViolation (RuntimeError) a batch breaking a check its spec makes blocking
    ├── Forbidden (PermissionError)     a caller asking for another tenant's data, or no key
    └── WriteConflict                   a concurrent writer moved what a write read

Callers catch `ClawError` for "the lakehouse said no" (the CLI prints it in one line and
exits 1); the second base keeps each catchable as the built-in it always was.
"""

from __future__ import annotations

from typing import Any


class ClawError(Exception):
    """An error the lakehouse raises on purpose; its message is one line naming the cause."""


class NotFound(ClawError, LookupError):
    """What was asked for (lake, dataset, dataset version, policy version) does not exist;
    the message names it and what does exist, in one line."""


class Undecodable(ClawError, LookupError):
    """A step whose messages cannot be had; the message names the step and what is missing."""


class SpecError(ClawError, ValueError):
    """A spec that does not validate, or cannot build; the message names the file and field."""


class JudgeError(ClawError, ValueError):
    """A judge that cannot be loaded or answered wrongly (one line, names the judge)."""


class ChatLogError(ClawError, ValueError):
    """A chat log that cannot be imported; the message names the line and the field."""


class UnsafeStore(ClawError, ValueError):
    """The lake's store or storage options would let concurrent commits be lost."""


class ContractViolation(ClawError, RuntimeError):
    """A batch that breaks a check its spec makes blocking; names the checks and rows
    (`report`: the batch's contract report, `failed`: its blocking checks that failed)."""

    def __init__(self, report: Any, failed: list[Any]) -> None:
        self.report, self.failed = report, failed
        parts = [
            f"{c.name} ({c.detail}; rows: {', '.join(c.rows)}"
            + (", ..." if c.failures > len(c.rows) else "")
            + ")"
            for c in failed
        ]
        super().__init__(
            f"batch of {report.dataset} v{report.dataset_version} refused: " + "; ".join(parts)
        )


class Forbidden(ClawError, PermissionError):
    """The caller may not read this: another tenant's data, or no valid key where keys are
    configured; the message names the tenant."""


class WriteConflict(ClawError):
    """A concurrent writer committed to a table this write was computed from; the write did
    not land. Recompute from the new state and try again."""


class Fenced(ClawError):
    """A newer owner of this writer's share holds it now (its fencing token reached the
    table): the write did not land, and no write of this owner will. Stop; do not retry."""

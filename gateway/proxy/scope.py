"""Which trajectory a proxied call belongs to, and the gateway's memory of open trajectories.

A call is scoped by its base URL (`/t/{trajectory_uid}/g/{prompt_uid}/v1`, or Claw-R1's
`/{trajectory_uid}/{prompt_uid}/v1`) or by the `X-Claw-Trajectory` / `X-Claw-Prompt-Group`
headers; `X-Claw-Policy-Version` sets the policy version of its steps. Unscoped calls are
stitched into trajectories downstream (silver) by message-prefix matching.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from claw_pipelines.contracts.limits import INT32_MAX, MAX_UID_CHARS, is_uid
from gateway.errors import ApiError
from gateway.numbering import RecordedSteps

TRAJECTORY_HEADER = "x-claw-trajectory"
PROMPT_GROUP_HEADER = "x-claw-prompt-group"
POLICY_VERSION_HEADER = "x-claw-policy-version"
DEFAULT_CAPACITY = 200_000


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a call's steps go: a trajectory (None = unscoped), its prompt group and policy."""

    trajectory_uid: str | None = None
    prompt_uid: str | None = None
    policy_version: int | None = None
    via: str = "none"  # url | claw_r1 | header | none


def _uid(value: str | None, header: str) -> str | None:
    if value is None:
        return None
    if not is_uid(value):
        raise ApiError(
            422,
            f"{header}: use letters, digits and ._:@+=- (at most {MAX_UID_CHARS} characters)",
            param=header,
            code="invalid_header",
        )
    return value


def _policy_version(value: str | None) -> int | None:
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and int(value) <= INT32_MAX):
        raise ApiError(
            422,
            f"X-Claw-Policy-Version: must be an integer from 0 to {INT32_MAX}",
            param="X-Claw-Policy-Version",
            code="invalid_header",
        )
    return int(value)


def scope_of(
    headers: Mapping[str, str],
    trajectory_uid: str | None = None,
    prompt_uid: str | None = None,
    via: str = "url",
) -> Scope:
    """The scope of a call: its URL's (already validated) uids, else the X-Claw-* headers."""
    policy = _policy_version(headers.get(POLICY_VERSION_HEADER))
    if trajectory_uid is not None:
        return Scope(trajectory_uid, prompt_uid, policy, via)
    trajectory = _uid(headers.get(TRAJECTORY_HEADER), "X-Claw-Trajectory")
    group = _uid(headers.get(PROMPT_GROUP_HEADER), "X-Claw-Prompt-Group")
    return Scope(trajectory, group, policy, "header" if trajectory else "none")


@dataclass(slots=True)
class _Trajectory:
    next_step: int = 0
    policy_version: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class TrajectoryBook:
    """In-memory state of scoped trajectories: the next step index (0, 1, 2, ... in the order
    steps are recorded) and what `register_trajectory` said. Least recently used entries are
    forgotten past `capacity`. A trajectory new to the book starts after the steps `recorded`
    holds (the WAL and bronze at start: gateway.numbering); what it registered does not
    survive a restart."""

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, recorded: RecordedSteps | None = None
    ) -> None:
        self.capacity = capacity
        self.recorded = recorded
        self._open: OrderedDict[str, _Trajectory] = OrderedDict()

    def _get(self, trajectory_uid: str) -> _Trajectory:
        state = self._open.get(trajectory_uid)
        if state is None:
            start = 0 if self.recorded is None else self.recorded.next_step(trajectory_uid)
            state = self._open[trajectory_uid] = _Trajectory(start)
            if len(self._open) > self.capacity:
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(trajectory_uid)
        return state

    def claim_steps(self, trajectory_uid: str, count: int, at_least: int = 0) -> int:
        """Reserve `count` consecutive step indices, the first of them at least `at_least`
        (the turns the call shows were numbered elsewhere); returns the first."""
        state = self._get(trajectory_uid)
        first = max(state.next_step, at_least)
        state.next_step = first + count
        return first

    def ensure_next(self, trajectory_uid: str, next_step: int) -> None:
        """Make the next claimed index at least `next_step` (steps recorded before a restart)."""
        state = self._get(trajectory_uid)
        state.next_step = max(state.next_step, next_step)

    def register(self, trajectory_uid: str, metadata: dict[str, Any]) -> None:
        """Remember a trajectory's metadata; its `policy_version` applies to later steps."""
        state = self._get(trajectory_uid)
        metadata = dict(metadata)
        version = metadata.pop("policy_version", None)
        if version is not None:
            state.policy_version = version
        state.metadata.update(metadata)

    def registered(self, trajectory_uid: str) -> tuple[int | None, dict[str, Any]]:
        """The registered policy version and metadata of a trajectory (None, {} if unknown)."""
        state = self._open.get(trajectory_uid)
        return (None, {}) if state is None else (state.policy_version, state.metadata)

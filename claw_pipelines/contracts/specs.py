"""Curation specs (docs/DESIGN.md §6): which silver steps make a gold dataset, how they are merged
and what advantage they carry. Stored as YAML in the lake (`specs/<name>.yaml`)."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from claw_pipelines.contracts.limits import LABEL_PATTERN, MAX_UID_CHARS, UID_PATTERN

DATASET_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
DatasetName = Annotated[str, StringConstraints(pattern=DATASET_NAME_PATTERN)]
Label = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=LABEL_PATTERN)]
RewardStatus = Literal["final", "pending", "missing"]
TrajectoryStatus = Literal["open", "complete", "abandoned"]
TokenSource = Literal["upstream", "local", "local_unverified", "client"]
# ids exactly as the model saw and sampled them: the server's, the client's own, or computed
# by the gateway and confirmed by the server's token counts (never `local_unverified`)
EXACT_TOKEN_SOURCES: list[TokenSource] = ["upstream", "local", "client"]
SourceKind = Literal["white_box", "proxy", "claw_r1"]
Length = Annotated[int, Field(ge=0)]
JudgeName = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_UID_CHARS, pattern=UID_PATTERN)
]
# Why a spec leaves a step out of its dataset (`gold/rejections/<name>`), in the order a step's
# first reason is named: its own filters, then its group's rules, then the spec's selection.
REJECTION_REASONS = (
    "superseded",  # a retry orphan (keep_superseded is off)
    "aborted",  # an aborted generation nothing continued, and its trajectory ended
    "stale",  # policy version too old, or not one of policy_versions
    "reward",  # reward status, reward range, rating or trajectory return
    "label",  # require_labels / exclude_labels
    "length",  # prompt or response length
    "tokens",  # its token ids' source is not one of token_sources (e.g. local_unverified)
    "log_probs",  # the spec requires behaviour log-probs and the step has none
    "source",  # finish reason, source kind or tenant
    "incomplete",  # its trajectory, or its prompt group, is not complete or big enough yet
    "deadline",  # its group was still incomplete at its deadline, and the spec skips those
    "zero_variance",  # every trajectory of its group has the same return
    "not_selected",  # not the trajectory the spec's `select` picks from its group
)
RejectionReason = Literal[REJECTION_REASONS]
# what every batch's contract report checks (claw_pipelines.consume.report); a spec may block on any
CONTRACT_CHECKS = (
    "spec_hash",
    "staleness",
    "group_completeness",
    "turns_nest",
    "masks",
    "filters",
    "exact_ids",
)
ContractCheckName = Literal[CONTRACT_CHECKS]


class JudgeRef(BaseModel):
    """A versioned judge whose reward facts resolve a dataset's rewards."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: JudgeName = Field(description="the judge (`claw rescore --judge NAME`)")
    version: JudgeName = Field(description="its version")


class Readmission(BaseModel):
    """Draw a dataset's steps from what another dataset's spec rejects, instead of silver."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: DatasetName = Field(description="the dataset whose rejections are re-admitted")
    reasons: list[RejectionReason] | None = Field(
        None, description="only steps rejected for one of these reasons (default: any)"
    )


# fields added after specs were first hashed: left out of the canonical JSON while they hold
# these values, so an older spec keeps its hash
_LATER_FIELDS = {
    "reward_judge": None,
    "readmit": None,
    "select": "all",
    "min_return": None,
    "blocking": [],
    "require_log_probs": False,
    "staleness": "step",
    "tenant": None,
}


class CurationSpec(BaseModel):
    """A gold dataset's definition: filters on silver steps, merge scope and advantage.

    Every filter left unset keeps everything. Its hash (`spec_hash`) identifies it in lineage.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: DatasetName = Field(description="the dataset: gold/datasets/<name>")
    description: str = ""
    tenant: Label | None = Field(
        None,
        description="the tenant the spec and its dataset belong to: only that tenant's steps "
        "are curated (not rejected: never seen), and only its keys (or an admin's) read the "
        "dataset; none: every tenant's steps, read by admin keys only when keys are configured",
    )
    reward_status: list[RewardStatus] = Field(
        default_factory=lambda: ["final"], description="keep steps whose reward status is one of"
    )
    reward_min: float | None = Field(None, description="lowest resolved reward kept")
    reward_max: float | None = Field(None, description="highest resolved reward kept")
    require_labels: list[Label] = Field(default_factory=list, description="all must be present")
    exclude_labels: list[Label] = Field(default_factory=list, description="none may be present")
    min_rating: float | None = Field(None, description="lowest latest human rating kept")
    token_sources: list[TokenSource] | None = Field(
        None,
        description="keep steps whose token ids came from one of these sources (upstream, "
        "client, local: computed by the gateway and confirmed by the server's counts, "
        "local_unverified: not confirmed)",
    )
    require_log_probs: bool = Field(
        False,
        description="keep only steps with their behaviour log-probs (off-policy correction "
        "needs them)",
    )
    finish_reasons: list[Label] | None = None
    min_prompt_tokens: Length | None = None
    max_prompt_tokens: Length | None = None
    min_response_tokens: Length | None = None
    max_response_tokens: Length | None = None
    trajectory_status: list[TrajectoryStatus] | None = Field(
        None, description="keep steps of trajectories in these states (e.g. only complete)"
    )
    complete_groups_only: bool = Field(
        False, description="keep a prompt group only if all its trajectories are complete"
    )
    min_group_size: Annotated[int, Field(ge=1)] | None = Field(
        None, description="keep prompt groups with at least this many trajectories"
    )
    keep_superseded: bool = Field(
        False,
        description="keep retry orphans: the steps of a call the client sent again before "
        "anything continued it (marked superseded_by the retry; dropped by default)",
    )
    drop_zero_variance_groups: bool = Field(
        False, description="drop prompt groups whose trajectory returns are all equal"
    )
    group_deadline_s: Annotated[float, Field(gt=0)] | None = Field(
        None,
        description="a prompt group still waiting (not complete, or smaller than "
        "min_group_size) this long after its first step is released as it stands or skipped "
        "(on_deadline), so a straggler never holds it back for ever; measured on the data's "
        "clock (the newest step or fact silver holds)",
    )
    on_deadline: Literal["release", "skip"] = Field(
        "release", description="what a group past its deadline becomes"
    )
    max_policy_staleness: Length | None = Field(
        None, description="keep policy versions within this many of the newest one"
    )
    staleness: Literal["step", "token"] = Field(
        "step",
        description="how max_policy_staleness judges a step generated under several policy "
        "versions (a partial rollout joined to its continuation): step, the whole step is "
        "left out when its oldest token's version is below the floor (newest minus "
        "max_policy_staleness); token, only those tokens are masked out of the loss "
        "(loss_mask 0) and the step is left out when none is left (the version that "
        "finished it is below the floor)",
    )
    policy_versions: list[Length] | None = Field(None, description="keep only these versions")
    sources: list[SourceKind] | None = None
    tenants: list[Label] | None = None
    merge: Literal["trajectory", "prompt_group", "none"] = Field(
        "trajectory", description="prefix-tree scope"
    )
    advantage: Literal["none", "grpo"] = Field(
        "none", description="grpo: (return - group mean) / (group std + eps)"
    )
    advantage_eps: Annotated[float, Field(gt=0)] = 1e-6
    reward_judge: JudgeRef | None = Field(
        None,
        description="resolve rewards from this judge version's facts (`claw rescore`) instead "
        "of the default rule: a step's reward is the judge's latest for it (missing when it "
        "has none), a trajectory's return the sum over its steps",
    )

    min_return: float | None = Field(
        None, description="lowest trajectory return kept (e.g. successes only)"
    )
    readmit: Readmission | None = Field(
        None,
        description="draw steps only from what another dataset's spec rejects (its "
        "gold/rejections), e.g. SFT on the groups GRPO drops for zero variance",
    )
    select: Literal["all", "best_per_group", "best_and_worst"] = Field(
        "all",
        description="which of a prompt group's trajectories to keep (after the filters): "
        "all; the best one by return (SFT on successes); or the best and the worst (a "
        "preference pair; groups whose returns are all equal are dropped). Ties go to the "
        "smallest trajectory_uid",
    )

    blocking: list[ContractCheckName] = Field(
        default_factory=list,
        description="checks of the contract report a batch must pass to be handed out "
        "(spec_hash, staleness, group_completeness, turns_nest: retokenization drift or "
        "forks, masks, filters, exact_ids: every step's ids exactly as sampled); a batch that "
        "fails one is refused, naming the rows",
    )

    @model_validator(mode="after")
    def _ranges_are_ordered(self) -> CurationSpec:
        for low, high in (
            ("reward_min", "reward_max"),
            ("min_prompt_tokens", "max_prompt_tokens"),
            ("min_response_tokens", "max_response_tokens"),
        ):
            a, b = getattr(self, low), getattr(self, high)
            if a is not None and b is not None and a > b:
                raise ValueError(f"{low} ({a}) is above {high} ({b})")
        if self.tenant is not None and self.tenants not in (None, [self.tenant]):
            raise ValueError(
                f"tenants: a spec of tenant {self.tenant!r} curates only that tenant's steps"
            )
        if self.readmit is not None and self.readmit.dataset == self.name:
            raise ValueError("readmit: a dataset cannot re-admit its own rejections")
        return self

    def canonical_json(self) -> str:
        """The spec as canonical JSON (sorted keys, no spaces): what its hash covers."""
        data = self.model_dump(mode="json")
        for name, default in _LATER_FIELDS.items():
            if data[name] == default:
                del data[name]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def spec_hash(self) -> str:
        """SHA-256 of the canonical JSON, hex (first 16 characters)."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


DEFAULT_SPEC = CurationSpec(
    name="default",
    description="Every step of complete trajectories whose token ids are exact (steps without "
    "their own reward carry their trajectory's GRPO advantage), merged per prompt group.",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    token_sources=EXACT_TOKEN_SOURCES,
    merge="prompt_group",
    advantage="grpo",
)


SFT_SUCCESSES_SPEC = CurationSpec(
    name="sft-successes",
    description="Supervised fine-tuning on successes: the best complete trajectory of each "
    "prompt group, if its return is at least 1 (flat SFT records: `claw export --format "
    "sft-messages`).",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    token_sources=EXACT_TOKEN_SOURCES,
    min_return=1.0,
    select="best_per_group",
    merge="trajectory",
)

PREFERENCE_PAIRS_SPEC = CurationSpec(
    name="preference-pairs",
    description="Preference pairs: the best and the worst complete trajectory of each prompt "
    "group whose returns differ (`claw export --format preference-pairs`).",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    token_sources=EXACT_TOKEN_SOURCES,
    select="best_and_worst",
    merge="prompt_group",
)

# specs a lake has without a file: `default` is always built; the others once added
BUILTIN_SPECS = {s.name: s for s in (DEFAULT_SPEC, SFT_SUCCESSES_SPEC, PREFERENCE_PAIRS_SPEC)}

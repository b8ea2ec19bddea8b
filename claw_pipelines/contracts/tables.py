"""Table names and Arrow schemas of every lake table (docs/DESIGN.md §5), declared once."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa

from claw_pipelines.contracts.shards import SHARD_ORDER

SCHEMA_VERSION = 1

BRONZE_EVENTS = "bronze/events"
SILVER_STEPS = "silver/steps"
SILVER_FEEDBACK = "silver/feedback"
SILVER_TRAJECTORIES = "silver/trajectories"
SILVER_STEP_REWARDS = "silver/step_rewards"
SILVER_STEP_CONFLICTS = "silver/step_conflicts"
SILVER_TABLES = (  # every table a silver run writes (its marker, trajectories, last)
    SILVER_STEPS,
    SILVER_FEEDBACK,
    SILVER_TRAJECTORIES,
    SILVER_STEP_REWARDS,
    SILVER_STEP_CONFLICTS,
)
GOLD_LINEAGE = "gold/lineage"
GOLD_CONSUMPTION = "gold/consumption"
LIVE_DELIVERY = "next"  # the `kind` of gold/consumption rows a live `next_batch` writes
GOLD_POLICY_VERSIONS = "gold/policy_versions"
GOLD_TRAINER_FEEDBACK = "gold/trainer_feedback"
GOLD_DATASETS_PREFIX = "gold/datasets"
GOLD_TREES_PREFIX = "gold/trees"
GOLD_REJECTIONS_PREFIX = "gold/rejections"
SHARD_LEASES = "ops/shard_leases"
# what one gold run writes: the keys of the gold multi-asset, which runs select whole
GOLD_RUN_TABLES = (GOLD_DATASETS_PREFIX, GOLD_TREES_PREFIX, GOLD_REJECTIONS_PREFIX, GOLD_LINEAGE)

RECORD_KINDS = (
    "step",
    "chat_completion",
    "completion",
    "feedback",
    "event",
    "trajectory_complete",
    "span",  # an OpenTelemetry span as exported to /v1/traces
    "traced_call",  # a model call read from a span (its step)
)
STEP_KINDS = ("step", "chat_completion", "completion", "traced_call")
FACT_KINDS = ("feedback", "trajectory_complete")
SOURCE_KINDS = ("white_box", "proxy", "claw_r1", "otel")
TRAJECTORY_STATUSES = ("open", "complete", "abandoned")
REWARD_STATUSES = ("final", "pending", "missing")
# where a step's token ids come from: the server's (`upstream`), the client's own (`client`),
# computed by the gateway and equal in length to the server's counts (`local`), or computed
# and not confirmed by them (`local_unverified`)
TOKEN_SOURCES = ("upstream", "local", "local_unverified", "client")
EXACT_TOKEN_SOURCES = ("upstream", "local", "client")
# how a generation that did not finish ends: the upstream aborted it (vLLM's `abort`, e.g. when
# weights change mid-generation), or its stream was cut (the gateway's relay endings)
ABORTED_FINISH_REASONS = ("abort", "upstream_error", "client_disconnected", "upstream_ended")

UTC_MICROS = pa.timestamp("us", tz="UTC")
TOKEN_LIST = pa.list_(pa.int32())
LOGPROB_LIST = pa.list_(pa.float32())
MASK_LIST = pa.list_(pa.int8())
VERSION_LIST = pa.list_(pa.int64())
# a response generated under several policy versions (a partial rollout joined to its
# continuation): run-length segments, the version of each run and its token count
POLICY_RUN_COLUMNS = [("policy_version_runs", VERSION_LIST), ("policy_run_lengths", VERSION_LIST)]
# a prompt stored relative to an earlier step (docs/DESIGN.md §18; transforms.contexts):
# prompt = (prompt_ids + response_ids of prefix_step_key)[:prefix_len] + prompt_suffix_ids, and
# prompt_ids is null; rows written before hold their whole prompt in prompt_ids
PROMPT_LAYOUT_COLUMNS = [
    ("prefix_step_key", pa.string()),
    ("prefix_len", pa.int64()),
    ("prompt_suffix_ids", TOKEN_LIST),
]


@dataclass(frozen=True)
class TableSpec:
    """A lake table: its path under the lake root, Arrow schema and partition columns."""

    name: str
    schema: pa.Schema
    partition_by: tuple[str, ...] = field(default_factory=tuple)
    description: str = ""
    append_heavy: bool = False  # written in many small commits: cheap parquet encoding
    change_feed: bool = False  # Delta change data feed on: readers can ask what a version added
    sort_by: tuple[str, ...] = ()  # rows of each write sorted so row-group stats prune lookups
    row_group_rows: int | None = None  # small row groups: a point lookup reads little
    compact_lists: bool = False  # list values dictionary-encoded: smaller, slower to write
    # rows laid out for materializer shards (`shard_order`, §19), in row groups of about
    # this many bytes, so a shard's read skips the others' records' tokens
    shard_row_group_bytes: int | None = None


# Step fields lifted out of the JSON payload into typed columns so silver reads them fast.
BRONZE_STEP_COLUMNS = pa.schema(
    [
        ("trajectory_uid", pa.string()),
        ("prompt_uid", pa.string()),
        ("step_index", pa.int64()),
        ("policy_version", pa.int64()),
        ("token_source", pa.string()),
        ("prompt_ids", TOKEN_LIST),
        ("response_ids", TOKEN_LIST),
        ("rollout_log_probs", LOGPROB_LIST),
        ("response_mask", MASK_LIST),
        ("reward", pa.float64()),
        ("is_last", pa.bool_()),
        ("finish_reason", pa.string()),
        ("model", pa.string()),
    ]
)

BRONZE_EVENTS_SPEC = TableSpec(
    BRONZE_EVENTS,
    pa.schema(
        [
            pa.field("event_id", pa.string(), nullable=False),
            pa.field("kind", pa.string(), nullable=False),
            pa.field("tenant", pa.string(), nullable=False),
            pa.field("received_at", UTC_MICROS, nullable=False),
            pa.field("ingest_date", pa.date32(), nullable=False),
            pa.field("gateway_id", pa.string(), nullable=False),
            pa.field("batch_seq", pa.int64(), nullable=False),
            pa.field("schema_version", pa.int32(), nullable=False),
            pa.field("payload", pa.string(), nullable=False),
            *BRONZE_STEP_COLUMNS,
            # a step record's shard bucket, bits reversed (facts: null); rows sorted by it
            (SHARD_ORDER, pa.int32()),
        ]
    ),
    partition_by=("ingest_date",),
    description="One accepted request record, as the gateway acknowledged it.",
    append_heavy=True,
    change_feed=True,
    shard_row_group_bytes=8 << 20,
)

SILVER_STEPS_SPEC = TableSpec(
    SILVER_STEPS,
    pa.schema(
        [
            pa.field("step_key", pa.string(), nullable=False),
            pa.field("trajectory_uid", pa.string(), nullable=False),
            pa.field("step_index", pa.int64(), nullable=False),
            ("prompt_uid", pa.string()),
            ("prompt_id", pa.string()),
            ("response_id", pa.string()),
            ("prompt_ids", TOKEN_LIST),
            ("response_ids", TOKEN_LIST),
            ("rollout_log_probs", LOGPROB_LIST),
            ("response_mask", MASK_LIST),
            ("policy_version", pa.int64()),
            ("model", pa.string()),
            ("token_source", pa.string()),
            ("finish_reason", pa.string()),
            ("is_last", pa.bool_()),
            ("tenant", pa.string()),
            ("source_kind", pa.string()),
            ("created_at", UTC_MICROS),
            ("metadata", pa.string()),
            ("event_id", pa.string()),
            ("origin_step_key", pa.string()),
            ("prompt_len", pa.int64()),
            ("response_len", pa.int64()),
            ("sequence_hash", pa.int64()),
            ("has_log_probs", pa.bool_()),
            ("tokenizer", pa.string()),
            ("fragment", pa.int64()),
            ("fragment_reason", pa.string()),
            *POLICY_RUN_COLUMNS,
            ("partial_step_keys", pa.list_(pa.string())),
            ("partial_event_ids", pa.list_(pa.string())),
            *PROMPT_LAYOUT_COLUMNS,
        ]
    ),
    partition_by=("policy_version",),
    sort_by=("step_key",),
    row_group_rows=1024,
    change_feed=True,
    description="One step: state (prompt ids), action (response ids) and provenance. "
    "`origin_step_key` is the key the gateway gave an unscoped call before stitching; "
    "`sequence_hash` (unscoped calls) is the rolling hash later calls are matched against; "
    "`has_log_probs`: the step carries its behaviour log-probs; `tokenizer`: the fingerprint of "
    "the tokenizer its ids belong to, when known (claw_pipelines.lake.tokenizers); `fragment`: "
    "which stretch of its trajectory the step is in (0, then one more at every turn whose "
    "prompt does not extend the previous turn's), `fragment_reason`: why a turn starts one "
    "(claw_pipelines.transforms.fragments; null for steps written before fragments). A step "
    "joined from aborted generations and their continuation (claw_pipelines.transforms."
    "partials) lists them in `partial_step_keys` / `partial_event_ids` and carries its "
    "response's policy versions as runs (`policy_version_runs`, `policy_run_lengths`; null: "
    "the whole response is `policy_version`'s). A prompt that begins with an earlier step's "
    "tokens is stored as `prefix_step_key`, `prefix_len` and its new tokens "
    "(`prompt_suffix_ids`; `prompt_ids` null): claw_pipelines.transforms.contexts.",
)

SILVER_STEP_CONFLICTS_SPEC = TableSpec(
    SILVER_STEP_CONFLICTS,
    pa.schema(
        [
            pa.field("step_key", pa.string(), nullable=False),
            pa.field("event_id", pa.string(), nullable=False),
            ("kept_event_id", pa.string()),
            ("prompt_id", pa.string()),
            ("response_id", pa.string()),
            ("kept_prompt_id", pa.string()),
            ("kept_response_id", pa.string()),
            ("tenant", pa.string()),
            ("created_at", UTC_MICROS),
            ("bronze_version", pa.int64()),
        ]
    ),
    description="Steps kept out of silver: same step_key as a stored step, different tokens.",
)

SILVER_FEEDBACK_SPEC = TableSpec(
    SILVER_FEEDBACK,
    pa.schema(
        [
            pa.field("feedback_id", pa.string(), nullable=False),
            ("step_key", pa.string()),
            ("trajectory_uid", pa.string()),
            ("kind", pa.string()),
            ("value_number", pa.float64()),
            ("value_text", pa.string()),
            ("value_json", pa.string()),
            ("source", pa.string()),
            ("annotator", pa.string()),
            ("judge", pa.string()),
            ("judge_version", pa.string()),
            ("tenant", pa.string()),
            ("created_at", UTC_MICROS),
            ("received_at", UTC_MICROS),
            ("origin_kind", pa.string()),
            ("event_id", pa.string()),
            ("metadata", pa.string()),
        ]
    ),
    description="One reward or feedback fact; append-only, superseded by rule, never updated.",
)

SILVER_TRAJECTORIES_SPEC = TableSpec(
    SILVER_TRAJECTORIES,
    pa.schema(
        [
            pa.field("trajectory_uid", pa.string(), nullable=False),
            ("prompt_uid", pa.string()),
            ("tenant", pa.string()),
            ("status", pa.string()),
            ("num_steps", pa.int64()),
            ("step_keys", pa.list_(pa.string())),
            ("resolved_return", pa.float64()),
            ("min_policy_version", pa.int64()),
            ("max_policy_version", pa.int64()),
            ("first_seen_at", UTC_MICROS),
            ("last_seen_at", UTC_MICROS),
        ]
    ),
    change_feed=True,
    description="One trajectory: its steps, status and resolved return. Each silver run "
    "rewrites the rows of the trajectories it touched (the change feed says which).",
)

SILVER_STEP_REWARDS_SPEC = TableSpec(
    SILVER_STEP_REWARDS,
    pa.schema(
        [
            pa.field("step_key", pa.string(), nullable=False),
            pa.field("trajectory_uid", pa.string(), nullable=False),
            ("step_index", pa.int64()),
            ("reward", pa.float64()),
            ("reward_status", pa.string()),
            ("reward_source", pa.string()),
            ("reward_feedback_id", pa.string()),
            ("reward_target", pa.string()),
            ("num_reward_facts", pa.int64()),
            ("rating", pa.float64()),
            ("num_ratings", pa.int64()),
            ("labels", pa.list_(pa.string())),
            ("num_corrections", pa.int64()),
            ("created_at", UTC_MICROS),
        ]
    ),
    description="Each step's resolved reward (latest fact wins) and its human quality signals; "
    "`created_at` is the step's (a rewrite of recent trajectories skips older files by it).",
)

GOLD_LINEAGE_SPEC = TableSpec(
    GOLD_LINEAGE,
    pa.schema(
        [
            pa.field("dataset", pa.string(), nullable=False),
            pa.field("dataset_version", pa.int64(), nullable=False),
            ("policy_version", pa.int64()),
            ("trees_version", pa.int64()),
            ("spec_json", pa.string()),
            ("spec_hash", pa.string()),
            ("source_versions", pa.string()),
            ("code_version", pa.string()),
            ("rows", pa.int64()),
            ("steps", pa.int64()),
            ("trees", pa.int64()),
            ("raw_tokens", pa.int64()),
            ("tree_tokens", pa.int64()),
            ("saved_tokens", pa.int64()),
            ("token_ratio", pa.float64()),
            ("written_at", UTC_MICROS),
            ("reason", pa.string()),
        ]
    ),
    change_feed=True,  # trainers read the rows written since they last looked, not the table
    description="One gold dataset write (one policy-version partition) and what it was built "
    "from: spec and hash, source table versions, code version, counts and token savings, and "
    "why it was written (`build`, or what a repair fixed).",
)

GOLD_CONSUMPTION_SPEC = TableSpec(
    GOLD_CONSUMPTION,
    pa.schema(
        [
            pa.field("consumer", pa.string(), nullable=False),
            pa.field("dataset", pa.string(), nullable=False),
            pa.field("dataset_version", pa.int64(), nullable=False),
            ("policy_version", pa.int64()),
            ("batch_index", pa.int64()),
            ("step_keys", pa.list_(pa.string())),
            ("consumed_at", UTC_MICROS),
            ("rank", pa.int64()),
            ("world_size", pa.int64()),
            ("groups", pa.list_(pa.string())),
            ("kind", pa.string()),
            # aligned with `groups`: each group's use number in this batch (1 = its first
            # delivery to the rank); added with reuse: rows written before hold null
            ("uses", pa.list_(pa.int64())),
            ("token_floor", pa.int64()),
        ]
    ),
    description="One batch pulled by a trainer, with the exact dataset version: `batches` "
    "(a partition, in order) or `next` (live delivery: its groups, each once per consumer "
    "rank, or up to `max_uses` times, with each group's use number in `uses`); "
    "`token_floor`: the policy version below which its tokens were masked out of the loss "
    "(a spec with token-level staleness).",
)

GOLD_TRAINER_FEEDBACK_SPEC = TableSpec(
    GOLD_TRAINER_FEEDBACK,
    pa.schema(
        [
            pa.field("consumer", pa.string(), nullable=False),
            pa.field("dataset", pa.string(), nullable=False),
            ("rank", pa.int64()),
            ("batch_index", pa.int64()),
            pa.field("step_key", pa.string(), nullable=False),
            ("policy_version", pa.int64()),
            ("dataset_version", pa.int64()),
            ("trainer_log_probs", LOGPROB_LIST),
            ("behaviour_log_probs", LOGPROB_LIST),
            ("tokens_compared", pa.int64()),
            ("mean_abs_diff", pa.float64()),
            ("k1", pa.float64()),
            ("k3", pa.float64()),
            ("outside_band", pa.float64()),
            ("band_low", pa.float64()),
            ("band_high", pa.float64()),
            ("loss", pa.float64()),
            ("train_step", pa.int64()),
            ("recorded_at", UTC_MICROS),
        ]
    ),
    description="One step of a batch `next_batch` delivered, as its trainer fed it back "
    "(`Dataset.record_feedback`): the trainer's log-prob of each response token of the step "
    "beside the behaviour log-prob the batch carried (both null where not trained or not "
    "captured), the step's mismatch over the tokens carrying both (`tokens_compared`, "
    "`mean_abs_diff`, KL estimates `k1` and `k3`, the share of importance ratios outside "
    "[`band_low`, `band_high`]: summaries read these, not the lists), the batch's loss and "
    "train step when given; once per (dataset, consumer, rank, batch_index).",
)

GOLD_POLICY_VERSIONS_SPEC = TableSpec(
    GOLD_POLICY_VERSIONS,
    pa.schema(
        [
            pa.field("policy_version", pa.int64(), nullable=False),
            pa.field("published_at", UTC_MICROS, nullable=False),
            ("published_by", pa.string()),
            ("note", pa.string()),
        ]
    ),
    description="One policy version a trainer published, newest last: the version the gateway "
    "stamps on steps that name none, and staleness counts from.",
)

SHARD_LEASES_SPEC = TableSpec(
    SHARD_LEASES,
    pa.schema(
        [
            pa.field("shard_count", pa.int32(), nullable=False),
            pa.field("shard_index", pa.int32(), nullable=False),
            pa.field("owner", pa.string(), nullable=False),
            pa.field("token", pa.int64(), nullable=False),
            pa.field("acquired_at", UTC_MICROS, nullable=False),
            pa.field("renewed_at", UTC_MICROS, nullable=False),
            pa.field("expires_at", UTC_MICROS, nullable=False),
            ("released_at", UTC_MICROS),
        ]
    ),
    partition_by=("shard_count", "shard_index"),
    description="Who owns each materializer shard (`shard_index` of `shard_count`): one row a "
    "shard, rewritten by each acquisition, renewal and release. `token` (the fencing token) "
    "grows with every change of owner; every commit of the shard's writer carries it, so a "
    "follower presumed dead that comes back cannot commit (claw_pipelines.lake.leases).",
)

TABLES: dict[str, TableSpec] = {
    spec.name: spec
    for spec in (
        BRONZE_EVENTS_SPEC,
        SILVER_STEPS_SPEC,
        SILVER_FEEDBACK_SPEC,
        SILVER_TRAJECTORIES_SPEC,
        SILVER_STEP_REWARDS_SPEC,
        SILVER_STEP_CONFLICTS_SPEC,
        GOLD_LINEAGE_SPEC,
        GOLD_CONSUMPTION_SPEC,
        GOLD_TRAINER_FEEDBACK_SPEC,
        GOLD_POLICY_VERSIONS_SPEC,
        SHARD_LEASES_SPEC,
    )
}


def gold_dataset_table(name: str) -> str:
    """Table path of the gold dataset `name`."""
    return f"{GOLD_DATASETS_PREFIX}/{name}"


def gold_tree_table(name: str) -> str:
    """Table path of the merged prefix trees of dataset `name`."""
    return f"{GOLD_TREES_PREFIX}/{name}"


GOLD_DATASET_SCHEMA = pa.schema(
    [
        pa.field("step_key", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        ("trajectory_uid", pa.string()),
        ("step_index", pa.int64()),
        ("prompt_uid", pa.string()),
        ("prompt_ids", TOKEN_LIST),
        ("response_ids", TOKEN_LIST),
        ("rollout_log_probs", LOGPROB_LIST),
        ("response_mask", MASK_LIST),
        ("prompt_len", pa.int64()),
        ("response_len", pa.int64()),
        ("reward", pa.float64()),
        ("reward_status", pa.string()),
        ("advantage", pa.float64()),
        ("trajectory_status", pa.string()),
        ("trajectory_return", pa.float64()),
        ("rating", pa.float64()),
        ("labels", pa.list_(pa.string())),
        ("token_source", pa.string()),
        ("has_log_probs", pa.bool_()),
        ("tokenizer", pa.string()),
        ("finish_reason", pa.string()),
        ("model", pa.string()),
        ("tenant", pa.string()),
        ("source_kind", pa.string()),
        ("created_at", UTC_MICROS),
        ("event_id", pa.string()),
        ("tree_id", pa.string()),
        ("segment", pa.int64()),
        ("spec_hash", pa.string()),
        ("admission", pa.string()),
        ("generation_ms", pa.float64()),
        ("landed_at", UTC_MICROS),
        ("fragment", pa.int64()),
        ("fragment_reason", pa.string()),
        *POLICY_RUN_COLUMNS,  # declared since: last, where an older table gets them
        *PROMPT_LAYOUT_COLUMNS,
    ]
)

GOLD_TREE_SCHEMA = pa.schema(
    [
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("tree_id", pa.string(), nullable=False),
        pa.field("segment", pa.int64(), nullable=False),
        ("parent", pa.int64()),
        ("start_depth", pa.int64()),
        ("end_depth", pa.int64()),
        ("tokens", TOKEN_LIST),
        ("step_key", pa.string()),
        ("path", pa.list_(pa.int64())),
    ]
)


GOLD_REJECTION_SCHEMA = pa.schema(
    [
        pa.field("step_key", pa.string(), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        ("trajectory_uid", pa.string()),
        ("step_index", pa.int64()),
        ("group_key", pa.string()),
        ("reason", pa.string()),
        ("reasons", pa.list_(pa.string())),
        ("prompt_len", pa.int64()),
        ("response_len", pa.int64()),
        ("generation_ms", pa.float64()),
        ("reward", pa.float64()),
        ("reward_status", pa.string()),
        ("trajectory_status", pa.string()),
        ("trajectory_return", pa.float64()),
        ("spec_hash", pa.string()),
        ("landed_at", UTC_MICROS),
    ]
)


def gold_rejection_table(name: str) -> str:
    """Table path of the steps dataset `name`'s spec leaves out."""
    return f"{GOLD_REJECTIONS_PREFIX}/{name}"


def gold_rejection_spec(name: str) -> TableSpec:
    """The steps dataset `name`'s spec leaves out (a view of silver: keys and small columns,
    no tokens), each with its `reason` (the first rule it fails) and every rule it fails
    (`reasons`); partitioned by policy version, rewritten with the dataset's partitions."""
    return TableSpec(
        gold_rejection_table(name),
        GOLD_REJECTION_SCHEMA,
        partition_by=("policy_version",),
        description=f"Steps the spec of gold dataset {name} leaves out, and why.",
    )


def gold_dataset_spec(name: str) -> TableSpec:
    """The table of gold dataset `name`: curated steps, partitioned by policy version."""
    return TableSpec(
        gold_dataset_table(name),
        GOLD_DATASET_SCHEMA,
        partition_by=("policy_version",),
        change_feed=True,  # live delivery reads what each increment changed, not the table
        description=f"Gold dataset {name}: curated, training-ready steps.",
    )


def gold_tree_spec(name: str) -> TableSpec:
    """The prefix trees of dataset `name`: one segment per step, partitioned by version.

    Segment `segment` (numbered within its partition) holds the step's tokens after depth
    `start_depth` (shared ones are stored once, in ancestors), hangs off segment `parent`
    (-1: a root) and `path` lists the segments from the root to it: concatenating each
    ancestor's tokens up to the next one's `start_depth`, then its own, rebuilds the step's
    `prompt_ids + response_ids` (`end_depth` tokens)."""
    return TableSpec(
        gold_tree_table(name),
        GOLD_TREE_SCHEMA,
        partition_by=("policy_version",),
        description=f"Prefix trees of gold dataset {name}.",
        compact_lists=True,  # what trainers read: ~30 % smaller with a dictionary of ids
    )


def table_spec(name: str) -> TableSpec | None:
    """The spec of lake table `name` (a gold dataset's, trees' and rejections' too), or None
    when no table of that name is declared."""
    if name in TABLES:
        return TABLES[name]
    for prefix, spec in (
        (GOLD_DATASETS_PREFIX, gold_dataset_spec),
        (GOLD_TREES_PREFIX, gold_tree_spec),
        (GOLD_REJECTIONS_PREFIX, gold_rejection_spec),
    ):
        if name.startswith(prefix + "/"):
            return spec(name[len(prefix) + 1 :])
    return None

"""Settings from the environment (`CLAW_` prefix, optional `.env`); defaults run locally."""

from __future__ import annotations

import hashlib
import json
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

REMOTE_SCHEMES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "abfss://")


def unsafe_storage_option(options: dict[str, str]) -> str | None:
    """Why a storage option would let concurrent Delta commits be lost (None when none does).

    delta-rs 1.x commits with conditional puts (`If-None-Match: *`), which need no lock and no
    option; these options only switch that off or tell a wrong story."""
    for key, value in options.items():
        name, setting = key.upper(), str(value).strip().lower()
        if name == "AWS_S3_ALLOW_UNSAFE_RENAME" and setting not in ("", "false", "0"):
            return (
                f"{key} tells delta-rs that no other writer exists; remove it (delta-rs 1.x "
                "commits with conditional puts, safe for concurrent writers)"
            )
        if name in (
            "AWS_S3_LOCKING_PROVIDER",
            "AWS_S3_DYNAMODB_TABLE_NAME",
            "DELTA_DYNAMO_TABLE_NAME",
        ):
            return (
                f"{key}: delta-rs 1.x ignores DynamoDB locking (it commits with conditional "
                "puts); remove it"
            )
        if name in ("CONDITIONAL_PUT", "AWS_CONDITIONAL_PUT") and setting == "disabled":
            return f"{key}=disabled switches off the conditional puts Delta commits need"
    return None


def read_storage_options_file(path: Path) -> dict[str, str]:
    """The storage options in a JSON file (`CLAW_STORAGE_OPTIONS_FILE`, e.g. the credentials
    `claw lake-secrets` writes for one component): a JSON object of strings."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise ValueError(f"{path}: not a JSON object of strings")
    return value


def default_gateway_id() -> str:
    """A stable id for this host's gateway: it names its WAL and its Delta transactions."""
    return "gw-" + re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:60]


class ClawSettings(BaseSettings):
    """Every knob of the lakehouse; read once at start-up."""

    model_config = SettingsConfigDict(
        env_prefix="CLAW_", env_file=".env", extra="ignore", frozen=True
    )

    lake_uri: str = Field("./lake", description="local path or s3:// gs:// az:// URI")
    storage_options_file: Path | None = Field(
        None,
        description="JSON file of storage options (a component's credentials) under "
        "CLAW_STORAGE_OPTIONS, whose keys win; read at start-up",
    )
    storage_options: dict[str, str] = Field(
        default_factory=dict,
        validate_default=True,  # the file's options are merged in even when this is unset
        description="JSON object passed to delta-rs object stores",
    )
    upstream_url: str | None = Field(
        None,
        description="OpenAI base URL of the inference server (several replicas: comma-separated)",
    )
    upstream_timeout_s: float = Field(
        600.0, gt=0, description="longest wait for the upstream (connect, or between two reads)"
    )
    upstream_client: Literal["http1", "httpx"] = Field(
        "http1", description="the proxy's client: the lean HTTP/1.1 one, or httpx"
    )
    tokenizer: str | None = Field(
        None,
        description="the model's Hugging Face tokenizer directory (tokenizer.json and "
        "tokenizer_config.json with its chat_template), or a bare tokenizer.json (ChatML)",
    )
    token_in: Literal["off", "auto", "on"] = Field(
        "off",
        description="scoped chat calls go upstream as the trajectory's exact token ids: off, "
        "auto (when the call and the upstream allow it) or on (refuse calls that cannot)",
    )
    api_keys: str | None = Field(
        None, description="'key=tenant,key2=tenant2'; keys may be given as sha256:<hex> hashes"
    )
    api_keys_file: Path | None = Field(
        None, description="file of 'sha256:<hex> tenant [admin]' lines"
    )
    api_key: str | None = Field(
        None,
        description="the key this process presents to read the lake (trainers, exports, the "
        "CLI): its tenant's data only, unless it is an admin key",
    )

    gateway_id: str = Field(default_factory=default_gateway_id)
    wal_dir: Path | None = Field(None, description="default: <lake>/_wal when the lake is local")
    flush_interval_ms: int = Field(1000, ge=1, le=60_000)
    flush_max_records: int = Field(8_192, ge=1)
    flush_max_bytes: int = Field(64 * 2**20, ge=1)
    wal_max_backlog_bytes: int = Field(1 * 2**30, ge=1)
    max_body_bytes: int = Field(32 * 2**20, ge=1)
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="a request body not fully received by then gets 408"
    )
    dedup_capacity: int = Field(500_000, ge=0, description="recent event_ids kept for retries")
    redact_secrets: bool = Field(
        True, description="replace credential shapes in stored payloads by [REDACTED:kind]"
    )
    otel_trajectory_from: str = Field(
        "gen_ai.conversation.id,session.id,trace",
        description="where a traced call's trajectory comes from when its span has no "
        "claw.trajectory_uid: span attributes to try in order, `trace` for its trace",
    )

    stitch_window_s: float = Field(
        3600.0, gt=0, description="longest gap between turns stitched into one trajectory"
    )
    idle_timeout_s: float = Field(
        3600.0, gt=0, description="an open trajectory idle this long becomes abandoned"
    )
    follower_state: Path | None = Field(
        None,
        description="the follower's history of silver on local disk (a cache of the lake, "
        "rebuilt from it when lost); default: <lake>/_follower for a local lake, else "
        "~/.cache/claw/follower/<the lake's hash>",
    )
    follower_hot_steps: int = Field(
        100_000,
        ge=0,
        description="steps of open and recent trajectories a follower keeps "
        "in memory (the rest is read back from its history); 0: all of silver",
    )
    shard: str | None = Field(
        None,
        description="`claw materialize --follow`'s shard, i/N (as --shard); or give "
        "CLAW_SHARD_INDEX and CLAW_SHARD_COUNT (a Kubernetes StatefulSet: the index from the "
        "pod's ordinal)",
    )
    shard_index: int | None = Field(None, ge=0, description="see `shard`")
    shard_count: int | None = Field(None, ge=1, description="see `shard`")
    shard_lease_ttl_s: float = Field(
        30.0,
        gt=0,
        description="a shard follower's lease lapses this long after its last renewal "
        "(renewed every third of it); then another follower may take the shard over",
    )
    rebuild_executor: Literal["multiprocess", "k8s"] = Field(
        "multiprocess",
        description="how `gold_rebuild_job` runs its shares: processes of its run "
        "(multiprocess), or a Kubernetes Job each (k8s: dagster-k8s's k8s_job_executor, "
        "the `k8s` extra)",
    )
    trajectory_reward_to: Literal["last", "every"] = Field(
        "last", description="steps a trajectory-level reward addresses"
    )
    metrics_public: bool = Field(
        False,
        description="answer GET /metrics without an API key (health routes always are); "
        "by default it needs one, like every other route, when keys are configured",
    )
    gateway_url: str | None = Field(
        None, description="the gateway the dashboard shows health from (its /metrics)"
    )
    gateway_key: str | None = Field(
        None, description="API key the dashboard sends to read a keyed gateway's /metrics"
    )
    dagster_url: str | None = Field(
        None, description="Dagster webserver the dashboard asks for runs (GraphQL)"
    )
    dashboard_users_file: Path | None = Field(
        None,
        description="file of 'email tenant [admin]' lines: the tenant each identity of the "
        "dashboard's OpenID Connect login reads (an identity without a line sees nothing)",
    )
    run_retries: int = Field(
        4,
        ge=0,
        description="a failed Dagster sensor run is asked for again this many times "
        "for the same inputs, then reported as failing until they change",
    )
    run_retry_first_s: float = Field(
        30.0,
        gt=0,
        description="the wait before a failed sensor run's first retry (doubling "
        "with each failure in a row, up to 10 minutes)",
    )
    retention_hours: int = Field(
        168, ge=168, description="maintenance keeps files of versions younger than this"
    )

    @field_validator("storage_options_file")
    @classmethod
    def _storage_options_file_is_readable(cls, value: Path | None) -> Path | None:
        if value is not None:
            read_storage_options_file(value)
        return value

    @field_validator("storage_options")
    @classmethod
    def _storage_options_keep_commits_safe(
        cls, value: dict[str, str], info: ValidationInfo
    ) -> dict[str, str]:
        if info.data.get("storage_options_file") is not None:
            value = read_storage_options_file(info.data["storage_options_file"]) | value
        problem = unsafe_storage_option(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("gateway_id")
    @classmethod
    def _gateway_id_is_a_safe_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", value):
            raise ValueError("use letters, digits, '.', '_' and '-' (it names files)")
        return value

    @property
    def lake_is_remote(self) -> bool:
        """True when the lake lives in an object store."""
        return self.lake_uri.startswith(REMOTE_SCHEMES)

    @property
    def resolved_wal_dir(self) -> Path:
        """Directory of this gateway's write-ahead log."""
        if self.wal_dir is not None:
            base = self.wal_dir
        elif self.lake_is_remote:
            base = Path.home() / ".cache" / "claw" / "wal"
        else:
            base = Path(self.lake_uri.removeprefix("file://")) / "_wal"
        return base / self.gateway_id

    @property
    def resolved_shard(self) -> str | None:
        """The follower's shard as "i/N": `shard`, else `shard_index` of `shard_count`."""
        if self.shard:
            return self.shard
        if self.shard_index is None and self.shard_count is None:
            return None
        if self.shard_index is None or self.shard_count is None:
            raise ValueError("CLAW_SHARD_INDEX and CLAW_SHARD_COUNT go together")
        if self.shard_count == 1 and self.shard_index == 0:
            return None  # one follower: the whole lake, unsharded
        return f"{self.shard_index}/{self.shard_count}"

    @property
    def resolved_follower_state(self) -> Path:
        """Folder of the follower's history of silver (one per lake)."""
        if self.follower_state is not None:
            return self.follower_state
        if not self.lake_is_remote:
            return Path(self.lake_uri.removeprefix("file://")) / "_follower"
        digest = hashlib.sha256(self.lake_uri.encode()).hexdigest()[:16]
        return Path.home() / ".cache" / "claw" / "follower" / digest

    def to_env(self) -> dict[str, str]:
        """The `CLAW_*` environment that gives a child process exactly these settings."""
        env = {}
        for name, value in self.model_dump(exclude_none=True).items():
            env[f"CLAW_{name.upper()}"] = (
                json.dumps(value) if isinstance(value, dict) else str(value)
            )
        env["CLAW_WAL_DIR"] = str(self.resolved_wal_dir.parent)
        if self.storage_options_file is not None:  # its options (secrets) stay in the file
            kept = read_storage_options_file(self.storage_options_file)
            own = {k: v for k, v in self.storage_options.items() if kept.get(k) != v}
            env["CLAW_STORAGE_OPTIONS"] = json.dumps(own)
        return env

    def with_overrides(self, **values: Any) -> ClawSettings:
        """A copy with some fields replaced (CLI flags over the environment)."""
        values = {k: v for k, v in values.items() if v is not None}
        return self.model_copy(update=values) if values else self

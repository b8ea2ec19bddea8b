"""Public contract: wire models, limits and table schemas. Imports nothing of the project."""

from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    BRONZE_EVENTS_SPEC,
    RECORD_KINDS,
    SCHEMA_VERSION,
    STEP_KINDS,
    TABLES,
    TableSpec,
)
from claw_pipelines.contracts.wire import (
    Accepted,
    ClawR1Step,
    ErrorResponse,
    Event,
    Feedback,
    Step,
    StepBatch,
    SubmitStepsRequest,
    TrajectoryCompleted,
    TrajectoryCompletion,
)

__all__ = [
    "BRONZE_EVENTS",
    "BRONZE_EVENTS_SPEC",
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "STEP_KINDS",
    "TABLES",
    "Accepted",
    "ClawR1Step",
    "ErrorResponse",
    "Event",
    "Feedback",
    "Step",
    "StepBatch",
    "SubmitStepsRequest",
    "TableSpec",
    "TrajectoryCompleted",
    "TrajectoryCompletion",
]

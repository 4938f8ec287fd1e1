"""What the REST service stores and returns: job specs, states, conditions, attempts.

One job record (`JobRecord`) per job, as JSON at `<ns>/api/jobs/<id>`; it is
the only state the service has, so any replica can answer for any job and a
restart loses nothing.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

ID_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"  # a DNS label: also a container name
LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62})$")


class JobState(StrEnum):
    PENDING = "PENDING"  # queued: waiting for worker slots
    STARTING = "STARTING"  # an attempt's members are being started
    RUNNING = "RUNNING"  # every member of the attempt passed `connect`
    RESTARTING = "RESTARTING"  # an attempt failed and `max_restarts` allows another
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class Launcher(StrEnum):
    LOCAL = "local"  # worker processes on the service's machine
    DOCKER = "docker"  # containers through the docker SDK (podman's socket works)
    AGENTS = "agents"  # processes run by `coordinator agent`s on any number of hosts
    KUBERNETES = "kubernetes"  # an Indexed Job's pods


class JobSpec(BaseModel):
    """What a user submits. Two submits of the same id must carry an equal spec."""

    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, Field(pattern=ID_PATTERN, description="[generated when absent]")] = ""
    kind: Annotated[str, Field(description="noop, steps, xgboost or mnist")]
    workers: Annotated[int, Field(ge=1, le=1024)]
    params: dict[str, str] = Field(default_factory=dict)
    launcher: Annotated[Launcher, Field(description="[the service's default]")] = Launcher.LOCAL
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 0
    deadline_seconds: Annotated[float | None, Field(gt=0, le=30 * 86400)] = None
    priority: Annotated[int, Field(ge=-1000, le=1000)] = 0
    labels: dict[str, str] = Field(default_factory=dict)
    agent_selector: Annotated[
        dict[str, str],
        Field(description="agents launcher: labels an agent must carry to run a member"),
    ] = Field(default_factory=dict)

    @field_validator("params", mode="before")
    @classmethod
    def _params_as_text(cls, value: Any) -> Any:
        """Parameters reach workers as `--param k=v`: numbers and booleans become text."""
        if isinstance(value, dict):
            return {key: _as_text(item) for key, item in value.items()}
        return value

    @field_validator("labels", "agent_selector")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key, text in value.items():
            if not LABEL_KEY.match(key) or len(text) > 63:
                raise ValueError(f"label {key!r}: keys are 1-63 of [A-Za-z0-9._/-], values <= 63")
        return value


def _as_text(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value  # text, or something pydantic then refuses


class Condition(BaseModel):
    """One state the job entered: when and why (the job's history)."""

    state: JobState
    reason: str
    at: float  # Unix time


class Member(BaseModel):
    """One member of an attempt, as the launcher and the member's own output tell."""

    index: int  # the launcher's numbering (0..workers-1); the rank is the rendezvous'
    pid: int | None = None
    container: str | None = None
    assignment: str | None = None  # agents: "<agent id>/<member name>"
    started: float | None = None  # process start time: tells a reused pid apart
    log: str | None = None  # where a local member's output goes
    rank: int | None = None
    address: str | None = None
    phase: str = "starting"
    exit_code: int | None = None
    failure: dict[str, Any] | None = None  # the member's `failed` event


class Attempt(BaseModel):
    number: int  # 1, 2, ...
    started_at: float
    ended_at: float | None = None
    members: list[Member] = Field(default_factory=list)
    outcome: str | None = None  # why the attempt ended (or is being ended)
    # Once the attempt is being stopped: when the members got SIGTERM, and the state the
    # job enters once they are all gone.
    stopping_since: float | None = None
    then: JobState | None = None


class Progress(BaseModel):
    step: int | None = None  # rounds (xgboost) or steps (steps, mnist) done
    total: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)
    updated_at: float | None = None


class JobRecord(BaseModel):
    id: str
    uid: str  # unique per submission: an id used again after a delete is another job
    spec: JobSpec
    state: JobState
    conditions: list[Condition]
    attempts: list[Attempt] = Field(default_factory=list)
    progress: Progress = Field(default_factory=Progress)
    artifacts: dict[str, str] = Field(default_factory=dict)
    submitted_at: float
    cancel_requested_at: float | None = None

    @property
    def attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def run_id(self) -> str:
        """What launchers name this submission's members and logs by."""
        return f"{self.id}-{self.uid[:8]}"


class JobList(BaseModel):
    jobs: list[JobRecord]
    next_page_token: str | None = None

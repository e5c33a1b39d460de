"""What the operator allows graders to do, as one typed object that crosses processes: the
API builds it from the settings to validate and run graders, the worker writes it into the
job's runtime (spec.json) for the trainer. The judge's API key never travels in it: the
trainer reads it from its environment (the worker's FTUNE_GRADER_JUDGE_API_KEY)."""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field

from core.graders.sandbox import SandboxLimits, sandbox_refusal
from core.graders.text import meteor_available, similarity_installed
from core.infra.netguard import NetPolicy
from core.infra.settings import Settings
from core.spec.graders import PYTHON_OFF, GraderCapabilities

JUDGE_KEY_ENV = "FTUNE_GRADER_JUDGE_API_KEY"


class GraderRuntime(BaseModel):
    model_config = ConfigDict(extra="forbid")

    python: bool = False
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_mb: int = 1024
    processes: int = 16
    judge_url: str | None = None
    judge_allowed_networks: list[str] = Field(default_factory=list)
    judge_allow_http: bool = False
    judge_timeout_seconds: float = 60.0
    max_failure_ratio: float = 0.2
    no_signal_steps: int | None = None  # None: 10% of the steps, at least 3; 0: never

    @classmethod
    def from_settings(cls, s: Settings) -> GraderRuntime:
        return cls(
            python=s.python_graders,
            wall_seconds=s.python_grader_wall_seconds,
            cpu_seconds=s.python_grader_cpu_seconds,
            memory_mb=s.python_grader_memory_mb,
            processes=s.python_grader_processes,
            judge_url=s.grader_judge_url,
            judge_allowed_networks=list(s.grader_judge_allowed_networks),
            judge_allow_http=s.grader_judge_allow_http,
            judge_timeout_seconds=s.grader_judge_timeout_seconds,
            max_failure_ratio=s.grader_max_failure_ratio,
            no_signal_steps=s.grpo_no_signal_steps,
        )

    def sandbox_limits(self) -> SandboxLimits:
        return SandboxLimits(
            wall_seconds=self.wall_seconds,
            cpu_seconds=self.cpu_seconds,
            memory_bytes=self.memory_mb << 20,
            processes=self.processes,
        )

    def judge_policy(self) -> NetPolicy:
        return NetPolicy(tuple(self.judge_allowed_networks), self.judge_allow_http)

    def judge_api_key(self) -> str | None:
        return os.environ.get(JUDGE_KEY_ENV) or None

    def python_refusal(self) -> str | None:
        """Why python graders are refused here (the operator's switch, or the sandbox that
        cannot start on this host, each with its fix), or None."""
        if not self.python:
            return PYTHON_OFF
        reason = sandbox_refusal()
        if reason is None:
            return None
        return (f"python graders are enabled on this server (FTUNE_PYTHON_GRADERS=true) but "
                f"their sandbox cannot run: {reason}")

    def capabilities(self) -> GraderCapabilities:
        refusal = self.python_refusal()
        return GraderCapabilities(
            python=refusal is None,
            python_refusal=refusal or "",
            judge=self.judge_url is not None,
            similarity=similarity_installed(),
            meteor=similarity_installed() and meteor_available(),
        )

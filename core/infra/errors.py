"""Error vocabulary shared by the API, the worker and the trainer.

``ErrorCode`` values are what a failed job reports as ``error.code``: they say whose fault
it was. ``FtuneError`` is the one exception base of the service; each subclass carries the
HTTP status the API renders it with (the trainer raises plain exceptions and writes
``error.json``; it never needs HTTP statuses, but the codes are the same). ``TrainFailure``
is a run's failure whose cause is known (an ErrorCode and a message for the user), raised
by the trainer and by the data pipeline it shares with the estimate (core/data); the
trainer classifies every other exception (core/train/failures.py).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    # The user's input.
    invalid_spec = "invalid_spec"
    invalid_dataset = "invalid_dataset"
    model_not_found = "model_not_found"
    # A grader of training.objective grpo raised or scored outside [0, 1] too often.
    grader_failed = "grader_failed"
    # A grpo job's rewards never differed between the answers to one prompt in its first
    # steps (the grader or the prompts give GRPO nothing to learn from).
    no_reward_signal = "no_reward_signal"
    # The run.
    out_of_memory = "out_of_memory"
    nan_loss = "nan_loss"
    disk_full = "disk_full"
    strategy_mismatch = "strategy_mismatch"
    unsupported_hardware = "unsupported_hardware"
    trainer_crashed = "trainer_crashed"
    adapter_invalid = "adapter_invalid"
    timeout = "timeout"
    # The spec's evaluation could not score a model (core/evals/job_evaluation.py); the
    # trained artifact is kept and downloadable.
    evaluation_failed = "evaluation_failed"
    # The platform.
    worker_lost = "worker_lost"
    # The SLURM controller did not answer the submit for FTUNE_SLURM_SUBMIT_RETRY_SECONDS.
    slurm_unavailable = "slurm_unavailable"
    internal = "internal"


class FtuneError(Exception):
    """Base of every error the service raises on purpose; rendered by one API handler."""

    status_code: int = 400
    code: str = "bad_request"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        details: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message, "param": self.param}
        if self.details:
            body["details"] = self.details
        return {"error": body}


class NotFound(FtuneError):
    status_code = 404
    code = "not_found"


class Unauthorized(FtuneError):
    status_code = 401
    code = "unauthorized"


class Forbidden(FtuneError):
    status_code = 403
    code = "forbidden"


class Conflict(FtuneError):
    status_code = 409
    code = "conflict"


class PayloadTooLarge(FtuneError):
    status_code = 413
    code = "payload_too_large"


class RateLimited(FtuneError):
    status_code = 429
    code = "rate_limited"


class InvalidRequest(FtuneError):
    """Semantically invalid input (spec, dataset, path): 422 with every problem listed."""

    status_code = 422
    code = "invalid_request"


# ---------------------------------------------------------------------------- runs


class TrainFailure(Exception):
    """A failure whose cause is known: carries the ErrorCode and a message for the user."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid_spec(message: str) -> TrainFailure:
    return TrainFailure(ErrorCode.invalid_spec, message)


def invalid_dataset(message: str) -> TrainFailure:
    return TrainFailure(ErrorCode.invalid_dataset, message)


def model_not_found(message: str) -> TrainFailure:
    return TrainFailure(ErrorCode.model_not_found, message)


def unsupported_hardware(message: str) -> TrainFailure:
    return TrainFailure(ErrorCode.unsupported_hardware, message)


def strategy_mismatch(message: str) -> TrainFailure:
    return TrainFailure(ErrorCode.strategy_mismatch, message)


def adapter_invalid(message: str) -> TrainFailure:
    return TrainFailure(ErrorCode.adapter_invalid, message)

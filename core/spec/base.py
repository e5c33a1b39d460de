"""What every spec section shares: unknown keys refused, and the problem type that
names the field it concerns."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelled option must never be silently ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


@dataclass(frozen=True)
class Problem:
    param: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"param": self.param, "message": self.message}


class SpecError(ValueError):
    """Every problem found in a spec, each with the field path it concerns."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p.param}: {p.message}" for p in problems))

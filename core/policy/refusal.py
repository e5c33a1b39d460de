"""A refusal: why a job cannot run (here), which spec field to change, and whose fault it is."""

from __future__ import annotations

from dataclasses import dataclass

from core.infra.errors import ErrorCode


@dataclass(frozen=True)
class Refusal:
    """``param`` is the spec field to change; ``message`` what is wrong with it, as the API
    shows it beside the field; ``code`` the error a job refused for this fails with.
    ``text``: the whole sentence, where it reads better than "param: message"."""

    code: ErrorCode
    param: str
    message: str
    text: str = ""

    def __str__(self) -> str:
        return self.text or f"{self.param}: {self.message}"


def value_first(code: ErrorCode, param: str, message: str) -> Refusal:
    """A refusal whose message starts with the field's value: "<param> <value> needs ..."."""
    return Refusal(code, param, message, text=f"{param} {message}")


class Refused(Exception):
    """A rule that resolves something (a model location, a data path) could not: carries
    the refusal."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal

    @property
    def code(self) -> ErrorCode:
        return self.refusal.code

    @property
    def param(self) -> str:
        return self.refusal.param

    @property
    def message(self) -> str:
        return self.refusal.message

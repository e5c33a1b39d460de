"""Fixtures of the e2e modules that serve one stack to all their tests (a module-scoped
``stack`` fixture with ``url`` and ``api_key``: the SLURM modules'); a module may define its
own ``client`` instead (test_stack.py, faults/)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import pytest

from client import FtuneClient
from tests.utils.serving_stack import servable_lm, serving_stack  # noqa: F401 (one per session)
from tests.utils.tiny import text_rows, write_jsonl


class ServedStack(Protocol):
    @property
    def url(self) -> str: ...

    api_key: str


@pytest.fixture(scope="module")
def client(stack: ServedStack) -> Iterator[FtuneClient]:
    with FtuneClient(stack.url, stack.api_key) as c:
        yield c


@pytest.fixture(scope="module")
def data_file(client: FtuneClient, tmp_path_factory: pytest.TempPathFactory) -> str:
    """An uploaded text dataset (64 rows)."""
    path = write_jsonl(tmp_path_factory.mktemp("data") / "train.jsonl", text_rows(64))
    return str(client.upload_file(path)["id"])

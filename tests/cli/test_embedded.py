"""cli.embedded: what `ftune up` accepts by default, and what it says about it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.embedded import EMBEDDED_WORKER_NICE, EmbeddedStack


@pytest.fixture
def no_roots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FTUNE_ALLOWED_MODEL_ROOTS", raising=False)
    monkeypatch.delenv("FTUNE_ALLOWED_DATA_ROOTS", raising=False)


def test_on_loopback_any_local_directory_is_accepted(tmp_path: Path, no_roots: None) -> None:
    stack = EmbeddedStack(data_dir=tmp_path)
    env = stack.env()
    assert env["FTUNE_ALLOWED_MODEL_ROOTS"] == env["FTUNE_ALLOWED_DATA_ROOTS"] == "/"
    assert stack.describe()[0] == ("model directories: any local directory (set "
                                   "FTUNE_ALLOWED_MODEL_ROOTS to restrict)")


def test_served_beyond_this_machine_paths_wait_for_the_operators_roots(
    tmp_path: Path, no_roots: None
) -> None:
    stack = EmbeddedStack(data_dir=tmp_path, host="0.0.0.0")
    assert "FTUNE_ALLOWED_MODEL_ROOTS" not in stack.env()
    assert stack.describe()[0] == ("model directories: none: paths are refused (set "
                                   "FTUNE_ALLOWED_MODEL_ROOTS)")


def test_the_operators_roots_win(tmp_path: Path, no_roots: None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTUNE_ALLOWED_MODEL_ROOTS", "/models:/more")
    stack = EmbeddedStack(data_dir=tmp_path)
    assert stack.env()["FTUNE_ALLOWED_MODEL_ROOTS"] == "/models:/more"
    assert stack.describe()[0] == "model directories: /models, /more"


def test_the_stack_passes_the_worker_nice_on(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # As `ftune up` and `ftune demo` build it (cli/main.py, cli/demo.py).
    monkeypatch.delenv("FTUNE_WORKER_NICE", raising=False)
    stack = EmbeddedStack(data_dir=tmp_path, worker_nice=EMBEDDED_WORKER_NICE)
    assert stack.env()["FTUNE_WORKER_NICE"] == "10"


def test_the_operators_worker_nice_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FTUNE_WORKER_NICE", "0")
    stack = EmbeddedStack(data_dir=tmp_path, worker_nice=EMBEDDED_WORKER_NICE)
    assert stack.env()["FTUNE_WORKER_NICE"] == "0"


def test_a_stack_built_without_one_leaves_the_worker_at_its_nice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tests and benches that build a stack train at full speed beside other work.
    monkeypatch.delenv("FTUNE_WORKER_NICE", raising=False)
    assert "FTUNE_WORKER_NICE" not in EmbeddedStack(data_dir=tmp_path).env()

"""`ftune doctor` says whether this machine can serve models (the vLLM venv of `make engine`)."""

from __future__ import annotations

from pathlib import Path

from cli.doctor import engine_check
from core.infra.settings import Settings


def test_a_missing_engine_is_a_problem_whose_fix_is_the_make_target(tmp_path: Path) -> None:
    check = engine_check(Settings(data_dir=tmp_path, engine_venv=tmp_path / "none"))
    assert not check.ok and str(tmp_path / "none") in check.detail
    assert "make engine" in check.fix


def test_a_venv_without_vllm_is_a_problem(tmp_path: Path) -> None:
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()
    check = engine_check(Settings(data_dir=tmp_path, engine_venv=tmp_path / "venv"))
    assert not check.ok and "has no vllm" in check.detail


def test_the_installed_engine_is_ok(tmp_path: Path) -> None:
    # `make test` depends on `make engine`: the default venv is there.
    check = engine_check(Settings(data_dir=tmp_path))
    assert check.ok, check.detail
    assert "deployment" in check.detail

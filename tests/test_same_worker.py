"""tests/conftest.py's unit of work for pytest-xdist: a file, or a SAME_WORKER group whole. A
group whose path no longer exists (a file renamed or moved) would go unnoticed: its fixture
would just be built on both workers again."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SAME_WORKER, same_worker_scope

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_every_same_worker_prefix_names_a_test_file_or_folder() -> None:
    for prefix in SAME_WORKER:
        path = REPO_ROOT / prefix
        assert path.is_dir() or path.is_file(), f"SAME_WORKER names {prefix}, which is gone"


def test_a_grouped_test_goes_with_its_group_and_any_other_with_its_file() -> None:
    prefix, group = next(iter(SAME_WORKER.items()))
    assert same_worker_scope(f"{prefix}test_x.py::test_a[1]") == f"group:{group}"
    assert same_worker_scope("tests/core/train/test_probe.py::test_b") == \
        "tests/core/train/test_probe.py"

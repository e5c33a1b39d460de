"""Paths are confined to allowed roots after resolving symlinks and '..'."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.infra.paths import PathNotAllowed, confine, looks_like_hub_id


def test_path_inside_root_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "d.jsonl").write_text("{}")
    assert confine(str(tmp_path / "d.jsonl"), [tmp_path], what="data") == tmp_path / "d.jsonl"


def test_traversal_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(PathNotAllowed, match="outside"):
        confine(str(root / ".." / "etc"), [root], what="data")


def test_symlink_escape_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "link").symlink_to("/etc")
    with pytest.raises(PathNotAllowed, match="outside"):
        confine(str(root / "link" / "passwd"), [root], what="data")


def test_no_roots_means_no_paths(tmp_path: Path) -> None:
    with pytest.raises(PathNotAllowed, match="no data roots"):
        confine(str(tmp_path), [], what="data")


def test_relative_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PathNotAllowed, match="absolute"):
        confine("data/x.jsonl", [tmp_path], what="data")


@pytest.mark.parametrize("name,ok", [("org/model", True), ("gpt2", True), ("../x", False),
                                     ("/abs", False), ("a/b/c", False), ("a b", False)])
def test_hub_id_shape(name: str, ok: bool) -> None:
    assert looks_like_hub_id(name) is ok


def test_a_home_of_an_unknown_user_is_refused_not_a_crash(tmp_path: Path) -> None:
    with pytest.raises(PathNotAllowed, match="unknown user"):
        confine("~no-such-user-here/model", [tmp_path], what="model")

"""The README's map of the code ("Where is X") stays true: every folder it names exists, every
top-level folder and every group of core/ is in it with a line saying what it holds, and
core/ keeps no loose modules at its root (a new module goes into the group of its kind).

Read from the files only: nothing is imported."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MAP_HEADING = "## Where is X"
# Folders at the top that are not the project's code or documents: build and tool output.
NOT_PROJECT = {"build", "dist", "__pycache__"}


def readme_map() -> dict[str, str]:
    """The map's entries: folder (as written, with its trailing slash) -> what it holds."""
    text = (REPO_ROOT / "README.md").read_text()
    assert MAP_HEADING in text, f"README.md has no '{MAP_HEADING}' section"
    section = text.split(MAP_HEADING, 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.DOTALL)
    assert block, f"README.md's '{MAP_HEADING}' section has no code block holding the map"
    entries: dict[str, str] = {}
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        folder, _, what = line.partition(" ")
        assert folder.endswith("/"), f"map line does not start with a folder: {line!r}"
        entries[folder] = what.strip()
    return entries


def top_level_folders() -> set[str]:
    return {
        f"{p.name}/" for p in REPO_ROOT.iterdir()
        if p.is_dir() and not p.name.startswith(".") and p.name not in NOT_PROJECT
        and not p.name.endswith(".egg-info")
    }


def core_groups() -> set[str]:
    return {
        f"core/{p.name}/" for p in (REPO_ROOT / "core").iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    }


def test_every_folder_the_map_names_exists_and_says_what_it_holds() -> None:
    for folder, what in readme_map().items():
        assert (REPO_ROOT / folder).is_dir(), f"README map names {folder}, which does not exist"
        assert what, f"README map names {folder} without saying what it holds"


def test_every_top_level_folder_is_in_the_map() -> None:
    missing = top_level_folders() - readme_map().keys()
    assert not missing, f"top-level folders missing from README.md's map: {sorted(missing)}"


def test_every_group_of_core_is_in_the_map() -> None:
    missing = core_groups() - readme_map().keys()
    assert not missing, f"core/ groups missing from README.md's map: {sorted(missing)}"


def test_core_has_no_loose_modules_at_its_root() -> None:
    loose = sorted(p.name for p in (REPO_ROOT / "core").glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules at core/'s root (put each in the group of its kind): {loose}"

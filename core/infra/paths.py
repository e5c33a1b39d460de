"""Confine user-given paths to operator-configured roots, and tell a local path from a hub
id (``model_kind``: the data pipeline, the policy and the trainer ask the same question).

A path is resolved (symlinks followed, ``..`` collapsed) before the check, so neither
traversal nor a symlink pointing outside a root escapes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal


class PathNotAllowed(ValueError):
    pass


def confine(user_path: str, roots: list[Path], *, what: str, setting: str | None = None) -> Path:
    """``setting``: the variable that holds ``roots``, named in refusals so that whoever
    reads one knows what the operator would change."""
    if not user_path or "\x00" in user_path:
        raise PathNotAllowed(f"{what} path is empty or invalid")
    if not roots:
        fix = (f": the operator sets {setting} (colon-separated directories) and restarts "
               "the server" if setting else "")
        raise PathNotAllowed(f"no {what} roots are configured on this server, so {what} paths "
                             f"are refused{fix}")
    try:
        p = Path(user_path).expanduser()
    except RuntimeError:  # "~someone/..." of a user this machine does not have
        raise PathNotAllowed(f"{what} path names the home of an unknown user") from None
    if not p.is_absolute():
        raise PathNotAllowed(f"{what} path must be absolute")
    resolved = p.resolve()
    for root in roots:
        if resolved == root or resolved.is_relative_to(root):
            if not resolved.exists():
                raise PathNotAllowed(f"{what} path does not exist")
            return resolved
    allowed = ", ".join(map(str, roots))
    raise PathNotAllowed(f"{what} path is outside the allowed roots ({setting or 'roots'}: "
                         f"{allowed})")


def looks_like_hub_id(name: str) -> bool:
    """org/name or name, no path syntax: what the hub accepts as a repo id."""
    if name.startswith(("/", ".", "~")) or "\\" in name or ".." in name:
        return False
    parts = name.split("/")
    if len(parts) > 2:
        return False
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    return all(p and set(p) <= allowed for p in parts)


def model_kind(name: str) -> Literal["path", "hub", "other"]:
    """How ``model.name_or_path`` names a model: a local path ("/", "~"), a hub id
    (org/name), or neither."""
    if name.startswith(("/", "~")):
        return "path"
    if looks_like_hub_id(name):
        return "hub"
    return "other"

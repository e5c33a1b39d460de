"""A SQLite database migrated to head, in a folder of the test's: the migrations run once a
process into a template, which each later database copies (Alembic's 20 migrations take
0.2-0.5 s, and about 140 tests and modules a run ask for a database of their own). The copy
goes through SQLite's backup API, which copies a WAL database whole, pages not yet
checkpointed included."""

from __future__ import annotations

import atexit
import shutil
import sqlite3
import tempfile
from pathlib import Path

from core.db.migrate import upgrade_head

_template: Path | None = None


def sqlite_at_head(path: Path) -> str:
    """The URL of a new SQLite database at ``path`` (which must not exist), migrated to head."""
    global _template
    if _template is None:
        folder = tempfile.mkdtemp(prefix="ftune-sqlite-template-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        template = Path(folder) / "head.db"
        upgrade_head(f"sqlite:///{template}")
        _template = template
    if path.exists():
        raise FileExistsError(path)
    source, target = sqlite3.connect(_template), sqlite3.connect(path)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()
    return f"sqlite:///{path}"

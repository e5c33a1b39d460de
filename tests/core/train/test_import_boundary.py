"""core.train is a pure program: importing all of it pulls in no web, queue or DB code."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.utils.jobdirs import REPO_ROOT, trainer_env

FORBIDDEN = ("fastapi", "starlette", "celery", "kombu", "sqlalchemy", "alembic", "api", "worker")

SCRIPT = """
import importlib, json, pkgutil, sys
import core.train
names = ["core.train"] + [
    m.name for m in pkgutil.walk_packages(core.train.__path__, "core.train.")
]
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "modules": sorted(sys.modules)}))
"""


def test_core_train_imports_no_web_queue_or_db_code() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        cwd=REPO_ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"core.train.recipe", "core.train.__main__", "core.train.data"} <= set(out["imported"])
    leaked = [m for m in out["modules"] if m.split(".")[0] in FORBIDDEN]
    assert leaked == []

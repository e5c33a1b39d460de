"""core.train is a pure program: importing all of it pulls in no web, queue or DB code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
    assert {"core.train.recipe", "core.train.__main__", "core.train.model"} <= set(out["imported"])
    leaked = [m for m in out["modules"] if m.split(".")[0] in FORBIDDEN]
    assert leaked == []


ENTRY_SCRIPT = """
import sys
from pathlib import Path
from core.train.__main__ import _skip_unused_libraries
_skip_unused_libraries(Path(sys.argv[1]))
import accelerate.utils, peft, transformers
print(sys.modules.get("bitsandbytes") is not None, transformers.utils.is_bitsandbytes_available(),
      bool(accelerate.utils.is_deepspeed_available()),
      bool(transformers.integrations.is_deepspeed_available()))
"""


@pytest.mark.parametrize(("model", "distributed", "loaded"), [
    ({"quantization": None}, {"strategy": "ddp"}, [False, False, False, False]),
    ({"quantization": {"bits": 4}}, {"strategy": "ddp"}, [True, True, False, False]),
    ({"quantization": None}, {"strategy": "deepspeed"}, [False, False, True, True]),
])
def test_the_entry_imports_bitsandbytes_and_deepspeed_only_for_the_runs_that_use_them(
        tmp_path: Path, model: dict[str, Any], distributed: dict[str, Any],
        loaded: list[bool]) -> None:
    # peft imports bitsandbytes and accelerate deepspeed whenever they are installed: seconds
    # of every rank's start-up.
    (tmp_path / "spec.json").write_text(json.dumps(
        {"spec": {"model": {"name_or_path": "m", **model}, "distributed": distributed}}))
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY_SCRIPT, str(tmp_path)], check=False, cwd=REPO_ROOT,
        env=trainer_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(x) for x in loaded]

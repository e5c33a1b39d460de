"""Shared fixtures: isolated databases (SQLite and a fresh PostgreSQL database per session),
tiny offline models, and an environment that never reaches the model hub."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.build_ops import VENV_EXTENSIONS
from testkit.launch import REPO_ROOT, trainer_env
from testkit.pg import migrated_database

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# The suite's hub ids ("org/tiny-model") name no real model (fake trainers run them), and
# there is no hub here: the reachability check (core/infra/hub.py) is off except in its own tests.
os.environ.setdefault("FTUNE_HUB_CHECK", "false")
# One intra-op thread per process: the suite runs API, workers and trainer ranks side by side
# on few cores, where OpenMP's spinning threads slow tiny models down by orders of magnitude.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# DeepSpeed builds its CPU ops (cpu_adam) on first use under TORCH_EXTENSIONS_DIR, guarded by a
# `lock` file that a killed build (a test run stopped by hand) leaves behind: every later build
# then waits on it forever, CI's included. The builds live inside this venv (a fresh clone
# builds its own; `make clean` removes them), and a lock older than any build takes is removed.
TORCH_EXTENSIONS = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", VENV_EXTENSIONS))
STALE_BUILD_LOCK_SECONDS = 15 * 60


def _remove_stale_build_locks(root: Path, older_than_s: float) -> None:
    if not root.is_dir():
        return
    for lock in root.glob("**/lock"):
        try:
            if time.time() - lock.stat().st_mtime > older_than_s:
                lock.unlink()
        except FileNotFoundError:
            pass  # a build beside us finished and removed it


_remove_stale_build_locks(TORCH_EXTENSIONS, STALE_BUILD_LOCK_SECONDS)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's --dist loadfile hands out files by their number of tests, most first
    # (its "loadscope reorder"), so the files of one or two multi-minute tests (a stack, a
    # multi-process run) came last, and one worker ran them alone while the other had
    # finished. The order below replaces it.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


# Test files that share a package- or session-scoped fixture, by path prefix: under
# `--dist loadfile` (make test) the files of one group go to one worker together, in
# collection order, so that fixture is built once. By path, not by pytest-xdist's
# `xdist_group` mark: with pytest 9 its loadgroup mode ignores the mark (xdist 3.8 renames
# `item._nodeid`, which pytest 9 no longer reads), and it hands every unmarked test out on
# its own, which would build each module's fixtures on both workers.
SAME_WORKER: dict[str, str] = {
    "tests/e2e/faults/": "faults",  # one stack: API, two workers, Redis, PostgreSQL
    # tests/utils/serving_stack.py's session-scoped stack and its vLLM engine (30-90 s to
    # start, and two at once would share two cores).
    "tests/e2e/test_serving.py": "serving",
    "tests/e2e/test_evals_deployments.py": "serving",
    # Reference training runs trained once a session (tests/utils/shared_runs.py): the
    # full_runs, lora_runs and zero3_lora_two fixtures of tests/core/train/conftest.py.
    "tests/core/train/test_full_runs.py": "full-runs",
    "tests/core/train/test_full_checkpoint_runs.py": "full-runs",
    "tests/core/train/test_checkpoint_runs.py": "lora-runs",
    "tests/core/train/test_fsdp_runs.py": "lora-runs",
    "tests/core/train/test_deepspeed_runs.py": "deepspeed-runs",
    "tests/core/train/test_deepspeed_checkpoint_runs.py": "deepspeed-runs",
}


def same_worker_scope(nodeid: str) -> str:
    """The unit of work pytest-xdist hands to one worker: the test's group, else its file."""
    path = nodeid.split("::", 1)[0]
    for prefix, group in SAME_WORKER.items():
        if path.startswith(prefix):
            return f"group:{group}"
    return path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """loadfile, as xdist does it (a file at a time to each worker: a module's fixtures - a
    trained model, a stack - are built once), except that the files of a SAME_WORKER group
    are one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileOrGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return same_worker_scope(nodeid)

    return LoadFileOrGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that start a whole stack or real multi-process training (marked e2e or
    slow) first, the rest after in their usual order: the longest work starts first and the
    many short files fill both workers up to the end (xdist hands files out in this order,
    each worker taking the next when it is done)."""
    heavy = {item.path for item in items
             if item.get_closest_marker("e2e") or item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: each file stays whole


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database, migrated to head, dropped afterwards."""
    with migrated_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    from tests.utils.sqlite import sqlite_at_head

    return sqlite_at_head(tmp_path / "ftune.db")


@pytest.fixture
def settings_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sqlite_url: str):
    """Point every settings-reading module at a temp data dir and a migrated SQLite DB."""
    from core.db.session import reset_engine_cache
    from core.infra.settings import get_settings, reset_settings_cache

    monkeypatch.setenv("FTUNE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("DATABASE_URL", sqlite_url)
    monkeypatch.setenv("BROKER_URL", "filesystem://")
    reset_settings_cache()
    reset_engine_cache()
    yield get_settings()
    reset_settings_cache()
    reset_engine_cache()


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_causal_lm(models_dir: Path) -> Path:
    from tests.utils.tiny import build_causal_lm

    return build_causal_lm(models_dir / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_tied_causal_lm(models_dir: Path) -> Path:
    """The tiny Llama with its LM head tied to the input embedding (tie_word_embeddings)."""
    from tests.utils.tiny import build_llama

    return build_llama(models_dir / "tiny-llama-tied", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_seq2seq_lm(models_dir: Path) -> Path:
    from tests.utils.tiny import build_seq2seq_lm

    return build_seq2seq_lm(models_dir / "tiny-t5")


@pytest.fixture(scope="session")
def tiny_seq_cls(models_dir: Path) -> Path:
    from tests.utils.tiny import build_seq_cls

    return build_seq_cls(models_dir / "tiny-bert")


@pytest.fixture(autouse=True)
def fresh_log_context() -> Iterator[None]:
    """Each test starts with no bound log fields: tests that run the trainer's main() in
    process bind rank/job_id/attempt for the rest of the process (as the trainer should),
    and the next test in that process (any, with files run in parallel) would log them."""
    from core.infra.logging import no_bound_fields

    with no_bound_fields():
        yield


# DeepSpeed's CPU ops, built once per session: the trainer's tests, the API's checkpoint
# downloads and the SLURM stack each run DeepSpeed jobs.
def _build_ops(*ops: str) -> float:
    """Build (or load from the venv's cache) DeepSpeed's CPU ops in a process of their own
    (testkit/build_ops.py, what `make test` runs beside lint); the seconds it took."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "testkit.build_ops", *ops],
        check=False,
        cwd=REPO_ROOT,
        env={**trainer_env(), "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"DeepSpeed's {ops} do not build:\n{proc.stderr[-3000:]}"
    return time.monotonic() - t0


@pytest.fixture(scope="session")
def cpu_adam() -> float:
    """DeepSpeed's CPU Adam op, and the shared-memory collectives op every multi-process run
    on the CPU accelerator loads at init (another JIT build, ~190 s on a loaded 2-core
    machine); returns the seconds it took."""
    return _build_ops("CPUAdamBuilder", "ShareMemCommBuilder")


@pytest.fixture(scope="session")
def shm_comm() -> float:
    """Only the shared-memory collectives op: what a multi-process DeepSpeed run on CPU needs
    when nothing is offloaded (no cpu_adam)."""
    return _build_ops("ShareMemCommBuilder")

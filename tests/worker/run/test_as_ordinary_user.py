"""A whole GRPO run by a worker that is an ordinary user (uid 65534), as the Docker image
runs it (``USER ftune``): the worker claims the job, starts its grading process and the real
trainer under `accelerate launch`, the python grader runs in its sandbox (bubblewrap in user
namespaces, no root anywhere), and the job succeeds with its rewards."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.db.models import JobStatus
from core.run.jobdir import JobDir
from tests.utils.specs import grpo_spec
from tests.utils.tiny import reinforcement_rows, write_jsonl
from tests.utils.unprivileged import USER, as_user, give, python, user_env
from tests.utils.worker import (
    WorkerEnv,
    configure_worker,
    events_of,
    get_job,
    make_job,
    teardown_worker,
)

pytestmark = pytest.mark.slow

KEY = "sk-judge-" + "a11ce5" * 4
LENGTH = {"type": "python", "name": "length",
          "source": "def grade(sample, item):\n"
                    "    return min(1.0, len(sample['output_text']) / 20)\n"}
RUN_JOB = "import sys\nfrom worker.run.local import run_job\nprint(run_job(sys.argv[1]))\n"


@pytest.fixture
def user_wenv(monkeypatch: pytest.MonkeyPatch, pg_url: str) -> Iterator[WorkerEnv]:
    """A worker's world the user may enter (pytest's temporary folders are root's, 0700):
    its data directory, models and data under a folder of its own."""
    root = Path(tempfile.mkdtemp(prefix="ftune-test-user-worker-"))
    root.chmod(0o755)
    try:
        yield configure_worker(monkeypatch, root, pg_url, FTUNE_TRAINER_MODULE="core.train",
                               FTUNE_PYTHON_GRADERS="true", FTUNE_GRADER_JUDGE_API_KEY=KEY)
        teardown_worker()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_grpo_run_by_an_ordinary_users_worker_succeeds_with_its_rewards(
        user_wenv: WorkerEnv, tiny_causal_lm: Path) -> None:
    w = user_wenv
    model = shutil.copytree(tiny_causal_lm, w.model_root / "tiny-llama")
    prompts = write_jsonl(w.data_root / "prompts.jsonl", reinforcement_rows(16, seed=9))
    job_id = make_job(grpo_spec(model, {"path": str(prompts)}, LENGTH, max_steps=3,
                                save_steps=100))
    home = w.tmp / "home"
    home.mkdir()
    give(w.tmp)
    done = subprocess.run(
        as_user([python(), "-c", RUN_JOB, job_id]), cwd="/", capture_output=True, text=True,
        timeout=600, check=False, env=user_env(**w.env, HOME=str(home)))
    job = get_job(job_id)
    assert done.stdout.strip().splitlines()[-1:] == [JobStatus.succeeded], (
        job.error_code, job.error_message, done.stderr[-3000:])
    rewards = [e.data["reward"] for e in events_of(job_id, "progress") if "reward" in e.data]
    assert len(rewards) == 3 and all(0 < r <= 1 for r in rewards), rewards
    jd = JobDir(w.settings.jobs_dir / job_id)
    assert jd.adapter.stat().st_uid == USER  # written by the user's trainer
    for path in jd.root.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path

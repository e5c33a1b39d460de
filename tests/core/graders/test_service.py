"""The grading process's protocol: a batch of answers in, their scores and the counts out,
in one round trip; each connection its own counts."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from core.graders.config import GraderRuntime
from core.graders.service import RemoteGrading, serve
from core.spec.graders import parse_grader

EXACT = {"type": "string_check", "name": "exact", "input": "{{sample.output_text}}",
         "reference": "{{item.answer}}", "operation": "eq"}


def test_a_batch_is_scored_in_one_round_trip_with_its_counts() -> None:
    path = Path(tempfile.mkdtemp(prefix="ftune-test-grading-")) / "g.sock"
    ready = threading.Event()
    threading.Thread(target=serve, args=(path, parse_grader(EXACT), GraderRuntime(), ready),
                     daemon=True).start()
    assert ready.wait(10)
    first, second = RemoteGrading(str(path)), RemoteGrading(str(path))
    try:
        scores = first.grade_batch([("4", {"answer": "4"}, 1), ("5", {"answer": "4"}, 2),
                                    ("4", {}, 3)])
        assert [s.reward for s in scores] == [1.0, 0.0, 0.0]
        assert scores[2].errors == {"exact": "{{item.answer}}: no field 'answer'"}
        counts = first.stats.by_name["exact"]
        assert (counts.calls, counts.errors, counts.last_error_row) == (3, 1, 3)
        second.grade_batch([("4", {"answer": "4"}, 1)])
        assert second.stats.by_name["exact"].calls == 1  # a connection's own counts
    finally:
        first.close()
        second.close()


def test_the_grading_process_of_an_ordinary_user_runs_python_graders_in_their_sandbox(
) -> None:
    """The worker's grading process as the Docker image runs it (not root): its python
    grader runs sandboxed (no view of the run plan, the process's environment or its PIDs)
    and the judge's key it holds stays in its own environment."""
    import json
    import os
    import shutil
    import signal
    import subprocess

    from core.graders.config import GraderRuntime
    from testkit.wait import wait_until
    from tests.utils.jobdirs import make_job
    from tests.utils.unprivileged import USER, as_user, give, python, user_env

    root = Path(tempfile.mkdtemp(prefix="ftune-test-grading-user-"))
    root.chmod(0o755)
    plan_probe = ("import os\ndef grade(sample, item):\n"
                  f"    seen = os.path.exists({str(root / 'job' / 'spec.json')!r})\n"
                  "    leaked = any('sk-judge' in v for v in os.environ.values())\n"
                  "    return 0.0 if seen or leaked else (0.5 if os.getpid() < 10 else 0.25)\n")
    grader = {"type": "python", "name": "probe", "source": plan_probe}
    job = make_job(root, "/nonexistent-model", [{"messages": [{"role": "user", "content": "x"}]}],
                   spec={"dataset": {"format": "chat"},
                         "training": {"objective": "grpo", "per_device_train_batch_size": 4,
                                      "grpo": {"grader": grader, "num_generations": 4}}},
                   runtime={"graders": GraderRuntime(python=True).model_dump()})
    give(root)
    sock = root / "grading.sock"
    env = user_env(FTUNE_GRADER_JUDGE_API_KEY="sk-judge-key")
    proc = subprocess.Popen(
        as_user([python(), "-m", "core.run.grading_process", str(sock), str(job / "spec.json")]),
        env=env, cwd=Path(__file__).resolve().parents[3], start_new_session=True)
    try:
        wait_until(lambda: sock.exists() or proc.poll() is not None, 60, "the grading process")
        assert proc.poll() is None
        uid = next(line for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                   if line.startswith("Uid:"))
        assert uid.split()[1] == str(USER)
        client = RemoteGrading(str(sock))
        try:
            (score,) = client.grade_batch([("answer", {}, 1)])
        finally:
            client.close()
        assert (score.reward, score.errors) == (0.5, {}), json.dumps(score.__dict__)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        shutil.rmtree(root, ignore_errors=True)

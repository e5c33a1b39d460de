"""worker.run.trainer_log: the log's tail, and torch elastic's first failed rank."""

from __future__ import annotations

from pathlib import Path

from worker.run.trainer_log import elastic_root_cause, tail_lines

SUMMARY = """\
Failures:
[1]:
  time      : 2025-01-01_00:00:01
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 11)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_00:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 12)
  error_file: <N/A>
"""


def test_the_root_cause_is_the_rank_torch_elastic_saw_fail_first() -> None:
    assert elastic_root_cause(SUMMARY.splitlines()) == (1, -9)


def test_no_summary_no_root_cause() -> None:
    assert elastic_root_cause(["Traceback (most recent call last):", "ValueError: x"]) is None


def test_tail_lines_of_a_missing_log_are_none(tmp_path: Path) -> None:
    assert tail_lines(tmp_path / "trainer.log") == []


def test_tail_lines_keeps_the_last_n(tmp_path: Path) -> None:
    (tmp_path / "trainer.log").write_text("".join(f"line {i}\n" for i in range(100)))
    assert tail_lines(tmp_path / "trainer.log", n=3) == ["line 97", "line 98", "line 99"]

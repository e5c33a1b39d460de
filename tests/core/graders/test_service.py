"""The grading process's protocol: a batch of answers in, their scores and the counts out,
in one round trip; each connection its own counts."""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from core.graders.config import GraderRuntime
from core.graders.service import RemoteGrading, serve
from core.graders.spec import parse_grader

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

"""core.run.jobdir: files written atomically, also by writers racing on one path."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from core.run.jobdir import write_json_atomic


def test_concurrent_writers_of_one_file_never_collide(tmp_path: Path) -> None:
    # Each writer has its own temporary file: with one shared name, a writer renames the
    # other's file away (FileNotFoundError) or publishes a half-written one.
    path = tmp_path / "launch.json"
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def writer(n: int) -> None:
        start.wait()
        try:
            for i in range(300):
                write_json_atomic(path, {"writer": n, "i": i, "pad": "x" * 4096})
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["launch.json"]  # no temporary left

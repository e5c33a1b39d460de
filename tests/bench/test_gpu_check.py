"""bench/gpu_check.py in its CPU mode (a tiny Llama): every row runs through the same code
as on a GPU and the table comes out, so the script is ready the day a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.launch import REPO_ROOT, trainer_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_cpu_mode_prints_every_row(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--cpu", "--steps", "2", "--results", str(tmp_path)],
        cwd=REPO_ROOT, env=trainer_env(), capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    # The table, after whatever the in-process Trainer logged to stdout.
    assert "\nrow | ftune tok/s | Trainer tok/s | vs Trainer |" in proc.stdout
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("gpu_check-cpu-*.json")]
    rows = {r["row"]: r for r in record["results"]}
    assert set(rows) == {"lora", "full", "qlora", "fsdp2-offload"}  # no flash-attn on CPU
    for r in rows.values():
        assert "error" not in r and r["tokens_per_second"] > 0, r
    for name in ("lora", "full"):  # beside a plain transformers Trainer
        assert rows[name]["trainer_tokens_per_second"] > 0
    assert rows["lora"]["estimate_gpu_mb"] > 0

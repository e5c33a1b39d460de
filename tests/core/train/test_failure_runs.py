"""Runs that must fail: exit status 1 and an error.json whose code says whose fault it is."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from core.infra.errors import ErrorCode
from tests.utils.jobdirs import events, make_job, read_error, run_trainer
from tests.utils.tiny import text_rows


def test_missing_model_is_model_not_found_via_cli(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    job = make_job(tmp_path, missing, text_rows(8))
    proc = run_trainer(job)
    assert proc.returncode == 1
    err = read_error(job)
    assert err["code"] == ErrorCode.model_not_found
    assert str(missing) in err["message"]
    assert "Traceback" in err["traceback"]


def test_rows_without_the_field_are_invalid_dataset(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(tmp_path, tiny_causal_lm, [{"content": "the cat"}] * 4)
    assert run_main(job) == 1
    err = read_error(job)
    assert err["code"] == ErrorCode.invalid_dataset
    assert "field 'text': no row has a column 'text'; the rows have content" in err["message"]
    assert not (job / "adapter").exists()


def test_fp16_on_cpu_is_unsupported_hardware(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(
        tmp_path, tiny_causal_lm, text_rows(8), spec={"training": {"mixed_precision": "fp16"}}
    )
    assert run_main(job) == 1
    err = read_error(job)
    assert err["code"] == ErrorCode.unsupported_hardware
    assert "mixed_precision fp16" in err["message"]


def test_fsdp_on_cpu_is_unsupported_hardware(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(8),
        spec={"distributed": {"strategy": "fsdp", "num_processes": 2}},
    )
    assert run_main(job) == 1
    assert read_error(job)["code"] == ErrorCode.unsupported_hardware


def test_ddp_spec_run_as_one_process_is_strategy_mismatch(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Callable[[Path], int]
) -> None:
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(8),
        spec={"distributed": {"strategy": "ddp", "num_processes": 2}},
    )
    assert run_main(job) == 1
    err = read_error(job)
    assert err["code"] == ErrorCode.strategy_mismatch
    assert "ddp with 2 process(es) was asked" in err["message"]
    assert "none with world size 1" in err["message"]
    assert not [e for e in events(job) if e["type"] == "started"]


def test_nan_loss_fails_the_run(
    tiny_causal_lm: Path,
    tmp_path: Path,
    run_main: Callable[[Path], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from core.train.trainer import JobTrainer

    original = JobTrainer.compute_loss

    def diverged(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
        loss = original(self, model, inputs, *args, **kwargs)
        if self.state.global_step >= 2:
            return loss * float("nan")
        return loss

    monkeypatch.setattr(JobTrainer, "compute_loss", diverged)
    job = make_job(tmp_path, tiny_causal_lm, text_rows(32), spec={"training": {"logging_steps": 5}})
    assert run_main(job) == 1
    err = read_error(job)
    assert err["code"] == ErrorCode.nan_loss
    # Caught at the step it happened, not at the next logging step.
    assert "at step 3" in err["message"]
    assert not (job / "adapter").exists()

"""Exception -> ErrorCode classification, and error.json writing."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import pytest
import torch

from core.data.reading import DataFileError
from core.infra.errors import ErrorCode, TrainFailure, model_not_found
from core.spec import parse_job_spec
from core.train.failures import Where, classify, nan_loss, write_error


def test_cuda_oom_is_out_of_memory() -> None:
    code, message = classify(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert code == ErrorCode.out_of_memory
    assert "per_device_train_batch_size" in message


def test_cpu_allocator_failure_is_out_of_memory() -> None:
    exc = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"
    )
    assert classify(exc)[0] == ErrorCode.out_of_memory


def test_oom_message_says_where() -> None:
    _, message = classify(RuntimeError("HIP out of memory"), Where("train", 12))
    assert "train (step 12)" in message


def test_wrapped_oom_is_found_in_the_cause_chain() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("backward failed") from inner
    except RuntimeError as outer:
        assert classify(outer)[0] == ErrorCode.out_of_memory


def test_enospc_is_disk_full_and_names_the_file() -> None:
    exc = OSError(errno.ENOSPC, "No space left on device", "/jobs/j/checkpoints/x/optimizer.pt")
    code, message = classify(exc)
    assert code == ErrorCode.disk_full
    assert "optimizer.pt" in message


def test_safetensors_style_enospc_text_is_disk_full() -> None:
    exc = RuntimeError("Error while serializing: IoError(No space left on device (os error 28))")
    assert classify(exc)[0] == ErrorCode.disk_full


def test_data_file_error_is_invalid_dataset_with_row() -> None:
    code, message = classify(DataFileError("not valid JSON (Expecting value)", row=7))
    assert code == ErrorCode.invalid_dataset
    assert "row 7" in message


def test_train_failure_keeps_its_code_and_message() -> None:
    assert classify(nan_loss(5)) == (ErrorCode.nan_loss, nan_loss(5).message)
    exc = model_not_found("model directory /m does not exist")
    assert classify(exc) == (ErrorCode.model_not_found, "model directory /m does not exist")


def test_anything_else_is_trainer_crashed_with_type_and_text() -> None:
    code, message = classify(KeyError("input_ids"), Where("train", 3))
    assert code == ErrorCode.trainer_crashed
    assert message.startswith("KeyError during train (step 3)")


def test_missing_model_directory_is_model_not_found(tmp_path: Path) -> None:
    from core.data.tokenizer import load_tokenizer

    spec = parse_job_spec({"model": {"name_or_path": "/nope"}, "dataset": {"path": "/d.jsonl"}})
    with pytest.raises(TrainFailure) as info:
        load_tokenizer(spec, str(tmp_path / "missing-model"))
    assert info.value.code == ErrorCode.model_not_found
    assert "missing-model" in info.value.message


def test_unknown_hub_id_offline_is_model_not_found() -> None:
    from core.data.tokenizer import load_tokenizer

    spec = parse_job_spec({"model": {"name_or_path": "x"}, "dataset": {"path": "/d.jsonl"}})
    with pytest.raises(TrainFailure) as info:
        load_tokenizer(spec, "no-such-org/no-such-model")
    assert info.value.code == ErrorCode.model_not_found
    assert "no-such-org/no-such-model" in info.value.message


def test_error_json_first_failure_of_the_run_wins(tmp_path: Path) -> None:
    write_error(tmp_path, ErrorCode.out_of_memory, "rank 1 ran out", RuntimeError("oom"))
    write_error(tmp_path, ErrorCode.trainer_crashed, "peer vanished", RuntimeError("gloo"))
    body = json.loads((tmp_path / "error.json").read_text())
    assert body["code"] == "out_of_memory"
    assert body["message"] == "rank 1 ran out"
    assert "RuntimeError: oom" in body["traceback"]
    assert not list(tmp_path.glob("*.tmp"))


def test_error_json_from_an_earlier_attempt_is_replaced(tmp_path: Path) -> None:
    stale = tmp_path / "error.json"
    stale.write_text(json.dumps({"code": "out_of_memory", "message": "old", "traceback": ""}))
    long_ago = time.time() - 10 * 24 * 3600
    os.utime(stale, (long_ago, long_ago))
    write_error(tmp_path, ErrorCode.nan_loss, "new", RuntimeError("x"))
    assert json.loads(stale.read_text())["code"] == "nan_loss"

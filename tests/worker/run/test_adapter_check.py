"""worker.run.adapter_check: what the worker checks in a final adapter before it publishes it."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from worker.run.adapter_check import adapter_problem


def _raw(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file with any dtype, numpy's or not (BF16, 8-bit floats)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def _bf16(values: list[float]) -> bytes:
    return (np.array(values, np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def _np(**tensors: np.ndarray) -> Callable[[Path], None]:
    return lambda p: save_file(tensors, str(p))


CASES: dict[str, tuple[Callable[[Path], None], str | None]] = {
    "fp32": (_np(a=np.ones((2, 2), np.float32), b=np.zeros(2, np.float32)), None),
    "fp32 zeros": (_np(a=np.zeros((2, 2), np.float32)), "every adapter weight is zero"),
    "empty tensors": (_np(a=np.zeros(0, np.float32)), "holds only empty tensors"),
    "nan": (_np(a=np.array([1, np.nan], np.float32)), "tensor a has NaN or infinite values"),
    "fp16 inf": (_np(a=np.array([1, np.inf], np.float16)), "tensor a has NaN or infinite"),
    "no tensors": (lambda p: _raw(p, {}), "holds no tensors"),
    "bf16": (lambda p: _raw(p, {"a": ("BF16", [2], _bf16([1.0, 0.0]))}), None),
    "bf16 zeros": (lambda p: _raw(p, {"a": ("BF16", [2], _bf16([0.0, 0.0]))}),
                   "every adapter weight is zero"),
    "bf16 nan": (lambda p: _raw(p, {"a": ("BF16", [2], _bf16([np.nan, 1.0]))}),
                 "tensor a has NaN or infinite values"),
    "int8 zeros": (lambda p: _raw(p, {"a": ("I8", [2], b"\0\0")}), "every adapter weight is zero"),
    "offsets past the end": (lambda p: _raw(p, {"a": ("F32", [4], b"\0" * 8)}), "does not open"),
    "not safetensors": (lambda p: p.write_bytes(b"\xff" * 16), "does not open"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_adapter_problem(tmp_path: Path, case: str) -> None:
    write, expected = CASES[case]
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    write(tmp_path / "adapter_model.safetensors")
    problem = adapter_problem(tmp_path)
    if expected is None:
        assert problem is None
    else:
        assert problem is not None and expected in problem


def test_missing_or_broken_config(tmp_path: Path) -> None:
    assert adapter_problem(tmp_path) == "adapter_config.json is missing"
    (tmp_path / "adapter_config.json").write_text("[]")
    assert adapter_problem(tmp_path) == "adapter_config.json is not a JSON object"
    (tmp_path / "adapter_config.json").write_text("{}")
    assert adapter_problem(tmp_path) == "adapter_model.safetensors is missing"


# ---------------------------------------------------------------------------- full models


@pytest.fixture(scope="module")
def sharded_model(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama saved in several safetensors files with an index, plus files.json."""
    from transformers import AutoModelForCausalLM

    from core.train.full_model import write_manifest

    folder = tmp_path_factory.mktemp("full") / "model"
    AutoModelForCausalLM.from_pretrained(tiny_causal_lm).save_pretrained(
        folder, max_shard_size="150KB")
    write_manifest(folder)
    return folder


def _spoil_first_shard(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    shard = min(folder.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    next(iter(tensors.values())).view(-1)[0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.mark.parametrize(("spoil", "says"), [
    (None, None),
    (lambda f: max(f.glob("model-*.safetensors")).unlink(), "(named by the index) is missing"),
    (_spoil_first_shard, "has NaN or infinite values"),
    (lambda f: (f / "config.json").unlink(), "config.json is missing or does not parse"),
    (lambda f: (f / "generation_config.json").write_text("{}"),
     "files.json: generation_config.json is missing or not the size listed"),
])
def test_full_model_check(sharded_model: Path, tmp_path: Path,
                          spoil: Callable[[Path], object] | None, says: str | None) -> None:
    import shutil

    from worker.run.adapter_check import artifact_problem

    folder = shutil.copytree(sharded_model, tmp_path / "model")
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    if spoil is not None:
        spoil(folder)
    problem = artifact_problem(folder)
    assert (problem is None) if says is None else (problem is not None and says in problem)

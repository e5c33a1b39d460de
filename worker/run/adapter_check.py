"""The final artifact, checked before the worker publishes it. An adapter: a config that
parses and weights that open, hold something, are finite and are not all zero. A whole
model (full fine-tuning): a config that parses, an index whose files all exist and open and
together hold exactly the tensors it names, every value finite, and files.json matching
the files' sizes. (The trainer compared the files with the trained weights before it
published them; this is the worker's own look at what will be served.)"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from core.run.jobdir import JobDir
    from core.spec import JobSpec


def final_artifact(jd: JobDir, spec: JobSpec | None) -> Path:
    """Where the trainer publishes the final artifact of a job with this spec (None: a
    stored spec that no longer parses, which never ran: the adapter's place)."""
    return jd.artifact(spec.peft.method if spec is not None else "lora")


def artifact_problem(folder: Path) -> str | None:
    """None if the final artifact in ``folder`` (an adapter, or a whole model under
    core.run.jobdir.MODEL_DIR) is usable; else what is wrong with it."""
    from core.run.jobdir import MODEL_DIR

    return model_problem(folder) if folder.name == MODEL_DIR else adapter_problem(folder)


def model_problem(model_dir: Path) -> str | None:
    """None if the full model in ``model_dir`` is usable; else what is wrong with it."""
    from core.train.full_model import FILES_MANIFEST, INDEX_FILE

    for name in ("config.json", INDEX_FILE, FILES_MANIFEST):
        try:
            data = json.loads((model_dir / name).read_text())
        except (OSError, ValueError) as e:
            return f"{name} is missing or does not parse: {e}"
        if not isinstance(data, dict):
            return f"{name} is not a JSON object"
    index = json.loads((model_dir / INDEX_FILE).read_text()).get("weight_map") or {}
    if not index:
        return f"{INDEX_FILE} names no tensors"
    from safetensors import safe_open

    for file in sorted(set(index.values())):
        path = model_dir / str(file)
        if "/" in str(file) or not path.is_file():
            return f"{file} (named by the index) is missing"
        try:
            with safe_open(path, framework="numpy") as f:
                held = set(f.keys())
            _, _, bad = _scan_safetensors(path)
        except Exception as e:  # noqa: BLE001 - any failure to read it makes it unusable
            return f"{file} does not open: {e}"
        if bad is not None:
            return f"{file}: {bad}"
        named = {k for k, v in index.items() if v == file}
        if held != named:
            return f"{file} holds {len(held)} tensors, the index names {len(named)} there"
    manifest = json.loads((model_dir / FILES_MANIFEST).read_text()).get("files") or []
    for entry in manifest:
        path = model_dir / str(entry.get("name", ""))
        if not path.is_file() or path.stat().st_size != entry.get("bytes"):
            return f"{FILES_MANIFEST}: {entry.get('name')} is missing or not the size listed"
    return None


def adapter_problem(adapter_dir: Path) -> str | None:
    """None if the final adapter is usable; else what is wrong with it."""
    cfg = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter_model.safetensors"
    if not cfg.is_file():
        return "adapter_config.json is missing"
    try:
        if not isinstance(json.loads(cfg.read_text()), dict):
            return "adapter_config.json is not a JSON object"
    except (OSError, ValueError) as e:
        return f"adapter_config.json does not parse: {e}"
    if not weights.is_file():
        return "adapter_model.safetensors is missing"
    try:
        total, nonzero, bad = _scan_safetensors(weights)
    except Exception as e:  # noqa: BLE001 - any failure to read it makes it unusable
        return f"adapter_model.safetensors does not open: {e}"
    if bad is not None:
        return bad
    if total == 0:
        return ("adapter_model.safetensors holds only empty tensors (a sharded FSDP/ZeRO-3 "
                "save without gathering writes no weights)")
    if not nonzero:
        return "every adapter weight is zero"
    return None


# The dtypes safetensors can hand to numpy (safetensors.numpy), by whether they are floats.
_NUMPY_FLOATS = {"F64", "F32", "F16"}
_NUMPY_OTHERS = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "C64"}


def _scan_safetensors(path: Path) -> tuple[int, bool, str | None]:
    """(element count, any non-zero weight, problem) of a safetensors file, read with
    ``safetensors.safe_open`` (which validates the header and the data offsets).

    Tensors come out as numpy arrays, one at a time. Only a dtype numpy lacks (BF16, the
    8-bit floats) is read through torch, which is imported then and not before: importing it
    stalls this worker's loop for seconds. Floats are checked for NaN/inf and zeros; other
    dtypes (integers, bools, 8-bit floats) only for "any bit set"."""
    import numpy as np
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        names: list[str] = f.keys()
        slices = {k: f.get_slice(k) for k in names}
        specs = {k: (s.get_dtype(), s.get_shape()) for k, s in slices.items()}
    if not specs:
        return 0, False, f"{path.name} holds no tensors"
    numpy_only = all(d in _NUMPY_FLOATS | _NUMPY_OTHERS for d, _ in specs.values())
    total, nonzero = 0, False
    with safe_open(path, framework="numpy" if numpy_only else "pt") as f:
        for key, (dtype, shape) in specs.items():
            count = math.prod(shape)
            total += count
            if count == 0:
                continue
            is_float = dtype in _NUMPY_FLOATS or dtype == "BF16"
            values = _as_numpy(f.get_tensor(key), dtype, is_float)
            if not is_float:
                nonzero = nonzero or bool(values.any())
                continue
            if not bool(np.isfinite(values).all()):
                return total, nonzero, f"tensor {key} has NaN or infinite values"
            nonzero = nonzero or bool(np.any(values != 0))
    return total, nonzero, None


def _as_numpy(tensor: Any, dtype: str, is_float: bool) -> np.ndarray:
    """A numpy view of what safe_open returned: as it is from the numpy framework; from
    torch, BF16 widened to float32 and any other dtype as its raw bytes."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        return tensor
    import torch

    if is_float:
        return tensor.to(torch.float32).numpy()
    return tensor.contiguous().view(torch.uint8).numpy()

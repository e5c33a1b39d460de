"""Where a job's inputs may come from: the model (a directory under an allowed model root, or
a hub id if the operator allows hub models), its remote code (only if the operator allows
it), and its data (a path under an allowed data root, or an upload whose bytes are still the
ones that were validated). The API checks these at submit, the worker again when it resolves
the run (settings may have changed, files may have moved), the trainer what it can see.

Pure: settings, spec and the filesystem. Looking up an upload's row is the caller's job.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.infra.errors import ErrorCode
from core.infra.paths import PathNotAllowed, confine, model_kind
from core.infra.settings import Settings
from core.policy.refusal import Refusal, Refused
from core.spec import ModelSpec

MODEL_PARAM = "model.name_or_path"
# Where transformers keeps a tokenizer's default chat template, beside tokenizer_config.json.
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def model_location(name: str, settings: Settings, *, need_config: bool = False) -> str:
    """What the trainer loads the model from: a directory confined to the allowed model
    roots, or a hub id when the server allows hub models. ``need_config``: the directory
    must hold a config.json (the API checks that much without loading anything).
    Raises Refused (model_not_found)."""
    kind = model_kind(name)
    if kind == "path":
        try:
            path = confine(name, settings.allowed_model_roots, what="model",
                           setting="FTUNE_ALLOWED_MODEL_ROOTS")
        except PathNotAllowed as e:
            raise _model_refused(str(e)) from None
        if not path.is_dir():
            raise _model_refused("not a directory")
        if need_config and not (path / "config.json").is_file():
            raise _model_refused("no config.json in the model directory")
        return str(path)
    if kind == "hub":
        if not settings.allow_hub_models:
            raise _model_refused(
                "hub models are disabled on this server; "
                "give a directory under an allowed model root"
            )
        return name
    raise _model_refused(
        "must be a hub id (org/name) or an absolute path under an allowed model root"
    )


def _model_refused(message: str) -> Refused:
    return Refused(Refusal(ErrorCode.model_not_found, MODEL_PARAM, message))


def remote_code_refusal(model: ModelSpec, *, allowed: bool) -> Refusal | None:
    """A spec may ask for the model repo's own code only where the operator allows it
    (settings.allow_trust_remote_code; the trainer sees the worker's switch in runtime)."""
    if model.trust_remote_code and not allowed:
        return Refusal(ErrorCode.invalid_spec, "model.trust_remote_code", "not allowed on this server")
    return None


def chat_template_refusal(model_dir: Path) -> Refusal | None:
    """dataset.format chat renders each conversation with the tokenizer's chat template: a
    local model whose tokenizer has none is refused. Read from the files (no tokenizer is
    loaded): chat_template in tokenizer_config.json, or chat_template.jinja / .json beside
    it. A config that cannot be read is left for the trainer to report."""
    if any((model_dir / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return None
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_bytes())
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError):
        return None
    if isinstance(config, dict) and config.get("chat_template"):
        return None
    return Refusal(
        ErrorCode.invalid_spec,
        "dataset.format",
        "chat needs a tokenizer with a chat template and this model's has none (no "
        "chat_template in tokenizer_config.json, no chat_template.jinja or chat_template.json); "
        "use format prompt_completion, or add a chat template to the model directory",
    )


# Where config.json says how many positions a model has (GPT-2 style, most others, MPT).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len")
# Rotary positions run past the trained length (worse, or stretched on purpose by rope
# scaling); this far past it they are noise. Learned position tables stop at their length.
ROTARY_STRETCH = 4


def context_length_refusal(model_dir: Path, max_seq_length: int) -> Refusal | None:
    """dataset.max_seq_length beyond the positions the model has: a learned position table
    fails on the first longer row; rotary models are refused past ROTARY_STRETCH x their
    trained length. Read from config.json (no model is built); models without a fixed
    length (T5's relative positions) are not limited here."""
    try:
        config = json.loads((model_dir / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    sections = [config, *(v for k, v in config.items()
                          if k.endswith("_config") and isinstance(v, dict))]
    for section in sections:
        rotary = any("rope" in k for k in section)
        if rotary and section.get("rope_scaling"):  # stretched on purpose: the user knows
            continue
        for key in POSITION_KEYS:
            limit = section.get(key)
            if not isinstance(limit, int) or isinstance(limit, bool):
                continue
            allowed = limit * ROTARY_STRETCH if rotary else limit
            if max_seq_length > allowed:
                what = (f"{ROTARY_STRETCH} x the {limit} rotary positions it was trained on"
                        if rotary else f"its {limit} positions")
                return Refusal(
                    ErrorCode.invalid_spec,
                    "dataset.max_seq_length",
                    f"{max_seq_length} is more than the model allows: {what} ({key} in its "
                    f"config.json); use at most {allowed}",
                )
    return None


def data_path(user_path: str, settings: Settings, param: str) -> Path:
    """A dataset path confined to the allowed data roots. Raises Refused (invalid_dataset)."""
    try:
        return confine(user_path, settings.allowed_data_roots, what="dataset",
                       setting="FTUNE_ALLOWED_DATA_ROOTS")
    except PathNotAllowed as e:
        raise Refused(Refusal(ErrorCode.invalid_dataset, param, str(e))) from None


def stored_upload(
    file_id: str,
    storage_path: str,
    settings: Settings,
    param: str,
    *,
    size: int | None = None,
    sha256: str | None = None,
) -> Path:
    """Where an uploaded file's bytes are. With ``size`` and ``sha256`` (recorded when the
    upload was validated), also that they are still those bytes: a job trains on exactly
    what was checked. Raises Refused (invalid_dataset)."""
    path = Path(storage_path)
    if not path.is_absolute():
        path = settings.uploads_dir / path
    if not path.is_file():
        raise Refused(
            Refusal(ErrorCode.invalid_dataset, param, f"file {file_id} is missing from storage")
        )
    if size is not None and sha256 is not None and not _same_content(path, size, sha256):
        raise Refused(
            Refusal(
                ErrorCode.invalid_dataset,
                param,
                f"file {file_id} changed in storage since it was uploaded and validated "
                "(size or sha256 differs); upload it again",
            )
        )
    return path


def _same_content(path: Path, size: int, sha256: str) -> bool:
    try:
        if path.stat().st_size != size:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return False
    return digest.hexdigest() == sha256

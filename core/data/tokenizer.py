"""The tokenizer of a job's model, as the trainer, the estimate and submit's checks load it:
the spec's chat template in place of the tokenizer's own, a pad token, right padding. Also
the two checks every load from a model directory or hub id starts with
(core/train/model.py loads the config and weights after the same ones)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from core.infra.errors import model_not_found
from core.infra.paths import model_kind
from core.spec import JobSpec
from core.spec.chat_templates import template_source


def model_load_failure(what: str, name: str, e: Exception) -> Exception:
    """OSError/ValueError from from_pretrained means "not a loadable model here": missing
    directory, missing files, unknown hub id, no network. A full disk is not that."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return e
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return model_not_found(f"cannot load the {what} of model {name!r}: {first}")


def load_tokenizer(spec: JobSpec, model_path: str) -> Any:
    from transformers import AutoTokenizer

    check_model_exists(model_path)
    try:
        tok = AutoTokenizer.from_pretrained(
            model_path,
            revision=spec.model.revision,
            trust_remote_code=spec.model.trust_remote_code,
        )
    except (OSError, ValueError) as e:
        raise model_load_failure("tokenizer", model_path, e) from e
    if spec.dataset.chat_template is not None:
        # The spec's template replaces the tokenizer's for rendering, and is saved with
        # the adapter's tokenizer files, so inference renders as training did.
        tok.chat_template = template_source(spec.dataset.chat_template)
    if tok.pad_token is None:
        # Many decoder LMs ship without a pad token. Reusing EOS is safe here because pads are
        # masked out of attention and carry label -100; the real EOS at the end of each
        # example keeps its label (labels are built before padding, not from pad ids).
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    tok.padding_side = "right"
    return tok


def check_model_exists(model_path: str) -> None:
    # Anything that is not a hub id names a local directory (core/policy/sources.py).
    if model_kind(model_path) != "hub" and not Path(model_path).expanduser().exists():
        raise model_not_found(f"model directory {model_path} does not exist")

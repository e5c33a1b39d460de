"""Whether a supervised run computes every position's logits (the plain LM head) or only the
labelled ones (TRL's fused head; core/train/loss.py explains both): the trainer decides it
here, and the estimate counts the logits' memory by the same answer. Importable without
torch (imported inside the function)."""

from __future__ import annotations

from typing import Any

_PROMPT_LEARNING = ("prompt_tuning", "prefix_tuning", "p_tuning")


def plain_reason(
    spec: Any, model: Any, data_format: str | None = None, lm_head: str = "auto"
) -> str | None:
    """Why this supervised run keeps the plain LM head (full logits), or None: fused.
    ``data_format``: the format read (dataset.format auto resolves from the rows);
    ``lm_head``: the run plan's ``runtime.lm_head``."""
    if lm_head == "plain":
        return "runtime.lm_head plain"
    if spec.model.task != "causal_lm":
        return f"task {spec.model.task}"
    if (data_format or spec.dataset.format) == "text":
        return "dataset.format text: every position carries a loss"
    method = getattr(spec.peft, "method", None)  # no peft section: full fine-tuning
    if method in _PROMPT_LEARNING:
        return f"peft.method {method}: virtual tokens shift the positions"
    if spec.distributed.strategy == "fsdp" and spec.distributed.fsdp.version == 1:
        return "distributed.fsdp.version 1: not verified (no FSDP1 run is possible on CPU)"
    import torch

    head = model.get_output_embeddings()
    # An adapter layer or a modules_to_save wrapper on the head is not a plain Linear.
    if type(head) is not torch.nn.Linear:
        return "lm_head is trained (adapter or modules_to_save)"
    return None

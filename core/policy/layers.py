"""What FSDP can wrap in this model: the layer classes to wrap (the spec's, checked against
the model, or the model's own ``_no_split_modules``), and whether FSDP2 can wrap its tied
weights at all. Found on the meta device from the model's config alone: no weights read, no
memory used, so the API (local models) and the worker (every model) refuse before any GPU is
held. worker/run/accelerate_config.py writes the result into the YAML and inspects nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from core.infra.errors import ErrorCode
from core.policy.refusal import Refusal, Refused
from core.spec import AUTO_MODEL_CLASS, JobSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LAYER_CLS_PARAM = "distributed.fsdp.transformer_layer_cls_to_wrap"


def wraps_transformer_layers(spec: JobSpec) -> bool:
    """FSDP with TRANSFORMER_BASED_WRAP: the only case that needs the model's layer classes."""
    return (
        spec.distributed.strategy == "fsdp"
        and spec.distributed.fsdp.auto_wrap_policy == "TRANSFORMER_BASED_WRAP"
    )


def fsdp_wrap_classes(spec: JobSpec, model_path: str, *, trust_remote_code: bool) -> list[str] | None:
    """The layer classes FSDP wraps for ``spec`` on the model at ``model_path`` (a resolved
    location), or None when FSDP does not wrap transformer layers. Raises Refused: the
    classes or the tied weights do not fit (invalid_spec), or the config cannot be found
    (model_not_found)."""
    if not wraps_transformer_layers(spec):
        return None
    f = spec.distributed.fsdp
    try:
        return fsdp_layer_classes(
            model_path,
            requested=f.transformer_layer_cls_to_wrap,
            task=spec.model.task,
            trust_remote_code=trust_remote_code,
            fsdp_version=f.version,
        )
    except OSError as e:
        raise Refused(
            Refusal(
                ErrorCode.model_not_found, "model.name_or_path", f"cannot read the model config: {e}"
            )
        ) from None


def _layer_refused(message: str) -> Refused:
    return Refused(Refusal(ErrorCode.invalid_spec, LAYER_CLS_PARAM, message))


def fsdp_layer_classes(
    model_path_or_config: str | os.PathLike[str] | PretrainedConfig,
    *,
    requested: Sequence[str] | None = None,
    task: str = "causal_lm",
    trust_remote_code: bool = False,
    fsdp_version: int | None = None,
) -> list[str]:
    """Layer classes for TRANSFORMER_BASED_WRAP: ``requested`` checked against the model, or
    the model's own ``_no_split_modules``. The model is built on the meta device from its
    config only (no weights read, no memory used). With ``fsdp_version`` 2, also refuses a
    model whose weights accelerate cannot wrap (``fsdp2_tied_weights_problem``). Raises
    Refused (param distributed.fsdp.transformer_layer_cls_to_wrap, or distributed.fsdp.version
    for tied weights); OSError (from transformers) when the config cannot be found."""
    import torch
    import transformers

    if task not in AUTO_MODEL_CLASS:
        raise ValueError(f"unknown task {task!r}")
    if isinstance(model_path_or_config, transformers.PretrainedConfig):
        config = model_path_or_config
    else:
        try:
            config = transformers.AutoConfig.from_pretrained(
                str(model_path_or_config), trust_remote_code=trust_remote_code
            )
        except ValueError as e:  # unknown model type, remote code not allowed, ...
            raise _layer_refused(f"cannot read the model config: {e}") from None
    auto_cls = getattr(transformers, AUTO_MODEL_CLASS[task])
    try:
        with torch.device("meta"):
            model = auto_cls.from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError) as e:
        raise _layer_refused(
            f"cannot build a {task} model from {type(config).__name__} to look up its layers: {e}"
        ) from None
    if fsdp_version == 2:
        problem = fsdp2_tied_weights_problem(model)
        if problem:
            raise Refused(Refusal(ErrorCode.invalid_spec, "distributed.fsdp.version", problem))
    present = {type(m).__name__ for m in model.modules()}
    if requested:
        missing = [c for c in requested if c not in present]
        if missing:
            candidates = sorted(set(model._no_split_modules or ()) & present) or sorted(present)
            raise _layer_refused(
                f"{', '.join(missing)} not found in {type(model).__name__}; "
                f"its layer classes include {', '.join(candidates)}"
            )
        return list(dict.fromkeys(requested))
    default = sorted(set(model._no_split_modules or ()) & present)
    if not default:
        raise _layer_refused(
            f"{type(model).__name__} declares no layer classes (_no_split_modules); name them "
            "in transformer_layer_cls_to_wrap or use SIZE_BASED_WRAP"
        )
    return default


def fsdp2_tied_weights_problem(model: Any) -> str | None:
    """Why accelerate 1.15 cannot wrap ``model`` with FSDP2, or None.

    FSDP2 needs every tied (shared) parameter inside one FSDP group. accelerate groups the
    input and output embeddings when they share their weight, and nothing else: T5's
    embedding, shared by ``shared``, both ``embed_tokens`` and ``lm_head``, ends up in two
    groups and the run fails at its first step ("Parameters missing after FSDP2 wrapping").
    Found here on the meta model, so the job is refused before any GPU is held.
    """
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name.rsplit(".", 1)[0])
    embeddings = {
        id(m)
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None
    }
    modules = dict(model.named_modules())
    for names in owners.values():
        if len(names) > 1 and any(id(modules.get(n)) not in embeddings for n in names):
            return (
                f"FSDP2 cannot wrap {type(model).__name__}: it ties one weight across "
                f"{', '.join(sorted(names))}, and accelerate puts only tied input and output "
                "embeddings in one FSDP group; use distributed.strategy ddp or deepspeed"
            )
    return None

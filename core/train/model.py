"""Loading the base model (its tokenizer: core/data/tokenizer.py), and wrapping the model with
the PEFT method.

Loading happens *after* TrainingArguments exist: under DeepSpeed ZeRO-3 that object
registers the ZeRO config globally, and from_pretrained then creates each weight already
partitioned across ranks instead of materialising the full model on every rank.
"""

from __future__ import annotations

import logging
from typing import Any

from core.data.tokenizer import check_model_exists, model_load_failure
from core.model.peft import peft_config, seq2seq_peft_compat
from core.spec import (
    AUTO_MODEL_CLASS,
    JobSpec,
)

log = logging.getLogger("core.train")

def _dtype(spec: JobSpec) -> Any:
    import torch

    return {
        "auto": "auto",
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[spec.model.dtype]


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "uint8": torch.uint8}[name]


def quantization_config(spec: JobSpec) -> Any:
    """spec.model.quantization -> transformers' BitsAndBytesConfig, or None.

    4-bit (QLoRA): each Linear weight is stored as 4-bit codes (nf4: quantiles of a normal
    distribution, which pretrained weights roughly follow) plus one absmax constant per block
    of 64 weights; every matmul dequantizes to ``compute_dtype`` first. Double quantization
    stores those constants in 8 bits too. 8-bit (LLM.int8()): int8 weights with per-row
    scales, outlier features computed in 16 bits. Either way the base is frozen: nothing is
    ever re-quantized, the adapter's gradients flow through the dequantized weights.
    """
    q = spec.model.quantization
    if q is None:
        return None
    from transformers import BitsAndBytesConfig

    if q.load_in == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = spec.model.compute_dtype(spec.training.mixed_precision)
    assert compute is not None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_compute_dtype=_torch_dtype(compute),
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_quant_storage=_torch_dtype(q.quant_storage),
    )


def quantization_in_effect(model: Any, spec: JobSpec) -> dict[str, Any]:
    """Prove the base really is quantized as the spec asks (the "started" event reports
    it): bitsandbytes' Linear4bit / Linear8bitLt modules, none of the adapted Linear layers
    left in full precision by a silent fallback. Raises strategy_mismatch otherwise."""
    from core.infra.errors import strategy_mismatch

    q = spec.model.quantization
    if q is None:
        return {}
    want = "Linear4bit" if q.load_in == "4bit" else "Linear8bitLt"
    quantized = [m for m in model.modules() if type(m).__name__ == want]
    if not quantized:
        raise strategy_mismatch(
            f"model.quantization.load_in {q.load_in} was asked, but the loaded base has no "
            f"{want} module: it is not quantized"
        )
    fields: dict[str, Any] = {"quantization": q.load_in, "quantized_modules": len(quantized)}
    if q.load_in == "4bit":
        state = getattr(quantized[0].weight, "quant_state", None)
        got = getattr(state, "quant_type", None)
        if got != q.quant_type:
            raise strategy_mismatch(
                f"model.quantization.quant_type {q.quant_type} was asked, but the base's "
                f"4-bit weights are {got}"
            )
        nested = bool(getattr(state, "nested", False))
        if nested != q.double_quant:
            raise strategy_mismatch(
                f"model.quantization.double_quant {q.double_quant} was asked, but "
                f"{nested} is in effect"
            )
        fields.update(
            quant_type=got,
            compute_dtype=str(quantized[0].compute_dtype).removeprefix("torch."),
            double_quant=nested,
            quant_storage=str(quantized[0].weight.dtype).removeprefix("torch."),
        )
    return fields


def load_model(
    spec: JobSpec,
    model_path: str,
    tokenizer: Any,
    labels: list[str] | None,
    dtype: Any = None,
    read_weights: bool = True,
    quantize: bool = True,
) -> Any:
    """The base model for spec.model.task, in ``dtype`` (default: spec.model.dtype),
    quantized as spec.model.quantization asks unless ``quantize`` is false (the merged
    export folds the adapter into the full-precision base).

    ``read_weights=False``: build the model from its config without reading any weights,
    every parameter an uninitialised tensor (``torch.empty``: its pages are not touched, so
    it costs no resident memory); buffers stay real (rotary tables are computed, not
    loaded). For FSDP2's cpu_ram_efficient_loading on every rank but 0: accelerate moves the
    model to meta, shards it, and rank 0 broadcasts each rank its shard of the weights it read.
    """
    import transformers
    from transformers import AutoConfig

    m = spec.model
    check_model_exists(model_path)
    common: dict[str, Any] = {"revision": m.revision, "trust_remote_code": m.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(model_path, **common)
    except (OSError, ValueError) as e:
        raise model_load_failure("configuration", model_path, e) from e

    kwargs: dict[str, Any] = {**common, "dtype": dtype if dtype is not None else _dtype(spec)}
    if quantize and spec.model.quantization is not None:
        kwargs["quantization_config"] = quantization_config(spec)
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    cls: Any = getattr(transformers, AUTO_MODEL_CLASS[m.task])
    if m.task == "seq_cls":
        assert labels is not None
        kwargs.update(
            num_labels=len(labels),
            id2label=dict(enumerate(labels)),
            label2id={n: i for i, n in enumerate(labels)},
            # The base checkpoint's head (if any) was trained for other classes; a new head
            # of the right width is initialised instead of failing on the shape mismatch.
            ignore_mismatched_sizes=True,
        )
    if not read_weights:
        model = _without_weights(cls, config, kwargs)
    else:
        try:
            model = cls.from_pretrained(model_path, **kwargs)
        except OSError as e:
            raise model_load_failure("weights", model_path, e) from e

    if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
        # Sequence classification on a decoder picks the last non-pad token per row; it
        # needs to know which id is padding.
        model.config.pad_token_id = tokenizer.pad_token_id
    # The KV cache is for generation; in training it only costs memory.
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


def _without_weights(cls: Any, config: Any, kwargs: dict[str, Any]) -> Any:
    """``cls`` built from ``config`` with the from_pretrained ``kwargs`` it understands, its
    parameters uninitialised: the same module tree, names, shapes and dtypes as rank 0's
    loaded model, which FSDP needs to shard identically.

    Not left on the meta device: with FSDP2 the Trainer creates the optimizer before
    accelerate shards the model, and accelerate then maps each old parameter to its sharded
    replacement by data pointer; every meta tensor has the same one (0), so the optimizer
    would end up stepping the wrong parameters.
    """
    import torch
    from accelerate import init_empty_weights

    for key in ("num_labels", "id2label", "label2id"):
        if key in kwargs:
            setattr(config, key, kwargs[key])
    dtype = kwargs["dtype"]
    if dtype == "auto":  # what from_pretrained would pick: the checkpoint's own dtype
        dtype = getattr(config, "dtype", None) or torch.float32
    extra = {k: kwargs[k] for k in ("trust_remote_code", "attn_implementation") if k in kwargs}
    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config, dtype=dtype, **extra)
    # transformers 5.23 ties weights (tie_word_embeddings) in from_pretrained, not in
    # from_config: untied here, this rank's LM head would be a parameter of its own while
    # rank 0's is the embedding, and FSDP2 (which re-ties after loading) would lose it
    # ("Parameters missing after FSDP2 wrapping: [...lm_head.weight]").
    model.tie_weights()
    # Tied weights (an LM head sharing the embedding matrix) must stay one tensor.
    real: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in real:
                real[id(p)] = torch.nn.Parameter(
                    torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad
                )
            setattr(module, name, real[id(p)])
    return model


def wrap_with_peft(spec: JobSpec, model: Any, model_path: str) -> Any:
    import peft

    from core.infra.errors import invalid_spec

    config = peft_config(spec, model_path)
    if spec.model.task == "seq2seq_lm":
        seq2seq_peft_compat(model)
    if spec.model.quantization is not None:
        # As the peft docs do it: freeze the base, cast its remaining half-precision
        # weights (norms, embeddings, head) to float32 for stable training, and (with
        # gradient checkpointing) make the embedding output require grad and switch
        # checkpointing on, the same non-reentrant variant TrainingArguments asks for.
        model = peft.prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=spec.training.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False},
        )
    if spec.training.gradient_checkpointing:
        # The base is frozen, so the embeddings' output does not require grad. Reentrant
        # checkpointing would then see a checkpointed block whose inputs need no grad and
        # drop the adapter's gradients inside it, silently; making the embedding output
        # require grad keeps the graph connected whichever checkpoint variant runs.
        model.enable_input_require_grads()
    try:
        peft_model = peft.get_peft_model(model, config)
    except ValueError as e:
        # e.g. "Target modules {'q'} not found in the base model": a spec problem.
        raise invalid_spec(f"peft: {e}") from e
    # adapter_config.json names the base model; the worker's local copy path means nothing
    # to whoever downloads the adapter, the name the user asked for does.
    peft_model.peft_config["default"].base_model_name_or_path = spec.model.name_or_path
    peft_model.peft_config["default"].revision = spec.model.revision
    return peft_model


def parameter_count(model: Any) -> int:
    """Parameters of ``model``, tied ones once (a ZeRO-3 placeholder by its real size)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())

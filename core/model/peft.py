"""The PEFT config a job's spec asks for, one to one onto peft's own arguments, and the shim
peft needs to wrap transformers 5's encoder-decoder models: what the trainer wraps the model
with (core/train/model.py) and the estimate counts parameters on (core/model/estimate.py).
peft is imported inside the functions (importing it costs seconds)."""

from __future__ import annotations

from typing import Any

from core.spec import (
    PEFT_TASK_TYPE,
    IA3Spec,
    JobSpec,
    LoraSpec,
    PrefixTuningSpec,
    PromptTuningSpec,
)


def peft_config(spec: JobSpec, model_path: str) -> Any:
    """The peft config for spec.peft. Names map one to one onto peft's own arguments."""
    import peft

    p = spec.peft
    task_type = PEFT_TASK_TYPE[spec.model.task]
    if isinstance(p, LoraSpec):
        return peft.LoraConfig(
            task_type=task_type,
            r=p.r,
            # peft annotates lora_alpha as int but only divides by it (alpha/r, alpha/sqrt(r));
            # the spec has always accepted a float.
            lora_alpha=p.lora_alpha,  # type: ignore[arg-type]
            lora_dropout=p.lora_dropout,
            target_modules=p.target_modules,  # None: peft's per-architecture default
            bias=p.bias,
            use_dora=p.use_dora,
            # rsLoRA scales the update by alpha/sqrt(r) instead of alpha/r, so the update
            # magnitude stays stable as r grows.
            use_rslora=p.use_rslora,
            modules_to_save=p.modules_to_save,
        )
    if isinstance(p, IA3Spec):
        return peft.IA3Config(
            task_type=task_type,
            target_modules=p.target_modules,
            feedforward_modules=p.feedforward_modules,
            modules_to_save=p.modules_to_save,
        )
    if isinstance(p, PromptTuningSpec):
        kw: dict[str, Any] = {}
        if p.prompt_tuning_init == "TEXT":
            kw = {
                "prompt_tuning_init_text": p.prompt_tuning_init_text,
                "tokenizer_name_or_path": model_path,
            }
        return peft.PromptTuningConfig(
            task_type=task_type,
            num_virtual_tokens=p.num_virtual_tokens,
            prompt_tuning_init=p.prompt_tuning_init,
            **kw,
        )
    if isinstance(p, PrefixTuningSpec):
        kw = {}
        if p.encoder_hidden_size is not None:
            kw["encoder_hidden_size"] = p.encoder_hidden_size
        return peft.PrefixTuningConfig(
            task_type=task_type,
            num_virtual_tokens=p.num_virtual_tokens,
            prefix_projection=p.prefix_projection,
            **kw,
        )
    raise AssertionError(f"unknown peft method {p!r}")


def seq2seq_peft_compat(model: Any) -> None:
    """Let peft 0.21 wrap an encoder-decoder model of transformers 5.x.

    PeftModelForSeq2SeqLM.__init__ reads ``base._prepare_encoder_decoder_kwargs_for_generation``,
    which transformers 5 renamed ``_prepare_text_encoder_decoder_kwargs_for_generation``
    (same arguments): without this alias every seq2seq PEFT model fails to build with an
    AttributeError. Only generate() uses the method; training never calls it.
    """
    old, new = (
        "_prepare_encoder_decoder_kwargs_for_generation",
        "_prepare_text_encoder_decoder_kwargs_for_generation",
    )
    if not hasattr(model, old) and hasattr(model, new):
        setattr(model, old, getattr(model, new))

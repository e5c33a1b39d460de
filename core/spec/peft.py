"""spec.peft: the adapter method (lora, ia3, prompt_tuning, prefix_tuning) and its options."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from core.spec.base import _Strict

TargetModules = list[Annotated[str, Field(min_length=1, max_length=256)]] | Literal["all-linear"]


class LoraSpec(_Strict):
    method: Literal["lora"] = Field(
        default="lora",
        description="lora (the default when method is left out): trained low-rank matrices "
        "whose product is added to each target module's weight.",
    )
    r: int = Field(default=8, ge=1, le=1024, description="LoRA rank.")
    lora_alpha: float = Field(default=16, gt=0, description="LoRA scaling numerator (alpha/r).")
    lora_dropout: float = Field(
        default=0.05, ge=0.0, lt=1.0, description="Dropout on the LoRA branch's input in training."
    )
    target_modules: TargetModules | None = Field(
        default=None,
        description='Module names to adapt, or "all-linear"; default: peft\'s per-model choice.',
    )
    bias: Literal["none", "all", "lora_only"] = Field(
        default="none",
        description="Which biases train too: none, all, or lora_only (those of the adapted "
        "modules).",
    )
    use_dora: bool = Field(default=False, description="Weight-decomposed LoRA (DoRA).")
    use_rslora: bool = Field(default=False, description="Rank-stabilised scaling alpha/sqrt(r).")
    modules_to_save: list[str] | None = Field(
        default=None, description="Modules trained fully and saved with the adapter."
    )


class IA3Spec(_Strict):
    method: Literal["ia3"] = Field(
        description="ia3 ((IA)^3): trained vectors that rescale the keys, values and "
        "feed-forward activations."
    )
    target_modules: TargetModules | None = Field(
        default=None,
        description='Module names to adapt, or "all-linear"; default: peft\'s per-model choice.',
    )
    feedforward_modules: list[str] | None = Field(
        default=None,
        description="Those of target_modules that are feed-forward layers (their input is "
        "rescaled, not their output); default: peft's per-model choice.",
    )
    modules_to_save: list[str] | None = Field(
        default=None, description="Modules trained fully and saved with the adapter."
    )


class PromptTuningSpec(_Strict):
    method: Literal["prompt_tuning"] = Field(
        description="prompt_tuning: trained embeddings of virtual tokens put before every input."
    )
    num_virtual_tokens: int = Field(
        default=20, ge=1, le=1024, description="Virtual tokens put before every input."
    )
    prompt_tuning_init: Literal["RANDOM", "TEXT"] = Field(
        default="RANDOM",
        description="RANDOM, or TEXT: start from the embeddings of prompt_tuning_init_text.",
    )
    prompt_tuning_init_text: str | None = Field(
        default=None,
        max_length=4096,
        description="prompt_tuning_init TEXT: the text whose token embeddings start the "
        "virtual tokens.",
    )


class PrefixTuningSpec(_Strict):
    method: Literal["prefix_tuning"] = Field(
        description="prefix_tuning: trained key and value vectors put before the sequence at "
        "every layer."
    )
    num_virtual_tokens: int = Field(
        default=20, ge=1, le=1024, description="Length of the trained prefix, in tokens."
    )
    prefix_projection: bool = Field(
        default=False,
        description="Train the prefix through a two-layer MLP (the prefix-tuning paper's "
        "reparametrisation, for stability).",
    )
    encoder_hidden_size: int | None = Field(
        default=None,
        ge=1,
        description="prefix_projection: the MLP's hidden size; default: the model's hidden "
        "size.",
    )


class FullSpec(_Strict):
    """Full-parameter fine-tuning: every weight of the model trains (gradients and optimizer
    state for each one), and the result is a whole model (safetensors shards + index, config,
    tokenizer, generation config), not an adapter."""

    method: Literal["full"] = Field(
        description="full: train every parameter. Needs gradients and optimizer state for "
        "all of them (16 bytes per parameter with Adam, mixed precision included): shard "
        "them with distributed.strategy fsdp (version 2) or deepspeed ZeRO for large models. "
        "Not with model.quantization (quantized weights cannot be trained)."
    )


def _peft_method(v: Any) -> str | None:
    # "method" may be left out: LoRA is the default, as in the documented example.
    if isinstance(v, dict):
        return v.get("method", "lora")
    return getattr(v, "method", None)


PeftSpec = Annotated[
    Annotated[LoraSpec, Tag("lora")]
    | Annotated[IA3Spec, Tag("ia3")]
    | Annotated[PromptTuningSpec, Tag("prompt_tuning")]
    | Annotated[PrefixTuningSpec, Tag("prefix_tuning")]
    | Annotated[FullSpec, Tag("full")],
    Discriminator(
        _peft_method,
        custom_error_type="invalid_peft_method",
        custom_error_message="method must be one of lora, ia3, prompt_tuning, prefix_tuning, "
        "full",
    ),
]

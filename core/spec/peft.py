"""spec.peft: the adapter method (lora, ia3, prompt_tuning, prefix_tuning) and its options."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from core.spec.base import _Strict

TargetModules = list[Annotated[str, Field(min_length=1, max_length=256)]] | Literal["all-linear"]


class LoraSpec(_Strict):
    method: Literal["lora"] = "lora"
    r: int = Field(default=8, ge=1, le=1024, description="LoRA rank.")
    lora_alpha: float = Field(default=16, gt=0, description="LoRA scaling numerator (alpha/r).")
    lora_dropout: float = Field(default=0.05, ge=0.0, lt=1.0)
    target_modules: TargetModules | None = Field(
        default=None,
        description='Module names to adapt, or "all-linear"; default: peft\'s per-model choice.',
    )
    bias: Literal["none", "all", "lora_only"] = "none"
    use_dora: bool = Field(default=False, description="Weight-decomposed LoRA (DoRA).")
    use_rslora: bool = Field(default=False, description="Rank-stabilised scaling alpha/sqrt(r).")
    modules_to_save: list[str] | None = Field(
        default=None, description="Modules trained fully and saved with the adapter."
    )


class IA3Spec(_Strict):
    method: Literal["ia3"]
    target_modules: TargetModules | None = None
    feedforward_modules: list[str] | None = None
    modules_to_save: list[str] | None = None


class PromptTuningSpec(_Strict):
    method: Literal["prompt_tuning"]
    num_virtual_tokens: int = Field(default=20, ge=1, le=1024)
    prompt_tuning_init: Literal["RANDOM", "TEXT"] = "RANDOM"
    prompt_tuning_init_text: str | None = Field(default=None, max_length=4096)


class PrefixTuningSpec(_Strict):
    method: Literal["prefix_tuning"]
    num_virtual_tokens: int = Field(default=20, ge=1, le=1024)
    prefix_projection: bool = False
    encoder_hidden_size: int | None = Field(default=None, ge=1)


def _peft_method(v: Any) -> str | None:
    # "method" may be left out: LoRA is the default, as in the documented example.
    if isinstance(v, dict):
        return v.get("method", "lora")
    return getattr(v, "method", None)


PeftSpec = Annotated[
    Annotated[LoraSpec, Tag("lora")]
    | Annotated[IA3Spec, Tag("ia3")]
    | Annotated[PromptTuningSpec, Tag("prompt_tuning")]
    | Annotated[PrefixTuningSpec, Tag("prefix_tuning")],
    Discriminator(
        _peft_method,
        custom_error_type="invalid_peft_method",
        custom_error_message="method must be one of lora, ia3, prompt_tuning, prefix_tuning",
    ),
]

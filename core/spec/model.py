"""spec.model: the base model to adapt, and how it is loaded (dtype, attention,
quantization)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.spec.base import _Strict

Task = Literal["causal_lm", "seq2seq_lm", "seq_cls"]

# What each task is to transformers and peft: the Auto class that builds its model (the
# trainer, the merge, the memory estimate, the FSDP layer lookup and the model card all use
# it), and peft's task type for its adapter.
AUTO_MODEL_CLASS: dict[str, str] = {
    "causal_lm": "AutoModelForCausalLM",
    "seq2seq_lm": "AutoModelForSeq2SeqLM",
    "seq_cls": "AutoModelForSequenceClassification",
}
PEFT_TASK_TYPE: dict[str, str] = {
    "causal_lm": "CAUSAL_LM",
    "seq2seq_lm": "SEQ_2_SEQ_LM",
    "seq_cls": "SEQ_CLS",
}


HalfOrFull = Literal["float32", "bfloat16", "float16"]


class QuantizationSpec(_Strict):
    """QLoRA: the frozen base loaded quantized by bitsandbytes (transformers'
    BitsAndBytesConfig); the adapter trains in float32 on top of it."""

    load_in: Literal["4bit", "8bit"] = Field(
        description="4bit (load_in_4bit: about 0.5 byte per weight, QLoRA) or 8bit "
        "(load_in_8bit, LLM.int8(): about 1 byte per weight). Linear layers only; embeddings, "
        "norms and the output head stay in full precision."
    )
    quant_type: Literal["nf4", "fp4"] = Field(
        default="nf4",
        description="4bit only (bnb_4bit_quant_type): nf4 (4-bit NormalFloat, the QLoRA "
        "paper's choice for normally distributed weights) or fp4.",
    )
    compute_dtype: HalfOrFull | None = Field(
        default=None,
        description="4bit only (bnb_4bit_compute_dtype): the dtype the 4-bit weights are "
        "dequantized to for each matmul. Default: follows training.mixed_precision (bf16 -> "
        "bfloat16, fp16 -> float16, no -> float32).",
    )
    double_quant: bool = Field(
        default=False,
        description="4bit only (bnb_4bit_use_double_quant): quantize the per-block "
        "quantization constants too, saving about 0.37 bit per weight.",
    )
    quant_storage: Literal["uint8", "float32", "bfloat16", "float16"] = Field(
        default="uint8",
        description="4bit only (bnb_4bit_quant_storage): the dtype the packed 4-bit weights "
        "are stored in. FSDP needs it to match the other weights' dtype.",
    )


class ModelSpec(_Strict):
    name_or_path: str = Field(
        min_length=1,
        max_length=512,
        description="Hub id (org/name) or a local directory under an allowed model root.",
    )
    revision: str | None = Field(
        default=None, max_length=128, description="Hub revision (branch, tag or commit)."
    )
    task: Task = Field(
        default="causal_lm",
        description="causal_lm (decoder LM), seq2seq_lm (encoder-decoder), seq_cls "
        "(sequence classification head).",
    )
    num_labels: int | None = Field(
        default=None, ge=2, le=10_000, description="seq_cls only; default: labels found in data."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="dtype the base model weights are loaded in."
    )
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] | None = Field(
        default=None, description="Attention kernel; default: the model's own choice."
    )
    trust_remote_code: bool = Field(
        default=False, description="Run the model repo's own code. Needs operator permission."
    )
    quantization: QuantizationSpec | None = Field(
        default=None,
        description="Load the frozen base quantized (QLoRA) with bitsandbytes; LoRA methods "
        "only. The adapter loads on the full-precision base; export_merged merges into the "
        "full-precision base. Default: not quantized.",
    )
    from_job: str | None = Field(
        default=None,
        pattern=r"^job-[A-Za-z0-9_-]{1,64}$",
        description="Continue from another job of this tenant: its adapter at model.step, or "
        "its final adapter, is this job's starting point (a fresh optimizer and schedule). "
        "name_or_path, task and peft default to that job's; they must match it.",
    )
    step: int | None = Field(
        default=None,
        ge=1,
        description="With from_job: the checkpoint step to start from. Default: the job's "
        "final adapter.",
    )

    def compute_dtype(self, mixed_precision: str) -> str | None:
        """The 4-bit compute dtype in effect: the spec's, else the mixed precision's."""
        q = self.quantization
        if q is None or q.load_in != "4bit":
            return None
        if q.compute_dtype is not None:
            return q.compute_dtype
        return {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision, "float32")

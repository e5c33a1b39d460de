"""spec.training: the objective (sft or a preference objective) and the Trainer's
hyper-parameters."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.spec.base import _Strict
from core.spec.grpo import GrpoSpec

Objective = Literal["sft", "dpo", "orpo", "kto", "grpo"]

# The data format each training objective learns from (sft: the task's formats above).
PREFERENCE_FORMAT: dict[str, str] = {
    "dpo": "preference", "orpo": "preference", "kto": "kto",
    # grpo: chat prompts (the last message the user's) + the grader's fields.
    "grpo": "chat",
}
# TRL 1.16 DPOConfig.loss_type values (trl/trainer/dpo_config.py).
DpoLossType = Literal[
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
]


class PreferenceSpec(_Strict):
    """Options of the preference objectives (TRL's DPOConfig, ORPOConfig, KTOConfig). The
    reference model of DPO and KTO is the base with the adapter disabled: no second copy
    of the model is loaded."""

    beta: float = Field(
        default=0.1,
        gt=0,
        le=100,
        description="dpo/kto: how far the policy may move from the reference (higher: less; "
        "for loss_type ipo, the regularisation tau). orpo: the weight of the odds-ratio "
        "term (lambda in the ORPO paper).",
    )
    loss_type: DpoLossType = Field(
        default="sigmoid",
        description="dpo only: sigmoid (the DPO paper), ipo, hinge, robust, exo_pair, "
        "nca_pair, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, "
        "sft, sigmoid_norm (TRL's DPOConfig.loss_type).",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0.0,
        lt=0.5,
        description="dpo only, loss_type robust or exo_pair: the probability that a "
        "preference label is flipped (robust) or the epsilon of EXO.",
    )
    kto_loss_type: Literal["kto", "apo_zero_unpaired"] = Field(
        default="kto",
        description="kto only: kto (the KTO paper; needs per_device_train_batch_size >= 2 "
        "to estimate its KL term) or apo_zero_unpaired.",
    )
    desirable_weight: float = Field(
        default=1.0, gt=0, le=100, description="kto only: loss weight of desirable rows."
    )
    undesirable_weight: float = Field(
        default=1.0, gt=0, le=100, description="kto only: loss weight of undesirable rows."
    )


class TrainingSpec(_Strict):
    objective: Objective = Field(
        default="sft",
        description="sft: supervised fine-tuning on dataset.format's targets. dpo (Direct "
        "Preference Optimization) and orpo (Odds Ratio Preference Optimization, no "
        "reference model) learn from dataset.format preference; kto (Kahneman-Tversky "
        "Optimization) from dataset.format kto. grpo (Group Relative Policy Optimization) "
        "learns from the rewards of training.grpo.grader on answers it samples to "
        "dataset.format chat prompts. These objectives need task causal_lm and peft method "
        "lora or ia3.",
    )
    preference: PreferenceSpec | None = Field(
        default=None,
        description="Options of objective dpo, orpo or kto; default: TRL's defaults "
        "(beta 0.1, loss_type sigmoid).",
    )
    grpo: GrpoSpec | None = Field(
        default=None, description="Options of objective grpo, its grader included."
    )
    num_train_epochs: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="Passes over the training data (may be fractional); max_steps > 0 "
        "overrides it.",
    )
    max_steps: int = Field(default=-1, ge=-1, description="Overrides epochs when > 0.")
    learning_rate: float = Field(
        default=2e-4, gt=0, le=1.0, description="Peak learning rate (after warmup)."
    )
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
    ] = Field(
        default="linear",
        description="How the learning rate changes after warmup (transformers' "
        "lr_scheduler_type).",
    )
    warmup_ratio: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of the optimizer steps over which the learning rate rises "
        "linearly from 0.",
    )
    weight_decay: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="The optimizer's weight decay (transformers leaves biases and norm "
        "weights out).",
    )
    per_device_train_batch_size: int = Field(
        default=8,
        ge=1,
        le=4096,
        description="Examples per process per micro-step; the effective batch is this x "
        "gradient_accumulation_steps x processes.",
    )
    per_device_eval_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Examples per process per evaluation step; default: "
        "per_device_train_batch_size.",
    )
    gradient_accumulation_steps: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="Micro-steps whose gradients add up to one optimizer step.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in backward instead of storing them: about a "
        "third more compute for activation memory that no longer grows with depth.",
    )
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        default="no", description="fp16/bf16 need a GPU worker."
    )
    max_grad_norm: float = Field(
        default=1.0,
        ge=0.0,
        description="Clip the gradients' global norm to this before each step; 0: no clipping.",
    )
    seed: int = Field(
        default=42,
        ge=0,
        le=2**32 - 1,
        description="Seed of the adapter's initial weights, the data order and dropout.",
    )
    logging_steps: int = Field(
        default=10,
        ge=1,
        description="Report loss, learning rate and throughput every N optimizer steps.",
    )
    eval_steps: int | None = Field(default=None, ge=1, description="Evaluate every N steps.")
    save_steps: int = Field(default=500, ge=1, description="Checkpoint every N steps.")
    save_total_limit: int | None = Field(
        default=None, ge=1, description="Keep only the newest N checkpoints; default: all."
    )
    neftune_noise_alpha: float | None = Field(
        default=None,
        gt=0,
        description="sft only: NEFTune, noise added to the input embeddings in training, "
        "scaled by this alpha (the paper uses 5 to 15).",
    )
    early_stopping_patience: int | None = Field(
        default=None, ge=1, description="Stop after N evaluations without eval_loss improving."
    )
    class_weights: dict[str, float] | None = Field(
        default=None, description="seq_cls: loss weight per label name."
    )
    export_merged: bool = Field(
        default=False,
        description="Also export the base with the adapter merged in, to merged/ (a separate "
        "step after training; lora or ia3 only).",
    )

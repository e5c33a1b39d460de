"""The job spec: what a user POSTs to /v1/jobs, and what the trainer reads from spec.json.

Names follow transformers / accelerate / peft so a user can move settings across. Field
checks live on the models; checks that relate several fields live in ``spec_problems``,
which collects *every* problem (with its field path) instead of stopping at the first, so
a user fixes a spec in one round trip. ``parse_job_spec`` runs both and raises one
``SpecError``.

This module must stay importable without torch (the API validates specs without it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
)

Task = Literal["causal_lm", "seq2seq_lm", "seq_cls"]
DataFormat = Literal[
    "text", "prompt_completion", "chat", "seq2seq", "classification", "preference", "kto"
]
Objective = Literal["sft", "dpo", "orpo", "kto"]

# Which data formats each task can learn from.
FORMATS_BY_TASK: dict[str, tuple[str, ...]] = {
    "causal_lm": ("text", "prompt_completion", "chat", "preference", "kto"),
    "seq2seq_lm": ("seq2seq", "prompt_completion"),
    "seq_cls": ("classification",),
}

# The data format each training objective learns from (sft: the task's formats above).
PREFERENCE_FORMAT: dict[str, str] = {"dpo": "preference", "orpo": "preference", "kto": "kto"}
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


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelled option must never be silently ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


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


class DatasetSpec(_Strict):
    file_id: str | None = Field(
        default=None,
        description="An uploaded file (POST /v1/files): JSONL, a JSON array of objects, either "
        "gzip-compressed (.jsonl.gz, .json.gz), CSV or Parquet.",
    )
    path: str | None = Field(
        default=None,
        description="Under an allowed data root: a file (as for file_id), a directory of such "
        "files, or a directory written by datasets' save_to_disk (one split).",
    )
    eval_file_id: str | None = Field(default=None, description="Uploaded file for evaluation.")
    eval_path: str | None = Field(
        default=None, description="Evaluation data under a data root (as for path)."
    )
    eval_split: float = Field(
        default=0.0, ge=0.0, lt=0.5, description="Fraction of training rows held out for eval."
    )
    format: DataFormat = Field(
        default="text",
        description="text: one field of raw text; prompt_completion: loss on completion only; "
        "chat: list of {role, content} rendered with the tokenizer's chat template (the "
        "model's tokenizer must have one); seq2seq: "
        "input/target; classification: text/label; preference (training.objective dpo or "
        "orpo): prompt/chosen/rejected, each plain text, or the prompt a list of {role, "
        "content} messages and chosen/rejected the assistant reply (text or messages), "
        "rendered with the chat template; kto (training.objective kto): unpaired "
        "prompt/completion/label, label true for a desirable completion, false for an "
        "undesirable one.",
    )
    text_field: str = Field(default="text", min_length=1, max_length=128)
    prompt_field: str = Field(default="prompt", min_length=1, max_length=128)
    completion_field: str = Field(default="completion", min_length=1, max_length=128)
    messages_field: str = Field(default="messages", min_length=1, max_length=128)
    input_field: str = Field(default="input", min_length=1, max_length=128)
    target_field: str = Field(default="target", min_length=1, max_length=128)
    label_field: str = Field(
        default="label",
        min_length=1,
        max_length=128,
        description="classification: the class name or id; kto: true (desirable) or false.",
    )
    chosen_field: str = Field(
        default="chosen",
        min_length=1,
        max_length=128,
        description="preference: the preferred answer to the prompt.",
    )
    rejected_field: str = Field(
        default="rejected",
        min_length=1,
        max_length=128,
        description="preference: the dispreferred answer to the same prompt.",
    )
    max_seq_length: int = Field(
        default=1024, ge=8, le=131_072, description="Tokens per example; longer are truncated."
    )
    packing: bool = Field(
        default=False,
        description="causal_lm: pack several examples per row (attention stays per example).",
    )

    def required_fields(self) -> list[tuple[str, str]]:
        """(spec param, column name) pairs the data must have for this format."""
        by_format: dict[str, list[str]] = {
            "text": ["text_field"],
            "prompt_completion": ["prompt_field", "completion_field"],
            "chat": ["messages_field"],
            "seq2seq": ["input_field", "target_field"],
            "classification": ["text_field", "label_field"],
            "preference": ["prompt_field", "chosen_field", "rejected_field"],
            "kto": ["prompt_field", "completion_field", "label_field"],
        }
        return [(f"dataset.{name}", getattr(self, name)) for name in by_format[self.format]]


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
        "Optimization) from dataset.format kto. Preference objectives need task causal_lm "
        "and peft method lora or ia3.",
    )
    preference: PreferenceSpec | None = Field(
        default=None,
        description="Options of objective dpo, orpo or kto; default: TRL's defaults "
        "(beta 0.1, loss_type sigmoid).",
    )
    num_train_epochs: float = Field(default=1.0, gt=0, le=1000)
    max_steps: int = Field(default=-1, ge=-1, description="Overrides epochs when > 0.")
    learning_rate: float = Field(default=2e-4, gt=0, le=1.0)
    lr_scheduler_type: Literal[
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "constant",
        "constant_with_warmup",
        "inverse_sqrt",
    ] = "linear"
    warmup_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    per_device_train_batch_size: int = Field(default=8, ge=1, le=4096)
    per_device_eval_batch_size: int | None = Field(default=None, ge=1, le=4096)
    gradient_accumulation_steps: int = Field(default=1, ge=1, le=4096)
    gradient_checkpointing: bool = False
    mixed_precision: Literal["no", "fp16", "bf16"] = Field(
        default="no", description="fp16/bf16 need a GPU worker."
    )
    max_grad_norm: float = Field(default=1.0, ge=0.0)
    seed: int = Field(default=42, ge=0, le=2**32 - 1)
    logging_steps: int = Field(default=10, ge=1)
    eval_steps: int | None = Field(default=None, ge=1, description="Evaluate every N steps.")
    save_steps: int = Field(default=500, ge=1, description="Checkpoint every N steps.")
    save_total_limit: int | None = Field(default=None, ge=1)
    neftune_noise_alpha: float | None = Field(default=None, gt=0)
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


class FsdpSpec(_Strict):
    version: Literal[1, 2] = Field(default=2, description="FSDP1 or FSDP2 (fully_shard).")
    sharding_strategy: Literal[
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"
    ] = Field(
        default="FULL_SHARD",
        description="FSDP2: FULL_SHARD (reshard after forward) or SHARD_GRAD_OP. FSDP1 also: "
        "NO_SHARD, and HYBRID_SHARD / HYBRID_SHARD_ZERO2 (shard within a machine, replicate "
        "across machines: needs num_machines > 1).",
    )
    offload_params: bool = Field(
        default=False,
        description="Keep parameters (and gradients, optimizer step) on CPU: CPUOffload in "
        "FSDP1, CPUOffloadPolicy in FSDP2.",
    )
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = (
        "TRANSFORMER_BASED_WRAP"
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        default=None, description="Default: the model's _no_split_modules."
    )
    min_num_params: int | None = Field(default=None, ge=1, description="SIZE_BASED_WRAP only.")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"] = "BACKWARD_PRE"
    forward_prefetch: bool = False
    state_dict_type: Literal["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"] = (
        "SHARDED_STATE_DICT"
    )
    cpu_ram_efficient_loading: bool = True
    sync_module_states: bool = True
    use_orig_params: bool = Field(
        default=True,
        description="FSDP1 only. Must stay true: a PEFT adapter trains inside frozen layers, "
        "and FSDP1 can only flatten those together with use_orig_params.",
    )
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = Field(
        default=False,
        description="FSDP2 with activation_checkpointing: keep the checkpointed activations "
        "in CPU memory between forward and backward.",
    )


class DeepSpeedSpec(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 3
    offload_optimizer_device: Literal["none", "cpu", "nvme"] = "none"
    offload_param_device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = Field(default=None, description="Absolute path for NVMe offload.")
    zero3_init_flag: bool = True
    zero3_save_16bit_model: bool = Field(
        default=True,
        description="ZeRO-3: gather the weights for every save. ftune trains PEFT adapters, "
        "which the Trainer always gathers (trainable weights only), so false is refused.",
    )
    gradient_clipping: float | None = Field(
        default=None, ge=0, description="Default: training.max_grad_norm."
    )


class DistributedSpec(_Strict):
    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] = "none"
    num_processes: int = Field(default=1, ge=1, le=1024, description="Processes in total.")
    num_machines: int = Field(
        default=1, ge=1, le=128,
        description="Machines (nodes) the processes are spread over; more than 1 runs on a "
        "SLURM pool, which picks the nodes and the main process address.",
    )
    machine_rank: int = Field(default=0, ge=0)
    main_process_ip: str | None = Field(
        default=None, max_length=255,
        description="Rendezvous address for a run by hand; on SLURM it is the allocation's "
        "first node (leave unset).",
    )
    main_process_port: int | None = Field(default=None, ge=1024, le=65535)
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)


class ResourcesSpec(_Strict):
    timeout_seconds: int | None = Field(
        default=None, ge=1, le=30 * 24 * 3600, description="Wall-clock limit; then failed."
    )


Tracker = Literal["tensorboard", "mlflow", "wandb"]
_TAG = Annotated[str, Field(min_length=1, max_length=250)]


class TrackingSpec(_Strict):
    """Experiment tracking: which trackers log this job. Where they write is the operator's
    choice (server settings), not the spec's."""

    report_to: list[Tracker] = Field(
        default_factory=list,
        max_length=3,
        description="Trackers that log params (the spec as it ran), metric curves and the "
        "final adapter: tensorboard (event files in the job directory, GET "
        "/v1/jobs/{id}/tensorboard), mlflow (the operator's tracking server), wandb (the "
        "operator's W&B project; offline runs are kept in the job directory). Each must be "
        "enabled on the server. The job object's tracking field links the runs.",
    )
    run_name: str | None = Field(
        default=None, max_length=200, description="Run name in MLflow / W&B; default: the job id."
    )
    tags: dict[_TAG, Annotated[str, Field(max_length=5000)]] = Field(
        default_factory=dict,
        max_length=50,
        description="Tags on the MLflow run; on the W&B run as key=value labels (cut to 64 "
        "characters) and in its config. ftune adds ftune.job_id and ftune.tenant_id.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        max_length=1000,
        description="An MLflow tracking URI the server allows (its "
        "mlflow_allowed_tracking_uris); default: the server's.",
    )

    @field_validator("run_name")
    @classmethod
    def _printable(cls, v: str | None) -> str | None:
        if v is not None and any(ord(c) < 32 for c in v):
            raise ValueError("must not contain control characters")
        return v


class JobSpec(_Strict):
    name: str | None = Field(default=None, max_length=200, description="Optional label.")
    model: ModelSpec
    dataset: DatasetSpec
    peft: PeftSpec = Field(default_factory=LoraSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    distributed: DistributedSpec = Field(default_factory=DistributedSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    priority: int = Field(
        default=0,
        ge=-100,
        le=100,
        description="Queue priority: higher runs first, first come first served within a "
        "priority. Each tenant may use up to its bound (FTUNE_MAX_PRIORITY, or its entry in "
        "FTUNE_TENANT_LIMITS); more is a 422.",
    )

    @field_validator("name")
    @classmethod
    def _no_control_chars(cls, v: str | None) -> str | None:
        if v is not None and any(ord(c) < 32 for c in v):
            raise ValueError("must not contain control characters")
        return v


@dataclass(frozen=True)
class Problem:
    param: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"param": self.param, "message": self.message}


class SpecError(ValueError):
    """Every problem found in a spec, each with the field path it concerns."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{p.param}: {p.message}" for p in problems))


def _explicit(model: BaseModel, field: str) -> bool:
    return field in model.model_fields_set


def spec_problems(spec: JobSpec) -> list[Problem]:
    """Cross-field checks: combinations that the libraries would reject or silently ignore."""
    out: list[Problem] = []

    def bad(param: str, message: str) -> None:
        out.append(Problem(param, message))

    m, d, p, t, dist = spec.model, spec.dataset, spec.peft, spec.training, spec.distributed

    # Data.
    if (d.file_id is None) == (d.path is None):
        bad("dataset.file_id", "give exactly one of dataset.file_id or dataset.path")
    if d.eval_file_id is not None and d.eval_path is not None:
        bad("dataset.eval_file_id", "give at most one of eval_file_id or eval_path")
    has_eval_file = d.eval_file_id is not None or d.eval_path is not None
    if has_eval_file and d.eval_split > 0:
        bad("dataset.eval_split", "an eval file is given; eval_split must be 0")
    if d.format not in FORMATS_BY_TASK[m.task]:
        bad(
            "dataset.format",
            f"task {m.task} trains on formats {', '.join(FORMATS_BY_TASK[m.task])}, "
            f"not {d.format}",
        )
    if d.packing and m.task != "causal_lm":
        bad("dataset.packing", "packing is only for causal_lm")
    out.extend(_objective_problems(spec))
    if m.num_labels is not None and m.task != "seq_cls":
        bad("model.num_labels", "num_labels is only for task seq_cls")
    if m.step is not None and m.from_job is None:
        bad("model.step", "step names a checkpoint of model.from_job; give from_job too")
    if m.task != "seq_cls" and t.class_weights is not None:
        bad("training.class_weights", "class_weights are only for task seq_cls")

    # Evaluation.
    has_eval = has_eval_file or d.eval_split > 0
    if t.eval_steps is not None and not has_eval:
        bad("training.eval_steps", "needs eval data: dataset.eval_file_id, eval_path or eval_split")
    if t.early_stopping_patience is not None and not has_eval:
        bad("training.early_stopping_patience", "needs eval data to watch eval_loss")

    # PEFT.
    if (isinstance(p, PromptTuningSpec) and p.prompt_tuning_init == "TEXT"
            and not p.prompt_tuning_init_text):
        bad("peft.prompt_tuning_init_text", "required when prompt_tuning_init is TEXT")
    if isinstance(p, (PromptTuningSpec, PrefixTuningSpec)) and dist.strategy in ("fsdp",):
        bad("peft.method", f"{p.method} is not supported with FSDP; use lora or ia3")
    if isinstance(p, PrefixTuningSpec) and t.gradient_checkpointing:
        bad("training.gradient_checkpointing", "prefix_tuning does not support it")
    if isinstance(p, (PromptTuningSpec, PrefixTuningSpec)):
        # Virtual tokens are not weights: nothing to fold into the base. They also take over
        # the positions and the attention mask, which packing needs per example.
        if t.export_merged:
            bad("training.export_merged", "export_merged needs lora or ia3")
        if d.packing:
            bad("dataset.packing", "packing needs peft method lora or ia3")

    if m.quantization is not None:
        out.extend(_quantization_problems(m.quantization, p, t, spec.distributed))

    # Tracking.
    tr = spec.tracking
    if len(set(tr.report_to)) != len(tr.report_to):
        bad("tracking.report_to", "names a tracker twice")
    if tr.mlflow_tracking_uri is not None and "mlflow" not in tr.report_to:
        bad("tracking.mlflow_tracking_uri", "set, but mlflow is not in report_to: it would be "
            "ignored")
    if (tr.run_name is not None or tr.tags) and not ({"mlflow", "wandb"} & set(tr.report_to)):
        bad("tracking.report_to", "run_name and tags are for mlflow or wandb: add one, or "
            "they would be ignored")

    # Distributed.
    if dist.strategy == "none" and dist.num_processes != 1:
        bad("distributed.num_processes", "strategy none runs one process; use ddp for more")
    if dist.strategy == "ddp" and dist.num_processes * 1 < 2:
        bad("distributed.num_processes", "ddp needs at least 2 processes")
    if dist.num_machines > 1:
        if dist.strategy == "none":
            bad("distributed.num_machines", "several machines need strategy ddp, fsdp or deepspeed")
        if dist.num_processes % dist.num_machines:
            bad(
                "distributed.num_processes",
                "the total over all machines: must be a multiple of num_machines",
            )
    if dist.machine_rank >= dist.num_machines:
        bad("distributed.machine_rank", "must be below num_machines")
    if dist.main_process_ip and dist.num_machines == 1:
        bad(
            "distributed.main_process_ip",
            "only used with num_machines > 1 (one machine rendezvous locally): it would be "
            "ignored",
        )
    if dist.main_process_port is not None and dist.strategy == "none":
        bad("distributed.main_process_port", "strategy none starts no process group: ignored")
    if dist.strategy != "fsdp" and dist.fsdp.model_fields_set:
        bad("distributed.fsdp", f"set, but strategy is {dist.strategy}: it would be ignored")
    if dist.strategy != "deepspeed" and dist.deepspeed.model_fields_set:
        bad("distributed.deepspeed", f"set, but strategy is {dist.strategy}: it would be ignored")
    if dist.strategy == "fsdp":
        out.extend(_fsdp_problems(dist.fsdp, t, dist, m))
    if dist.strategy == "deepspeed":
        out.extend(_deepspeed_problems(dist.deepspeed, t))
    return out


_DPO_ONLY = ("loss_type", "label_smoothing")
_KTO_ONLY = ("kto_loss_type", "desirable_weight", "undesirable_weight")


def _objective_problems(spec: JobSpec) -> list[Problem]:
    """Which objective learns from which data format, and the options each one reads."""
    out: list[Problem] = []
    m, d, p, t = spec.model, spec.dataset, spec.peft, spec.training

    def bad(param: str, message: str) -> None:
        out.append(Problem(param, message))

    obj = t.objective
    if obj == "sft":
        if d.format in ("preference", "kto"):
            bad(
                "dataset.format",
                f"{d.format} data needs training.objective "
                f"{'dpo or orpo' if d.format == 'preference' else 'kto'}",
            )
        if t.preference is not None:
            bad("training.preference", "only for objective dpo, orpo or kto: it would be ignored")
        return out
    if m.task != "causal_lm":
        bad("training.objective", f"{obj} trains causal_lm models, not {m.task}")
    want = PREFERENCE_FORMAT[obj]
    if d.format != want and m.task == "causal_lm":
        bad("dataset.format", f"objective {obj} learns from format {want}, not {d.format}")
    if not isinstance(p, (LoraSpec, IA3Spec)):
        # The reference model is the base with the adapter disabled; virtual-token methods
        # also take over the prompt positions that the preference losses score.
        bad("peft.method", f"objective {obj} needs lora or ia3, not {p.method}")
    if d.packing:
        bad("dataset.packing", f"objective {obj} scores whole (prompt, answer) pairs: no packing")
    if t.neftune_noise_alpha is not None:
        bad("training.neftune_noise_alpha", f"only for objective sft, not {obj}")
    q = t.preference
    if q is not None:
        if obj != "dpo":
            for field in _DPO_ONLY:
                if _explicit(q, field):
                    bad(f"training.preference.{field}", f"dpo only: {obj} would ignore it")
        if obj != "kto":
            for field in _KTO_ONLY:
                if _explicit(q, field):
                    bad(f"training.preference.{field}", f"kto only: {obj} would ignore it")
        if q.label_smoothing > 0 and q.loss_type not in ("robust", "exo_pair"):
            bad(
                "training.preference.label_smoothing",
                f"only used by loss_type robust or exo_pair, not {q.loss_type}",
            )
    kto_loss = q.kto_loss_type if q is not None else "kto"
    if obj == "kto" and kto_loss == "kto" and t.per_device_train_batch_size < 2:
        # TRL: the KL term is estimated from the other rows of the same micro-batch.
        bad(
            "training.per_device_train_batch_size",
            "objective kto estimates its KL term from the other rows of a micro-batch: at "
            "least 2",
        )
    return out


_FOUR_BIT_ONLY = ("quant_type", "compute_dtype", "double_quant", "quant_storage")
_HALF = {"fp16": "float16", "bf16": "bfloat16"}


def _quantization_problems(
    q: QuantizationSpec, p: Any, t: TrainingSpec, dist: DistributedSpec
) -> list[Problem]:
    out: list[Problem] = []
    pre = "model.quantization."
    sharded = dist.strategy in ("fsdp", "deepspeed")
    if sharded and q.load_in == "8bit":
        out.append(
            Problem(
                pre + "load_in",
                f"8bit cannot be sharded by {dist.strategy}: its int8 weights have no float "
                "storage to shard; use load_in 4bit with quant_storage bfloat16 (or float32), "
                "or strategy ddp",
            )
        )
    if sharded and q.load_in == "4bit" and q.quant_storage == "uint8":
        # Seen with FSDP2: the uint8 4-bit weights are left out of sharding, whole on every
        # rank. peft's FSDP and DeepSpeed guides store them in the model's float dtype.
        out.append(
            Problem(
                pre + "quant_storage",
                f"uint8 cannot be sharded by {dist.strategy} (FSDP2 leaves uint8 4-bit weights "
                "whole on every rank): use the float dtype of the other weights, e.g. "
                "bfloat16 with model.dtype bfloat16, or float32",
            )
        )
    if dist.strategy == "fsdp":
        f = dist.fsdp
        if f.version == 1:
            out.append(
                Problem(
                    "distributed.fsdp.version",
                    "QLoRA (model.quantization) is verified with FSDP2 only: use version 2",
                )
            )
        if f.cpu_ram_efficient_loading:
            out.append(
                Problem(
                    "distributed.fsdp.cpu_ram_efficient_loading",
                    "must be false with model.quantization: every rank loads and quantizes "
                    "its own copy before FSDP shards it (ranks without weights would build "
                    "an unquantized model)",
                )
            )
    if (
        dist.strategy == "deepspeed"
        and dist.deepspeed.zero_stage == 3
        and dist.deepspeed.zero3_init_flag
    ):
        # transformers 5.23 never creates a quantized model under zero.Init: it is loaded
        # whole, and ZeRO-3 partitions it when the engine starts.
        out.append(
            Problem(
                "distributed.deepspeed.zero3_init_flag",
                "must be false with model.quantization: transformers loads a quantized base "
                "whole on every rank (no zero.Init); ZeRO-3 partitions it when training starts",
            )
        )
    if not isinstance(p, LoraSpec):
        # prepare_model_for_kbit_training + peft's bitsandbytes layers are what QLoRA is;
        # the other methods are not offered on a quantized base here.
        out.append(
            Problem(
                "peft.method",
                f"{p.method} cannot train on a quantized base (model.quantization): use lora "
                "(use_dora / use_rslora included)",
            )
        )
    if q.load_in == "8bit":
        for field in _FOUR_BIT_ONLY:
            if _explicit(q, field):
                out.append(Problem(pre + field, "4bit only: load_in 8bit would ignore it"))
    elif q.compute_dtype in ("float16", "bfloat16") and t.mixed_precision in _HALF:
        want = _HALF[t.mixed_precision]
        if q.compute_dtype != want:
            out.append(
                Problem(
                    pre + "compute_dtype",
                    f"{q.compute_dtype} contradicts training.mixed_precision "
                    f"{t.mixed_precision}: use {want} (or leave it unset: it follows "
                    "mixed_precision)",
                )
            )
    return out


def _fsdp_problems(
    f: FsdpSpec, t: TrainingSpec, dist: DistributedSpec, m: ModelSpec
) -> list[Problem]:
    out: list[Problem] = []
    pre = "distributed.fsdp."

    def bad(field: str, message: str) -> None:
        out.append(Problem(pre + field, message))

    if f.auto_wrap_policy == "SIZE_BASED_WRAP" and f.min_num_params is None:
        bad("min_num_params", "required with auto_wrap_policy SIZE_BASED_WRAP")
    if f.auto_wrap_policy != "SIZE_BASED_WRAP" and f.min_num_params is not None:
        bad("min_num_params", "only used with SIZE_BASED_WRAP: it would be ignored")
    if f.auto_wrap_policy != "TRANSFORMER_BASED_WRAP" and f.transformer_layer_cls_to_wrap:
        bad("transformer_layer_cls_to_wrap", "only used with TRANSFORMER_BASED_WRAP")
    if f.activation_checkpointing and t.gradient_checkpointing:
        bad(
            "activation_checkpointing",
            "conflicts with training.gradient_checkpointing; use one of them",
        )
    if f.activation_checkpointing_offload and not f.activation_checkpointing:
        bad("activation_checkpointing_offload", "needs activation_checkpointing true")
    if f.version == 2:
        if f.sharding_strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            bad("sharding_strategy", "FSDP2 supports FULL_SHARD and SHARD_GRAD_OP only")
        if f.forward_prefetch:
            bad("forward_prefetch", "not implemented in FSDP2")
        if f.state_dict_type == "LOCAL_STATE_DICT":
            bad("state_dict_type", "FSDP2 has no LOCAL_STATE_DICT")
        for field in ("use_orig_params", "sync_module_states", "backward_prefetch"):
            if _explicit(f, field):
                bad(field, "FSDP1 only: FSDP2 ignores it")
    else:
        if f.cpu_ram_efficient_loading and not f.sync_module_states:
            bad(
                "sync_module_states",
                "must be true with cpu_ram_efficient_loading in FSDP1 (ranks > 0 load no weights)",
            )
        if f.activation_checkpointing_offload:
            bad("activation_checkpointing_offload", "FSDP2 only (accelerate refuses it in FSDP1)")
        if not f.use_orig_params:
            # torch: "Must flatten tensors with uniform requires_grad when use_orig_params=False"
            bad(
                "use_orig_params",
                "must be true: the frozen base and the trainable adapter share each wrapped "
                "layer, and FSDP1 flattens mixed requires_grad only with use_orig_params",
            )
        if m.dtype in ("float16", "bfloat16"):
            # torch: "Must flatten tensors with uniform dtype"; peft keeps adapters in fp32.
            out.append(
                Problem(
                    "model.dtype",
                    f"FSDP1 flattens the {m.dtype} base and the float32 adapter of a layer "
                    "into one tensor, which needs one dtype: use distributed.fsdp.version 2, "
                    "or model.dtype float32 with training.mixed_precision",
                )
            )
        if f.sharding_strategy in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
            if dist.num_machines == 1:
                bad(
                    "sharding_strategy",
                    f"{f.sharding_strategy} replicates across machines; on one machine it is "
                    f"{'FULL_SHARD' if f.sharding_strategy == 'HYBRID_SHARD' else 'SHARD_GRAD_OP'}"
                    " (use that)",
                )
            if f.auto_wrap_policy == "NO_WRAP":
                # torch: "Manual wrapping with HYBRID_SHARD requires explicit specification
                # of process group or device_mesh"
                bad("auto_wrap_policy", f"{f.sharding_strategy} needs an auto wrap policy")
    return out


def _deepspeed_problems(z: DeepSpeedSpec, t: TrainingSpec) -> list[Problem]:
    out: list[Problem] = []
    pre = "distributed.deepspeed."

    def bad(field: str, message: str) -> None:
        out.append(Problem(pre + field, message))

    if z.offload_param_device != "none" and z.zero_stage != 3:
        bad("offload_param_device", "parameter offload needs zero_stage 3")
    if z.offload_optimizer_device != "none" and z.zero_stage < 2:
        bad("offload_optimizer_device", "optimizer offload needs zero_stage 2 or 3")
    uses_nvme = "nvme" in (z.offload_param_device, z.offload_optimizer_device)
    if uses_nvme and not z.nvme_path:
        bad("nvme_path", "required when offloading to nvme")
    if z.nvme_path and not z.nvme_path.startswith("/"):
        bad("nvme_path", "must be an absolute path")
    if z.nvme_path and not uses_nvme:
        bad("nvme_path", "only used when offloading to nvme: it would be ignored")
    if z.offload_optimizer_device == "nvme" and z.zero_stage < 3:
        # ZeRO-1/2 take any offload device as "cpu": nothing would be written to NVMe.
        bad("offload_optimizer_device", "nvme needs zero_stage 3 (ZeRO-1/2 offload to cpu)")
    if z.zero_stage == 3 and not z.zero3_save_16bit_model:
        bad(
            "zero3_save_16bit_model",
            "false would be ignored: the Trainer gathers a PEFT adapter's (trainable) weights "
            "for every save under ZeRO-3, and the final adapter is always consolidated",
        )
    if z.zero_stage != 3:
        for field in ("zero3_init_flag", "zero3_save_16bit_model"):
            if _explicit(z, field):
                bad(field, "only used with zero_stage 3: it would be ignored")
    if z.gradient_clipping is not None and z.gradient_clipping != t.max_grad_norm:
        bad(
            "gradient_clipping",
            f"differs from training.max_grad_norm ({t.max_grad_norm}); set one value",
        )
    return out


_PEFT_TAGS = ("lora", "ia3", "prompt_tuning", "prefix_tuning")


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    # Pydantic puts union members into the location ("peft.lora.r",
    # "peft.target_modules.list[constrained-str]"); users wrote "peft.r".
    parts: list[str] = []
    for i, x in enumerate(loc):
        if isinstance(x, int):
            parts[-1:] = [f"{parts[-1]}[{x}]"] if parts else [f"[{x}]"]
            continue
        x = str(x)
        if (i == 1 and loc[0] == "peft" and x in _PEFT_TAGS) or "[" in x or x in ("str", "int"):
            continue
        parts.append(x)
    return ".".join(parts) or "body"


def _merge(problems: list[Problem]) -> list[Problem]:
    """One problem per field: a union yields one error per member for the same field."""
    merged: dict[str, list[str]] = {}
    for p in problems:
        msgs = merged.setdefault(p.param, [])
        if p.message not in msgs:
            msgs.append(p.message)
    return [Problem(param, "; or ".join(msgs)) for param, msgs in merged.items()]


def parse_job_spec(data: Any) -> JobSpec:
    """Validate a request body into a JobSpec, or raise SpecError listing every problem."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        problems = [Problem(_loc_to_param(err["loc"]), err["msg"]) for err in e.errors()]
        raise SpecError(_merge(problems)) from None
    problems = spec_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def resolved_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec with every default that applies filled in: itself a valid spec (re-submit it
    to run the same job after a default changes).

    A full dump also holds defaults of sections the job does not use (``fsdp`` without
    strategy fsdp, FSDP1-only fields under FSDP2...), which the cross-field rules refuse as
    ignored; those rules are the one place that knows what applies, so every field they
    name is dropped until the dump validates. The request itself validated, so each such
    field is a filled-in default, never something the user set."""
    out = spec.model_dump(mode="json")
    for _ in range(8):
        try:
            parse_job_spec(out)
            return out
        except SpecError as e:
            dropped = [_drop(out, p.param) for p in e.problems]
            if not any(dropped):
                break
    return spec.model_dump(mode="json", exclude_unset=True)


def _drop(data: dict[str, Any], param: str) -> bool:
    *parents, last = param.split(".")
    node: Any = data
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False

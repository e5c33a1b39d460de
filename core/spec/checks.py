"""Checks that relate several fields: combinations the libraries would reject or silently
ignore, each problem with its field path (core/spec/parsing.py runs them with the field
checks and lists every problem)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from core.spec.base import Problem
from core.spec.data import FORMATS_BY_TASK
from core.spec.distributed import DeepSpeedSpec, DistributedSpec, FsdpSpec
from core.spec.grpo import grpo_problems
from core.spec.job import JobSpec
from core.spec.model import ModelSpec, QuantizationSpec
from core.spec.peft import FullSpec, IA3Spec, LoraSpec, PrefixTuningSpec, PromptTuningSpec
from core.spec.training import PREFERENCE_FORMAT, TrainingSpec


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
    if d.format != "auto" and d.format not in FORMATS_BY_TASK[m.task]:
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

    if isinstance(p, FullSpec) and t.export_merged:
        bad("training.export_merged", "nothing to merge: peft method full saves the whole "
            "trained model")

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
    if dist.resume_on is not None:
        if dist.strategy == "none":
            bad("distributed.resume_on", "strategy none runs one process: use ddp or fsdp for "
                "a job that may continue on other process counts")
        elif dist.num_machines > 1:
            bad("distributed.resume_on", "single-machine jobs only: a SLURM pool places a "
                "multi-machine job on the nodes it asked for")
        elif dist.strategy == "deepspeed" and dist.deepspeed.offload_optimizer_device == "nvme":
            # core/train/deepspeed_checkpoint.py: NVMe swap files are per rank.
            bad("distributed.resume_on", "an optimizer offloaded to NVMe keeps its state in "
                "per-rank swap files: its checkpoints resume only on their own process count")
        if len(set(dist.resume_on)) != len(dist.resume_on):
            bad("distributed.resume_on", "names a process count twice")
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
        out.extend(_fsdp_problems(dist.fsdp, t, dist, m, full=isinstance(p, FullSpec)))
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
        if t.grpo is not None:
            bad("training.grpo", "only for objective grpo: it would be ignored")
        return out
    if m.task != "causal_lm":
        bad("training.objective", f"{obj} trains causal_lm models, not {m.task}")
    want = PREFERENCE_FORMAT[obj]
    if d.format not in (want, "auto") and m.task == "causal_lm":
        bad("dataset.format", f"objective {obj} learns from format {want}, not {d.format}")
    # grpo also trains in full: its reference (beta > 0) is then a frozen copy of the base
    # that TRL loads beside the policy. The preference objectives' reference is the base
    # with the adapter disabled; virtual-token methods also take over the prompt positions
    # that their losses score.
    allowed: tuple[type, ...] = (LoraSpec, IA3Spec)
    if obj == "grpo":
        allowed = (LoraSpec, IA3Spec, FullSpec)
    if not isinstance(p, allowed):
        need = "lora, ia3 or full" if obj == "grpo" else "lora or ia3"
        bad("peft.method", f"objective {obj} needs {need}, not {p.method}")
    if d.packing:
        bad("dataset.packing", f"objective {obj} scores whole (prompt, answer) pairs: no packing")
    if t.neftune_noise_alpha is not None:
        bad("training.neftune_noise_alpha", f"only for objective sft, not {obj}")
    if obj == "grpo":
        if t.preference is not None:
            bad("training.preference", "only for objective dpo, orpo or kto: it would be ignored")
        out.extend(Problem(param, message) for param, message in grpo_problems(spec))
    elif t.grpo is not None:
        bad("training.grpo", "only for objective grpo: it would be ignored")
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
    if isinstance(p, FullSpec):
        out.append(
            Problem(
                "peft.method",
                "full trains every weight, and quantized (4-bit/8-bit) weights cannot be "
                "trained: drop model.quantization for full fine-tuning, or use lora (QLoRA)",
            )
        )
    elif not isinstance(p, LoraSpec):
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
    f: FsdpSpec, t: TrainingSpec, dist: DistributedSpec, m: ModelSpec, full: bool = False
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
        if not f.use_orig_params and full:
            # The final model is written under the original parameters' names
            # (core/train/full_model.py); without them FSDP1 names only its flat parameters.
            bad("use_orig_params", "must be true for full fine-tuning under FSDP1: the model "
                "is saved under the original parameters' names")
        elif not f.use_orig_params:
            # torch: "Must flatten tensors with uniform requires_grad when use_orig_params=False"
            bad(
                "use_orig_params",
                "must be true: the frozen base and the trainable adapter share each wrapped "
                "layer, and FSDP1 flattens mixed requires_grad only with use_orig_params",
            )
        if m.dtype in ("float16", "bfloat16") and not full:
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

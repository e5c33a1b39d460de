"""`ftune estimate`'s memory: what a spec's run holds per process, before a GPU is asked for
(token counts and steps: core/data/counts.py; time and cost from the fleet's history:
core/jobs/throughput.py).

The model is built on the meta device (no weights read) with the PEFT config the trainer
itself uses, so parameter counts are exact. Memory is the usual accounting, per process:
  * frozen base weights: params x dtype bytes, divided by the world size when sharded
    (FSDP FULL_SHARD/HYBRID, ZeRO-3), on the CPU instead when parameters are offloaded;
  * trainable weights in fp32 (4 B) + their gradients (4 B) + Adam moments (8 B): 16 B per
    trainable parameter; ZeRO-1 shards the moments, ZeRO-2 also the gradients, ZeRO-3 and
    FSDP FULL_SHARD everything; optimizer offload moves the moments to the CPU;
  * a quantized base (model.quantization): its Linear weights at 0.5 B (4-bit) plus the
    per-block constants (fp32 per 64 weights, 0.0625 B; ~0.016 B with double quantization)
    or 1 B (8-bit) each; the rest of the base (embeddings, norms, output head) in fp32,
    where prepare_model_for_kbit_training casts it;
  * FSDP with sharded or offloaded weights: two decoder layers' weights gathered whole in
    the compute dtype (the layer running and the one prefetched);
  * activations: what training holds for backward, per token and decoder layer: ~25 B x
    hidden + 8 B x intermediate (a gated MLP keeps gate, up, act(gate) and their product in
    16 bits; 4 B for an ungated one) with a 16-bit base (LoRA on bf16/fp16 weights): what
    autograd keeps on a Llama block with sdpa (torch's saved-tensor hooks;
    tests/core/jobs/test_estimate.py), and what the GPU check's LoRA peak on an H100 leaves
    (docs/benchmarks.md "GPU check"). ~35 B x hidden + the same MLP bytes with fp32 weights
    under autocast (full fine-tuning's fp32 master weights; QLoRA, whose norms, embeddings
    and head are cast to fp32): read off the H100's peaks (34 B full, 40 B QLoRA), where
    autograd keeps ~25 B on CPU, so CUDA's transients are in it. Twice the 16-bit figures
    in fp32 without autocast. With gradient/activation checkpointing, each layer keeps its
    input alone (hidden x 2 B, or 4 B for an fp32 stream) and one layer at a time is
    recomputed whole in backward. Plus, where the LM head computes every position's
    logits (full-sequence loss, ORPO; core/train/loss.py), 12 B per logit at its peak: the
    16-bit logits, the fp32 log-softmax and both gradients. The fused head of the other
    causal-LM runs holds one tile of them, counted as none.
  * full fine-tuning (peft method full): every parameter trains. With mixed precision and
    model.dtype auto the usual accounting (the ZeRO paper's): 16-bit weights (2 B) and
    gradients (2 B), plus fp32 master weights (4 B) and Adam's two moments (8 B) held with
    the optimizer: 16 B per parameter. With model.dtype naming the dtype, or without mixed
    precision, weights and gradients in that dtype and the moments in it too (torch's Adam
    keeps them in the parameter's dtype): 4 x dtype bytes (8 B for bf16; the GPU check's
    full-bf16 row);
    ``full_state_mb`` is what must fit per process whatever the activations turn out to be;
  * preference objectives (training.objective): DPO and ORPO train on both answers of each
    pair, so the activations kept for backward double; DPO's and KTO's reference is the same
    model with the adapter disabled, run without gradients: no second copy of the weights
    and no stored activations, only extra forward passes (OBJECTIVE_COST).
  * grpo generates: each prompt is answered num_generations times with up to
    max_completion_length new tokens each, one decoding forward per token (batched over the
    answers), before the policy's forward + backward over prompt + answer. Token counts say
    the prompts' tokens times num_generations plus the generated tokens at most
    (``generated_tokens``); a per-device batch counts answers, not prompts. Full GRPO with
    beta > 0 holds a second, frozen copy of the weights as the KL reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from core.spec import AUTO_MODEL_CLASS, JobSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Bytes per quantized weight (bitsandbytes blocks of 64 weights, one absmax constant each).
FOUR_BIT_BYTES = 0.5 + 4 / 64
FOUR_BIT_DOUBLE_QUANT_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
EIGHT_BIT_BYTES = 1.0
# Activations kept for backward per token and decoder layer, per unit of hidden size (the
# residual stream, norms, attention's q/k/v/output) and of MLP width (module docstring).
STREAM16_BYTES = 25
STREAM32_BYTES = 35
GATED_MLP_BYTES = 8
MLP_BYTES = 4
GATED_MLP_NAMES = ("gate_proj", "gate_up_proj", ".w1", ".w3", "wi_0", "wi_1")
# The LM head's peak per logit on the plain path: 16-bit logits, fp32 log-softmax, both grads.
LOGIT_PEAK_BYTES = 12
# Per training row: (sequences whose activations are kept for backward, forward-pass
# equivalents of compute, a backward costing about two forwards).
#   sft:  one sequence, forward + backward                                    -> 3
#   dpo:  chosen + rejected through the policy (2 x 3), and through the reference
#         (the adapter disabled, no grad: 2 x 1)                               -> 8
#   orpo: chosen + rejected through the policy only (no reference)             -> 6
#   kto:  the completion through the policy (3), a mismatched completion for the KL
#         term (no grad: 1), both through the reference (2)                    -> 6
#   grpo: each answer (prompt + completion) through the policy (3), the reference when
#         beta > 0 (1 more, not counted here), and generation: decoding is
#         memory-bound, about one forward of the growing sequence per new token
#         (counted in generated_tokens, not here)                               -> 3
OBJECTIVE_COST: dict[str, tuple[int, int]] = {
    "sft": (1, 3),
    "dpo": (2, 8),
    "orpo": (2, 6),
    "kto": (1, 6),
    "grpo": (1, 3),
}


@dataclass
class Estimate:
    total_params: int
    trainable_params: int
    world_size: int
    weights_dtype: str
    quantized_params: int
    gpu_weights_mb: float
    gpu_training_state_mb: float
    gpu_activations_mb: float
    cpu_offloaded_mb: float
    steps: int | None
    # Weights + gradients + optimizer state of the whole model, before any sharding or
    # offload: what the processes hold between them.
    state_total_mb: float = 0.0
    objective: str = "sft"
    compute_vs_sft: float = 1.0  # compute per training row, relative to sft on one sequence

    @property
    def gpu_total_mb(self) -> float:
        return self.gpu_weights_mb + self.gpu_training_state_mb + self.gpu_activations_mb

    @property
    def gpu_state_mb(self) -> float:
        """Weights, gradients and optimizer state per process: the part of the estimate
        that is accounting, not a guess (activations depend on kernels and allocator)."""
        return self.gpu_weights_mb + self.gpu_training_state_mb


def forget_bitsandbytes() -> None:
    """Make ``import bitsandbytes`` fail, and ``find_spec("bitsandbytes")`` answer None, for
    the rest of this process. peft imports bitsandbytes whenever it is installed
    (peft.helpers), and bitsandbytes imports torch's inductor: about three quarters of a
    local `ftune estimate`, for a model on the meta device that is never quantized (the
    quantized bytes are counted from module shapes). Only for a process that will not load
    or train a model afterwards: peft decides at import whether its bitsandbytes layers
    exist. Parameter counts do not change (tests/cli/test_estimate.py)."""
    import sys

    if "peft" not in sys.modules:  # peft already imported it: nothing left to save
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]


def _meta_model(spec: JobSpec, model_path: str | None, config: Any = None) -> Any:
    """``spec``'s model on the meta device (no weights read, no memory used), wrapped in its
    PEFT method unless the method is full; from ``config`` when given (a config object),
    else from the config at ``model_path``. Returns (model, config)."""
    import torch
    import transformers

    cls_name = AUTO_MODEL_CLASS[spec.model.task]
    kwargs: dict[str, Any] = {}
    if spec.model.task == "seq_cls" and spec.model.num_labels:
        kwargs["num_labels"] = spec.model.num_labels
    if config is None:
        assert model_path is not None, "a config or a model path"
        config = transformers.AutoConfig.from_pretrained(
            model_path, trust_remote_code=spec.model.trust_remote_code, **kwargs
        )
    with torch.device("meta"):
        model = getattr(transformers, cls_name).from_config(config)
    # from_config leaves tied weights (tie_word_embeddings) untied; from_pretrained ties
    # them, and so does the trainer: count them once, as they are trained.
    model.tie_weights()
    if spec.peft.method == "full":
        return model, config  # no adapter (and no peft import: seconds, for nothing)
    from peft import get_peft_model

    from core.model.peft import peft_config, seq2seq_peft_compat

    if spec.model.task == "seq2seq_lm":
        seq2seq_peft_compat(model)
    return get_peft_model(model, peft_config(spec, model_path or "")), config


def estimate(
    spec: JobSpec, model_path: str | None = None, *, rows: int | None = None, config: Any = None,
    data_format: str | None = None,
) -> Estimate:
    """``spec``'s cost per process, from the model's config (``config``, or the one at
    ``model_path``) built on the meta device. ``data_format``: the dataset's format where
    it was detected (dataset.format auto)."""
    model, config = _meta_model(spec, model_path, config)
    full = spec.peft.method == "full"
    if full:
        # Tied weights (an LM head sharing the embedding) count once, as they train once.
        total = trainable = sum(p.numel() for p in model.parameters())
    else:
        trainable, total = model.get_nb_trainable_parameters()
    base = total - trainable
    dist, t = spec.distributed, spec.training
    world = dist.processes

    dtype: str = spec.model.dtype
    if dtype == "auto":
        declared = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "")
        dtype = next((d for d in DTYPE_BYTES if d in declared), "float32")
    wbytes = DTYPE_BYTES[dtype]

    # How many ways each kind of state is split across ranks, and what sits on the CPU.
    shard_weights = shard_grads = shard_optim = 1
    offload_weights = offload_optim = False
    if dist.strategy == "fsdp":
        f = dist.fsdp
        if f.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD"):
            shard_weights = shard_grads = shard_optim = world
        elif f.sharding_strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2"):
            shard_grads = shard_optim = world
        offload_weights = offload_optim = f.offload_params
    elif dist.strategy == "deepspeed":
        z = dist.deepspeed
        if z.zero_stage >= 1:
            shard_optim = world
        if z.zero_stage >= 2:
            shard_grads = world
        if z.zero_stage == 3:
            shard_weights = world
        offload_weights = z.offload_param_device != "none"
        offload_optim = z.offload_optimizer_device != "none"

    mb = 2**20
    quantized = _quantized_params(model) if spec.model.quantization is not None else 0
    base_bytes = base * wbytes
    if spec.model.quantization is not None:
        q = spec.model.quantization
        per = EIGHT_BIT_BYTES if q.load_in == "8bit" else (
            FOUR_BIT_DOUBLE_QUANT_BYTES if q.double_quant else FOUR_BIT_BYTES
        )
        weights_dtype = f"{q.load_in} + float32"
        base_bytes = quantized * per + (base - quantized) * 4
    else:
        weights_dtype = dtype
    # Full fine-tuning keeps fp32 master weights under mixed precision unless model.dtype
    # names the weights' dtype (core/train/recipe.py: the one home of that choice).
    fp32_master = full and t.mixed_precision != "no" and spec.model.dtype == "auto"
    if full:
        wbytes_trained = 2 if fp32_master else wbytes
        weights = trainable * wbytes_trained / shard_weights / mb
        grads = trainable * wbytes_trained / shard_grads / mb
        # fp32 master weights + Adam's two moments, or the moments alone in the weights'
        # dtype (16-bit weights trained as they are, or no mixed precision).
        optim = trainable * (12 if fp32_master else 2 * wbytes) / shard_optim / mb
        if fp32_master:
            weights_dtype = f"{t.mixed_precision} + float32 master weights"
    else:
        weights = (base_bytes + trainable * 4) / shard_weights / mb
        grads = trainable * 4 / shard_grads / mb
        optim = trainable * 8 / shard_optim / mb
    if full and t.grpo is not None and t.grpo.beta > 0:
        # GRPO's KL term in full fine-tuning: TRL loads a frozen copy of the base as the
        # reference (in the policy's load dtype, sharded as the weights; no gradients, no
        # optimizer state). With an adapter the reference is the base, adapter disabled.
        weights += total * wbytes / shard_weights / mb
    state_total_mb = weights * shard_weights + grads * shard_grads + optim * shard_optim
    cpu = 0.0
    if offload_weights:
        cpu += weights
        weights = 0.0
    if offload_optim:
        cpu += optim
        optim = 0.0
    if dist.strategy == "fsdp" and (shard_weights > 1 or offload_weights):
        # FSDP gathers a whole decoder layer's weights before its forward and backward, and
        # prefetches the next one: two layers' weights on the GPU beside the shards.
        layers = _layers(config) or 1
        gathered_bytes = 2 if t.mixed_precision != "no" else wbytes
        weights += 2 * (total / layers) * gathered_bytes / mb

    tokens = t.per_device_train_batch_size * spec.dataset.max_seq_length
    stream32 = wbytes == 4 or fp32_master or spec.model.quantization is not None
    checkpointing = t.gradient_checkpointing or (
        dist.strategy == "fsdp" and dist.fsdp.activation_checkpointing)
    activations = tokens * _layer_bytes_per_token(
        model, config, stream32, t.mixed_precision, checkpointing) / mb
    if _plain_lm_head(spec, model, data_format):
        activations += tokens * (getattr(config, "vocab_size", 0) or 0) * LOGIT_PEAK_BYTES / mb
    sequences, forwards = OBJECTIVE_COST[t.objective]
    activations *= sequences

    steps: int | None = t.max_steps if t.max_steps > 0 else None
    if steps is None and rows is not None:
        per_step = t.per_device_train_batch_size * t.gradient_accumulation_steps * world
        train_rows = rows - int(rows * spec.dataset.eval_split)
        if t.grpo is not None:  # a batch counts answers: num_generations per prompt row
            train_rows *= t.grpo.num_generations
        steps = math.ceil(math.ceil(train_rows / per_step) * t.num_train_epochs)
    return Estimate(
        total_params=total,
        trainable_params=trainable,
        world_size=world,
        weights_dtype=weights_dtype,
        quantized_params=quantized,
        gpu_weights_mb=weights,
        gpu_training_state_mb=grads + optim,
        gpu_activations_mb=activations,
        cpu_offloaded_mb=cpu,
        steps=steps,
        state_total_mb=state_total_mb,
        objective=t.objective,
        compute_vs_sft=forwards / OBJECTIVE_COST["sft"][1],
    )


def _layer_bytes_per_token(
    model: Any, config: Any, stream32: bool, mixed: str, checkpointing: bool
) -> float:
    """Bytes kept per token across the decoder layers for backward (module docstring)."""
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", 0) or 0
    layers = _layers(config)
    inter = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
             or getattr(config, "ffn_dim", None) or getattr(config, "d_ff", None) or 4 * hidden)
    gated = any(name.endswith(GATED_MLP_NAMES) for name, _ in model.named_modules())
    mlp = (GATED_MLP_BYTES if gated else MLP_BYTES) * inter
    if stream32 and mixed == "no":  # fp32 throughout: twice every 16-bit tensor
        per_layer = 2 * (STREAM16_BYTES * hidden + mlp)
    else:
        per_layer = (STREAM32_BYTES if stream32 else STREAM16_BYTES) * hidden + mlp
    if checkpointing:  # every layer's input, and one layer recomputed whole
        return float(layers * hidden * (4 if stream32 else 2) + per_layer)
    return float(per_layer * layers)


def _layers(config: Any) -> int:
    return int(getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", 0) or 0)


def _plain_lm_head(spec: JobSpec, model: Any, data_format: str | None) -> bool:
    """Whether the run computes the logits of every position (core/model/lm_head.py decides;
    a dataset whose format is still auto may be text, so it counts as plain)."""
    if spec.model.task == "seq_cls":
        return False  # a classifier's head: a few labels, not a vocabulary
    if spec.model.task == "seq2seq_lm":
        return True  # its decoder's logits, every position (plain_reason: not causal)
    if spec.training.objective == "orpo":
        return True  # loss.ORPO_REASON
    if spec.training.objective != "sft":
        return False  # DPO, KTO, GRPO: TRL's fused head
    from core.model.lm_head import plain_reason

    if (data_format or spec.dataset.format) == "auto":
        return True
    return plain_reason(spec, model, data_format) is not None


def _quantized_params(model: Any) -> int:
    """Weights bitsandbytes quantizes: every Linear of the base except the output head (as
    transformers' get_keys_to_not_convert), not the adapter's own layers."""
    import torch

    head = model.get_output_embeddings()
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        if any(part.startswith(("lora_", "modules_to_save")) for part in name.split(".")):
            continue
        total += module.weight.numel()
    return total

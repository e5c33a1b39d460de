"""Preference tuning (training.objective dpo, orpo, kto) with TRL's trainers.

What differs from supervised fine-tuning, in one paragraph. DPO scores each (prompt, chosen,
rejected) row by how much more the policy prefers the chosen answer than the reference
model does: loss = -log sigmoid(beta * ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))
for the sigmoid loss. The reference here is the base model with the adapter disabled (the
adapter starts as the identity: LoRA's B is zero, IA3's scales are one), so no second copy
of the model is held; each step costs a second, gradient-free forward pass over the pair
through the same weights. KTO does the same for unpaired rows (prompt, completion,
desirable or not), with a KL term estimated from mismatched pairs of the micro-batch. ORPO
needs no reference: it adds an odds-ratio term to the chosen answer's language-model loss.

TRL's trainers are transformers.Trainer subclasses: the callbacks, checkpoints, resume,
graceful stop and adapter verification of the supervised recipe apply unchanged. TRL
tokenizes the rows itself (rendering message lists with the chat template); this module
turns checked rows into TRL's column names and builds the config and the trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.data.datasets import Datasets, read_checked, split_for_eval
from core.data.tokenize import DataStats, TokenizedDataset
from core.infra.errors import invalid_dataset
from core.spec import JobSpec, PreferenceSpec
from core.train.checkpoint import CheckpointMixin
from core.train.trainer import NonFiniteFlag

# ---------------------------------------------------------------------------- data


def build_preference_datasets(
    spec: JobSpec,
    train_path: Path,
    eval_path: Path | None,
    tokenizer: Any,
    max_decompressed_bytes: int | None = None,
) -> Datasets:
    """Checked rows converted to TRL's columns (core/data/formats: prompt/chosen/rejected or
    prompt/completion/label, text or messages; untokenized: TRL tokenizes them when the
    trainer is built). Same file reading, row checks and eval split as supervised training.

    A prompt given as messages makes the row conversational: TRL renders it with the chat
    template, the answers as the assistant turn(s) that follow."""
    ds = spec.dataset
    checked = read_checked(train_path, spec, "training", max_decompressed_bytes)
    rows = checked.examples
    eval_rows: list[dict[str, Any]] = []
    if eval_path is not None:
        eval_rows = read_checked(eval_path, spec, "evaluation", max_decompressed_bytes).examples
    elif ds.eval_split > 0:
        tr, ev = split_for_eval(len(rows), ds.eval_split, spec.training.seed)
        rows, eval_rows = [rows[i] for i in tr], [rows[i] for i in ev]
    conversational = any(isinstance(r["prompt"], list) for r in rows + eval_rows)
    if conversational and not getattr(tokenizer, "chat_template", None):
        raise invalid_dataset(
            f"dataset.format {checked.format}: rows whose prompt holds messages are rendered "
            "with the chat template, and this model's tokenizer has none (give the prompt as "
            "text, or set dataset.chat_template)"
        )

    def wrap(part: list[dict[str, Any]]) -> TokenizedDataset:
        return TokenizedDataset(part, DataStats(rows=len(part), examples=len(part)))

    return Datasets(
        train=wrap(rows), eval=wrap(eval_rows) if eval_rows else None, labels=None,
        receipt=checked.receipt,
    )


def count_tokens(dataset: Any, stats: DataStats) -> None:
    """Fill ``stats`` from TRL's tokenized dataset: the rows it kept (it drops a row whose
    prompt alone fills max_length) and the tokens of prompt + answer(s)."""
    columns = [c for c in dataset.column_names if c.endswith("_ids")]
    stats.examples = len(dataset)
    stats.dropped = stats.rows - stats.examples
    stats.tokens = sum(len(x) for c in columns for x in dataset[c])


# ---------------------------------------------------------------------------- trainer


def _options(spec: JobSpec) -> PreferenceSpec:
    return spec.training.preference or PreferenceSpec()


def preference_config(spec: JobSpec, values: dict[str, Any]) -> Any:
    """TrainingArguments values -> TRL's DPOConfig / ORPOConfig / KTOConfig.

    TRL's configs change some TrainingArguments defaults (gradient checkpointing on, bf16 on,
    learning rate 1e-6): every such value is passed explicitly from the spec.
    """
    t, ds = spec.training, spec.dataset
    q = _options(spec)
    checkpointing = bool(values["activation_checkpointing"])
    common = {
        **values,
        # TRL's name for the same switch, which it defaults to True.
        "gradient_checkpointing": checkpointing,
        "gradient_checkpointing_kwargs": values["activation_checkpointing_kwargs"],
        "bf16": bool(values["bf16"]),
        "max_length": ds.max_seq_length,
        "beta": q.beta,
        # The collators build their own inputs from TRL's tokenized columns, and pick the
        # ones they need: leave the column pruning to TRL, as its trainers expect.
        "remove_unused_columns": True,
        "disable_dropout": True,
    }
    common.pop("label_names", None)
    if t.objective == "dpo":
        from trl import DPOConfig

        return DPOConfig(
            **common, loss_type=[q.loss_type], label_smoothing=q.label_smoothing
        )
    if t.objective == "kto":
        from trl import KTOConfig

        return KTOConfig(
            **common,
            loss_type=q.kto_loss_type,
            desirable_weight=q.desirable_weight,
            undesirable_weight=q.undesirable_weight,
        )
    from trl.experimental.orpo import ORPOConfig

    return ORPOConfig(**common)


class PreferenceTokenCounts:
    """``loss_tokens_seen`` for TRL's trainers (JobTrainer's counterpart, core/train/
    trainer.py), and the input tokens ORPO's batches hide from the Trainer; both over all
    ranks, every training micro-batch.

    The loss tokens are the completion tokens whose log-probabilities the preference loss is
    made of: DPO and KTO batches mark them in ``completion_mask``, ORPO's carry them as
    ``chosen_labels``/``rejected_labels`` (-100 elsewhere); the first position never has a
    log-probability (shifted, as TRL computes them). ORPO's batches hold
    ``chosen_``/``rejected_input_ids`` and no ``input_ids``: the Trainer counted no input
    tokens (no tokens/s, no tokens in the usage), so their attention masks are counted here."""

    loss_tokens_seen = 0

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        trainer: Any = self
        if "input_ids" in inputs:
            super()._track_num_input_tokens(inputs)  # type: ignore[misc]
        elif trainer.args.include_num_input_tokens_seen != "no":
            masks = [inputs[k] for k in ("chosen_attention_mask", "rejected_attention_mask")
                     if k in inputs]
            trainer.state.num_input_tokens_seen += self._gathered(sum(m.sum() for m in masks))
        if "completion_mask" in inputs:
            loss_tokens = inputs["completion_mask"][..., 1:].sum()
        else:
            loss_tokens = sum(inputs[k][..., 1:].ne(-100).sum()
                              for k in ("chosen_labels", "rejected_labels") if k in inputs)
        self.loss_tokens_seen += self._gathered(loss_tokens)

    def _gathered(self, local: Any) -> int:
        trainer: Any = self
        count = torch.as_tensor(local, device=trainer.args.device, dtype=torch.int64)
        return int(trainer.accelerator.gather(count).sum().item())


def _trainer_class(objective: str) -> type:
    if objective == "dpo":
        from trl import DPOTrainer

        base: type = DPOTrainer
    elif objective == "kto":
        from trl import KTOTrainer

        base = KTOTrainer
    else:
        from trl.experimental.orpo import ORPOTrainer

        base = ORPOTrainer
    return type(
        f"Job{base.__name__}", (CheckpointMixin, NonFiniteFlag, PreferenceTokenCounts, base), {}
    )


def preference_trainer(
    spec: JobSpec,
    model: Any,
    args: Any,
    data: Datasets,
    tokenizer: Any,
    callbacks: list[Any],
) -> Any:
    """The TRL trainer for spec.training.objective over a PEFT model.

    DPO and KTO: the reference is this model with its adapter disabled. TRL 1.16, handed a
    PeftModel without a ref_model, copies the adapter into a second one named "ref" (meant
    for re-training an existing adapter); ours is new, so that copy equals the disabled
    adapter. It is removed: TRL then disables the adapter for the reference pass, and the
    model holds (and saves, and checkpoints) exactly one adapter.
    """
    from datasets import Dataset

    cls = _trainer_class(spec.training.objective)
    trainer = cls(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(data.train.examples),
        eval_dataset=Dataset.from_list(data.eval.examples) if data.eval else None,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    peft_model = trainer.model
    if "ref" in getattr(peft_model, "peft_config", {}):
        peft_model.delete_adapter("ref")
        peft_model.set_adapter("default")
    if spec.model.quantization is not None:
        # TRL casts the trainable adapter weights of a quantized model to bfloat16. ftune
        # trains every adapter in float32, on a 4-bit base too (a low learning rate's small
        # updates would be rounded away in bfloat16), and the QLoRA docs and adapter checks
        # say so: cast them back before the optimizer is built (in train()).
        for param in peft_model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    count_tokens(trainer.train_dataset, data.train.stats)
    if data.eval is not None:
        count_tokens(trainer.eval_dataset, data.eval.stats)
    if data.train.stats.examples == 0:
        raise invalid_dataset(
            f"no training row is left: TRL drops a row whose prompt alone fills "
            f"dataset.max_seq_length {spec.dataset.max_seq_length}; raise it or shorten "
            "the prompts"
        )
    return trainer

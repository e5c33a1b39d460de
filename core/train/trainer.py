"""transformers.Trainer with small additions: a per-step NaN flag, class weights, packed
batches turned into model inputs, and generation-based evaluation; and the supervised
objective's Trainer built from a job (``sft_trainer``; grpo's and the preference
objectives' are in core/train/grpo.py and core/train/preference.py)."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Trainer

from core.data.collator import PadCollator
from core.data.datasets import Datasets
from core.data.packing import Layout, model_inputs
from core.model.lm_head import plain_reason
from core.train.checkpoint import CheckpointMixin
from core.train.evaluation import GenerationEval, classification_metrics
from core.train.job import Job
from core.train.loss import add_sft_lm_head


class NonFiniteFlag:
    """Trainer mixin: ``take_nonfinite()`` says whether any micro-batch loss since the last
    call was NaN/inf. The flag stays a device tensor (no host sync inside the step); the
    callback reads it once per optimizer step, together with the stop flag, in one
    all-reduce. Also mixed into TRL's preference trainers (core/train/preference.py)."""

    _nonfinite: torch.Tensor | None = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        flag = (~torch.isfinite(loss)).any()
        self._nonfinite = flag if self._nonfinite is None else self._nonfinite | flag
        return loss

    def take_nonfinite(self) -> float:
        if self._nonfinite is None:
            return 0.0
        value = float(self._nonfinite.item())
        self._nonfinite = None
        return value


class JobTrainer(CheckpointMixin, NonFiniteFlag, Trainer):
    """The stock Trainer, plus:

    * intermediate checkpoints that load on any world size (CheckpointMixin,
      core/train/checkpoint.py).

    * ``take_nonfinite()`` (NonFiniteFlag).
    * ``class_weights``: seq_cls loss weighted per class (see ``weighted_ce``).
    * ``packing_layout``: packed batches (they carry position_ids) get their per-example
      attention here, on the device and in the model's dtype (core/data/packing.py). The
      Trainer counts input tokens from the collated batch *before* this, where the 2-D mask
      marks real tokens, so tokens_seen and tokens/s count no padding.
    * ``loss_tokens_seen``: label tokens that carry a loss (not -100), over all ranks, in this
      session (an attempt): the count the Trainer normalises the loss by. Causal LMs predict
      token t+1 from token t, so their first label position never has a loss (as the
      Trainer's own num_items_in_batch counts).
    * ``fused_lm_head``: the causal-LM loss from the labelled positions only, the LM head
      applied in bounded tiles (core/train/loss.py); same loss, normalisation and gradient
      accumulation as the plain path, which every other case keeps.
    * ``generation_eval``: after each evaluation, greedy generation over the eval set scored
      against its label set (core/train/evaluation.py); the metrics join the eval metrics
      (``eval_gen_*``) and the samples are kept in ``last_eval_samples``.
    """

    def __init__(
        self,
        *args: Any,
        packing_layout: Layout | None = None,
        generation_eval: Any = None,
        fused_lm_head: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.packing_layout = packing_layout
        self.fused_lm_head = fused_lm_head
        self.generation_eval = generation_eval
        self.last_eval_samples: list[dict[str, Any]] | None = None
        self._mask_dtype: torch.dtype | None = None
        self.loss_tokens_seen = 0

    def _track_num_input_tokens(self, inputs: dict[str, Any]) -> None:
        # Called on every rank for every training micro-batch, before the forward pass.
        super()._track_num_input_tokens(inputs)
        labels = inputs.get("shift_labels")
        if labels is None:
            labels = inputs.get("labels")
            if labels is not None and self._loss_shifts_labels:
                labels = labels[..., 1:]
        if labels is None:
            return
        local = torch.as_tensor(labels.ne(-100).sum(), device=self.args.device, dtype=torch.int64)
        self.loss_tokens_seen += int(self.accelerator.gather(local).sum().item())

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = super()._prepare_inputs(inputs)
        if self.packing_layout is not None and "position_ids" in inputs:
            inputs = model_inputs(inputs, self.packing_layout, self._attention_dtype())
        return inputs

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        # The stock compute_loss does the rest: it passes num_items_in_batch to the model
        # and scales for averaging over ranks, exactly as on the plain path.
        if self.fused_lm_head and "labels" in inputs:
            inputs = {**inputs, "fused_lm_head": True}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _attention_dtype(self) -> torch.dtype:
        # The additive mask must be in the dtype the attention scores are computed in: that of
        # the base weights (under autocast the kernels cast it along with the scores).
        if self._mask_dtype is None:
            model: Any = self.model
            weight = model.get_input_embeddings().weight
            self._mask_dtype = weight.dtype if weight.is_floating_point() else torch.float32
        return self._mask_dtype

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        output = super().evaluation_loop(
            dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
        )
        if self.generation_eval is not None and metric_key_prefix == "eval":
            # Every rank generates the same (bounded) set with the same weights: no rank
            # waits on another, and each reports the same numbers. (Not used under sharding,
            # where no rank holds the whole model.)
            model = self.accelerator.unwrap_model(self.model)
            batch = self.args.per_device_eval_batch_size
            metrics, samples = self.generation_eval.run(model, batch, self.args.device)
            assert output.metrics is not None
            output.metrics.update({f"{metric_key_prefix}_gen_{k}": v for k, v in metrics.items()})
            self.last_eval_samples = samples
        return output


def weighted_ce(weights: torch.Tensor) -> Any:
    """A Trainer ``compute_loss_func`` for class-weighted cross-entropy.

    With gradient accumulation the Trainer passes ``num_items_in_batch``: the number of
    labelled examples in the whole accumulated batch (summed over ranks). Summing the
    per-example losses and dividing by that count makes the accumulated gradient equal to
    the gradient of one big batch, whatever the micro-batch sizes.
    """

    def loss_fn(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        # Cross-entropy in fp32: log-softmax of half-precision logits loses the small
        # probabilities that carry most of the gradient.
        w = weights.to(device=logits.device, dtype=torch.float32)
        per_example = torch.nn.functional.cross_entropy(
            logits.float(), labels, weight=w, reduction="none"
        )
        if num_items_in_batch is None:
            return per_example.mean()
        return per_example.sum() / num_items_in_batch

    return loss_fn


def sft_trainer(job: Job, model: Any, args: Any, data: Datasets, tokenizer: Any,
                callbacks: list[Any], layout: Layout | None
                ) -> tuple[JobTrainer, str, GenerationEval | None]:
    """The supervised objective's Trainer over ``data`` (packed in ``layout``, if any), the
    LM head path its loss takes ("fused", or "plain (why)"), and its generation eval."""
    spec, rt = job.spec, job.runtime
    # Classification by generation (small label sets), only where every rank holds the
    # whole model: under FSDP/ZeRO-3 generate() would need every rank in lockstep.
    generation_eval = None
    sharded = spec.distributed.strategy not in ("none", "ddp")
    if data.eval is not None and not sharded:
        generation_eval = GenerationEval.build(
            spec.model.task,
            data.receipt.format if data.receipt else spec.dataset.format,
            data.eval.examples,
            tokenizer,
        )
    compute_loss_func = None
    if spec.model.task == "seq_cls" and spec.training.class_weights:
        assert data.labels is not None
        w = torch.tensor([spec.training.class_weights.get(n, 1.0) for n in data.labels])
        compute_loss_func = weighted_ce(w)
    reason = plain_reason(
        spec, model, data.receipt.format if data.receipt else None, rt.lm_head
    )
    lm_head = "fused" if reason is None else f"plain ({reason})"
    if reason is None:
        add_sft_lm_head(model)
    trainer = JobTrainer(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        data_collator=PadCollator(
            tokenizer.pad_token_id,
            # Tensor cores want dimensions in multiples of 8.
            pad_to_multiple_of=8 if rt.device == "cuda" else None,
            layout=layout or "mask",
        ),
        compute_metrics=classification_metrics if spec.model.task == "seq_cls" else None,
        compute_loss_func=compute_loss_func,
        callbacks=callbacks,
        packing_layout=layout,
        generation_eval=generation_eval,
        fused_lm_head=reason is None,
    )
    return trainer, lm_head, generation_eval

"""The fine-tuning recipe: setup -> train -> save -> verify.

Read top to bottom, this is the whole run. It is launched once per process: by
``accelerate launch`` (one process per rank, the distributed setup comes from the YAML
through environment variables) or by plain ``python -m core.train`` (one process).

Only the recipe's steps are here; what they use is apart: the Trainer's arguments and the
strategy check (arguments.py), the supervised Trainer (trainer.py ``sft_trainer``), the
started event (started.py), the sharding proof as training begins (sharding.py), the
universal checkpoint of a DeepSpeed resume (deepspeed_checkpoint.py), the model card
(model_card.py). Modules of one objective or method (grpo, preference, full_model, merge)
are imported where that run needs them.

Numerics in one paragraph: the base model stays frozen in the dtype it was loaded in; only
the PEFT parameters train (peft keeps them in fp32 even on a half-precision base, so the
small updates of a low learning rate are not rounded away). With fp16, the loss is scaled
before backward and the gradients unscaled before clipping (a GradScaler, managed by
accelerate); bf16 has fp32's exponent range and needs no scaling. Gradients are averaged
over ranks by DDP/FSDP/ZeRO, and over accumulation micro-steps by dividing each micro-step's
summed token loss by the token count of the *whole* accumulated batch, so a long example
weighs the same whether or not it shares a micro-batch with short ones.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from core.data.datasets import build_datasets
from core.data.packing import layout_for
from core.data.tokenizer import load_tokenizer
from core.policy import runs_cpu_fsdp2
from core.run.jobdir import checkpoint_step
from core.train import dist
from core.train.adapter import AdapterReference, save_final_adapter
from core.train.arguments import check_strategy, training_arguments
from core.train.callbacks import JobCallback, LogLines, agree
from core.train.checkpoint import load_adapter_weights, plan_resume
from core.train.deepspeed_checkpoint import load_universal, universal_resume
from core.train.events import EventLog, MemoryPhase, measure_calls
from core.train.failures import Where, nan_loss
from core.train.job import Job, load_job, preflight
from core.train.loss import compact_lm_head
from core.train.model import load_model, parameter_count, quantization_in_effect, wrap_with_peft
from core.train.model_card import run_model_card
from core.train.phases import PREPARING_DATA, PREPARING_RUN, Phases, reporting_weight_loads
from core.train.probe import probe_dir
from core.train.sharding import (
    check_sharding,
    enable_cpu_fsdp2,
    local_param_bytes,
    optimizer_state_bytes,
    prepared_sharding,
    size_buckets_to_model,
    zero_buckets,
)
from core.train.started import started_fields
from core.train.stop import STOP_REASONS, StopRequest
from core.train.tracking import open_tracking
from core.train.trainer import sft_trainer

log = logging.getLogger("core.train")


class Recipe:
    """One run over one job directory. ``run`` is the whole story; each stage is a method."""

    def __init__(self, job_root: Path, stop: StopRequest) -> None:
        self.job_root = job_root
        self.stop = stop
        self.where = Where("setup")
        self.t_start = time.time()
        # Filled by setup():
        self.trainer: Any = None
        self.callback: JobCallback | None = None
        self.data: Any = None
        self.ref: Any = None
        self.info: dict[str, Any] = {}
        self.weights_read_bytes = 0
        self.params: tuple[int, int] = (0, 0)  # (trainable, total) of the PEFT model
        self.tracking: Any = None  # core.train.tracking.Tracking, once setup opened it
        self.lm_head = "plain"  # the loss's LM head path, set by build_trainer

    def current_where(self) -> Where:
        """What was running, for the error message of a raw exception."""
        if self.trainer is not None and self.where.phase == "train":
            self.where.step = int(self.trainer.state.global_step)
        return self.where

    def run(self) -> int:
        import torch

        job = load_job(self.job_root)
        events = EventLog(job.dir.events)
        self.stop.deadline = job.runtime.deadline
        cuda = torch.cuda.is_available()
        preflight(job, cuda, bf16_ok=cuda and torch.cuda.is_bf16_supported())
        job.dir.checkpoints.mkdir(parents=True, exist_ok=True)

        self.where = Where("load")
        with MemoryPhase(events, "load") as load_phase:
            self.setup(job, events)
            # Base weights this rank read: all of them, or none on the ranks that start
            # without (FSDP2 cpu_ram_efficient_loading: rank 0 broadcasts at prepare).
            load_phase.fields["weights_read_mb"] = round(self.weights_read_bytes / 2**20, 3)

        self.where = Where("train")
        with MemoryPhase(events, "train") as train_phase:
            result = self.train(job, events)
            # Optimizer state this rank holds (sharded under FSDP and ZeRO), for benchmarks.
            train_phase.fields["optimizer_mb"] = round(
                optimizer_state_bytes(self.trainer.optimizer) / 2**20, 3
            )
            if self.trainer.is_deepspeed_enabled:  # the buckets the engine really used
                train_phase.fields.update(zero_buckets(self.trainer.model_wrapped))
        if result is None:  # stopped gracefully: checkpoint saved, no final adapter
            self.close_tracking("KILLED")
            return 0

        self.where = Where("save", int(self.trainer.state.global_step))
        with MemoryPhase(events, "save"):
            files = self.save(job, result)
        artifact = job.dir.artifact(job.spec.peft.method)
        events.emit("saved", path=artifact.name, files=files)
        if job.spec.training.export_merged:
            self.where = Where("merge")
            merged = self.export_merged(job, events)
            if merged is not None:
                events.emit("saved", path="merged", files=merged)
        self.finish(events, result)
        if self.tracking is not None:
            # A whole model is not copied into the trackers (gigabytes to an MLflow server
            # for each job): GET /v1/jobs/{id}/model serves it; an adapter is logged.
            full = job.spec.peft.method == "full"
            self.tracking.finish(None if full else artifact, "FINISHED")
        return 0

    def close_tracking(self, status: str) -> None:
        """End the tracker runs without an adapter (stopped, or failed)."""
        if self.tracking is not None:
            self.tracking.finish(None, status)

    # ---------------------------------------------------------------------------- setup

    def setup(self, job: Job, events: EventLog) -> None:
        """The recipe's steps: training arguments (they start the process group), tokenizer,
        data, model + PEFT, callbacks, the Trainer; then check that the run is distributed
        the way the spec asked, and say what runs (the "started" event)."""

        spec, rt = job.spec, job.runtime
        has_eval = rt.eval_path is not None or spec.dataset.eval_split > 0
        if runs_cpu_fsdp2(spec, rt.device):  # preflight checked the operator allows it
            enable_cpu_fsdp2()
        t = spec.training
        # A checkpoint from another world size: keep its global batch, so its steps (and the
        # data position) carry over 1:1; refused here when they cannot.
        resume = (
            plan_resume(
                rt.resume_from_checkpoint,
                spec.distributed.strategy,
                dist.world_size(),
                t.per_device_train_batch_size,
                t.gradient_accumulation_steps,
            )
            if rt.resume_from_checkpoint
            else None
        )
        # Before the process group exists (core/train/deepspeed_checkpoint.py).
        universal = universal_resume(spec.distributed, resume)
        args = training_arguments(job, has_eval, resume)  # first: initialises the process group

        # What the run does before its first step, said as it happens (core/train/phases.py).
        phases = Phases(events, rt.attempt)
        phases.enter(PREPARING_DATA, "preparing data: reading and tokenizing the rows")
        tokenizer = load_tokenizer(spec, rt.model_path)
        data = self.load_data(job, tokenizer)
        with reporting_weight_loads(phases, rt.model_path):
            model, quantization = self.load_model(job, tokenizer, data)
        callback = self.job_callback(job, events)
        trainer, layout, generation_eval = self.build_trainer(
            job, model, args, data, tokenizer, callbacks=[callback]
        )
        callback.bind(trainer)
        from transformers import PrinterCallback

        # trainer.log holds JSON lines: the values the Trainer logs go there as such.
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(LogLines())

        # Rank 0: TensorBoard / MLflow / W&B runs, fed from the Trainer's logs.
        self.tracking = open_tracking(job, events, trainer)
        # The accelerator exists now: fail before any step if the strategy is not the one asked.
        strategy, world, dtype = check_strategy(trainer, job)
        trainer.strategy_name = strategy  # recorded in each checkpoint's manifest
        if spec.peft.method == "full":
            # Each checkpoint holds the model too, in the final model's dtype.
            from core.train.full_model import checkpoint_card
            from core.train.merge import output_dtype

            trainer.full_model_dtype = output_dtype(spec.model.dtype, trainer.model.config)
            trainer.full_model_card = lambda step: checkpoint_card(
                spec.model.name_or_path, spec.model.task, step, rt.job_id
            )
        if trainer.is_deepspeed_enabled:

            size_buckets_to_model(trainer)  # read when train() builds the engine
        if universal is not None:
            load_universal(trainer)  # the engine, built in train(), reads the universal copy
        # ZeRO stage / offload / FSDP state dict type in effect, checked against the spec.
        sharding = check_sharding(trainer, spec)
        # Evaluation runs inside trainer.train(); its memory is reported as phase "eval".
        measure_calls(trainer, "evaluate", events, "eval")

        if (probe := probe_dir()) is not None:  # benchmarks only: bench/sharding.py
            from core.train.probe import install

            install(self, trainer, probe)

        trainable, total = self.params
        self.info = started_fields(
            job, model, args, data, world=world, distributed_type=dtype, strategy=strategy,
            sharding=sharding, quantization=quantization, params=self.params,
            lm_head=self.lm_head, packing=layout, generation_eval=generation_eval is not None,
            resume=resume, universal_seconds=universal,
        )
        callback.started_fields.update(self.info)  # emitted as "started" on train begin
        if data.train.stats.dropped:
            events.emit(
                "log",
                level="warning",
                message=f"{data.train.stats.dropped} training examples dropped: no token to "
                f"learn from within max_seq_length {spec.dataset.max_seq_length} (rows "
                f"{', '.join(map(str, data.train.stats.dropped_rows))}...)",
            )
        log.info(
            "rank %d/%d: %s, %d train examples, %d trainable of %d params",
            *(dist.rank(), world, strategy, len(data.train), trainable, total),
        )
        self.trainer, self.callback, self.data = trainer, callback, data

    def load_data(self, job: Job, tokenizer: Any) -> Any:
        """Tokenized train (and eval) examples: the SFT layout of the task, the rows a
        preference objective scores, or grpo's prompts with their grader items."""

        spec, rt = job.spec, job.runtime
        if spec.training.objective == "grpo":
            from core.data.grpo import build_grpo_datasets

            return build_grpo_datasets(
                spec, rt.train_path, rt.eval_path, rt.max_decompressed_bytes
            )
        if spec.training.objective != "sft":
            from core.train.preference import build_preference_datasets

            return build_preference_datasets(
                spec, rt.train_path, rt.eval_path, tokenizer, rt.max_decompressed_bytes
            )
        return build_datasets(
            spec, rt.train_path, rt.eval_path, tokenizer, rt.max_decompressed_bytes
        )

    def load_model(self, job: Job, tokenizer: Any, data: Any) -> tuple[Any, dict[str, Any]]:
        """The base model (quantized if asked) wrapped with its PEFT adapter (every weight
        trainable for full fine-tuning), and the quantization in effect."""
        import torch
        from transformers import set_seed

        spec, rt = job.spec, job.runtime
        # Same seed on every rank: the LoRA A matrices (random) start identical everywhere,
        # which DDP also enforces by broadcasting rank 0's parameters.
        set_seed(spec.training.seed)
        f = spec.distributed.fsdp
        # FSDP2 cpu_ram_efficient_loading: only rank 0 reads the weights; the others hold
        # none until accelerate broadcasts each rank its shard at prepare time.
        read_weights = dist.is_main() or not (
            spec.distributed.strategy == "fsdp" and f.version == 2 and f.cpu_ram_efficient_loading
        )
        # Full fine-tuning under mixed precision: the weights the optimizer updates stay in
        # float32 (the master weights; autocast computes in 16 bits), unless model.dtype
        # says otherwise; a 16-bit weight would round small updates away.
        master = (
            spec.peft.method == "full"
            and spec.training.mixed_precision != "no"
            and spec.model.dtype == "auto"
        )
        model = load_model(
            spec, rt.model_path, tokenizer, data.labels, read_weights=read_weights,
            dtype=torch.float32 if master else None,
        )
        self.weights_read_bytes = local_param_bytes(model) if read_weights else 0
        # QLoRA: fail now unless the base really is quantized as asked (a silent fallback
        # would train a different, far larger experiment).
        quantization = quantization_in_effect(model, spec)
        if spec.peft.method == "full":
            # Every weight trains: no adapter, the final artifact is the whole model
            # (core/train/full_model.py verifies it against the trained weights).
            model.requires_grad_(True)
            self.params = (parameter_count(model), parameter_count(model))
            return model, quantization
        model = wrap_with_peft(spec, model, rt.model_path)
        if rt.init_adapter is not None and rt.resume_from_checkpoint is None:
            # model.from_job: another job's adapter is the starting point (a resume restores
            # this job's own checkpoint instead).

            load_adapter_weights(model, rt.init_adapter)
        self.params = model.get_nb_trainable_parameters()
        # Names and shapes of the adapter as built, to verify the final file against.
        self.ref = AdapterReference.capture(model)
        return model, quantization

    def job_callback(self, job: Job, events: EventLog) -> JobCallback:
        """Events, graceful stop, NaN guard and early stopping, with the recipe's hooks."""
        spec = job.spec
        return JobCallback(
            events,
            job.dir.root,
            self.stop,
            started_fields={},  # filled by setup, once the strategy in effect is known
            task=spec.model.task,
            early_stopping_patience=spec.training.early_stopping_patience,
            check_prepared=self.check_prepared,
        )

    def build_trainer(
        self, job: Job, model: Any, args: Any, data: Any, tokenizer: Any, callbacks: list[Any]
    ) -> tuple[Any, str | None, Any]:
        """The Trainer (TRL's for a preference objective) with ``callbacks``; also the
        packing layout and the generation eval it was given."""
        spec, rt = job.spec, job.runtime
        # Packed rows reach the attention kernel per example (core/data/packing.py); how
        # depends on the kernel the model was loaded with.
        layout = (
            layout_for(model.config, spec.dataset.max_seq_length) if spec.dataset.packing else None
        )
        if spec.training.objective == "grpo":
            from core.graders.config import GraderRuntime
            from core.train.grpo import grpo_callback, grpo_trainer

            # TRL's GRPO scores its log-probabilities with the fused head (prompt and
            # padding labelled -100): compacted, only the completion positions.
            self.lm_head = compact_lm_head("grpo", plain=rt.lm_head == "plain")
            trainer, reward = grpo_trainer(
                spec, model, args, data, tokenizer, callbacks,
                GraderRuntime.model_validate(rt.graders or {}),
            )
            job_callback = next(c for c in callbacks if isinstance(c, JobCallback))
            # Its eval_loss is a policy loss, not a cross-entropy: no perplexity.
            job_callback.perplexity = False
            trainer.add_callback(grpo_callback(job_callback.events, reward))
            return trainer, layout, None
        if spec.training.objective != "sft":
            from core.train.preference import preference_trainer

            self.lm_head = compact_lm_head(spec.training.objective, plain=rt.lm_head == "plain")
            trainer = preference_trainer(spec, model, args, data, tokenizer, callbacks)
            return trainer, layout, None
        trainer, self.lm_head, generation_eval = sft_trainer(
            job, model, args, data, tokenizer, callbacks, layout
        )
        return trainer, layout, generation_eval

    def check_prepared(self, model: Any) -> dict[str, Any]:
        """On every rank as training begins: the sharding proof and per-rank parameter bytes
        (core/train/sharding.py ``prepared_sharding``)."""
        return prepared_sharding(model, self.info, self.trainer.optimizer)

    # ---------------------------------------------------------------------------- train

    def train(self, job: Job, events: EventLog) -> Any | None:
        """Train (or resume); None when a graceful stop ended the run."""
        rt = job.runtime
        # A stop asked for while the model was loading: honour it before the first step
        # (all ranks agree, as at every step end). The last checkpoint stays as it was.
        code, _ = agree(self.stop, 0.0, self.trainer.args.device)
        if code:
            self.stop.reason = STOP_REASONS[code]
            path = rt.resume_from_checkpoint
            step = (checkpoint_step(path) if path is not None else None) or 0
            events.emit("stopped", step=step, reason=self.stop.reason, checkpoint=None)
            return None

        resume = str(rt.resume_from_checkpoint) if rt.resume_from_checkpoint else None

        strategy = job.spec.distributed.strategy
        Phases(events, rt.attempt).enter(
            PREPARING_RUN,
            "preparing the run: "
            + ("building DeepSpeed's ops (a first run compiles them) and sharding the model"
               if strategy == "deepspeed" else
               f"wrapping the model for {strategy}" if strategy != "none" else
               "optimizer and data loader")
            + (f", resuming from {Path(resume).name}" if resume else ""),
        )
        result = self.trainer.train(resume_from_checkpoint=resume)
        step = int(self.trainer.state.global_step)
        if self.stop.reason:
            # The callback set should_save at the stop step, so its checkpoint is on disk. No
            # final adapter: the worker decides whether the job was cancelled or timed out,
            # and a later attempt resumes from this checkpoint.
            assert self.callback is not None
            events.emit(
                "stopped",
                step=step,
                reason=self.stop.reason,
                checkpoint=f"{job.dir.checkpoints.name}/checkpoint-{step}",
                **self.callback.usage(self.trainer.state),
            )
            return None
        if not math.isfinite(result.training_loss):
            raise nan_loss(step, result.training_loss)
        return result

    # ---------------------------------------------------------------------------- save

    def save(self, job: Job, result: Any) -> list[str]:
        """Consolidated adapter -> adapter.tmp, verified, renamed to adapter (all ranks);
        for full fine-tuning the whole model -> model.tmp -> model, the same way."""

        sharded = self.info["strategy"] in ("fsdp", "deepspeed")
        assert self.callback is not None
        card = run_model_card(job, result, state=self.trainer.state, info=self.info,
                              data=self.data, callback=self.callback)
        if job.spec.peft.method == "full":
            from core.train.full_model import save_final_model
            from core.train.merge import output_dtype

            dtype = output_dtype(job.spec.model.dtype, self.trainer.model.config)
            return save_final_model(self.trainer, job.dir.root, dtype, card)
        return save_final_adapter(
            self.trainer, job.dir.root, self.ref, self.data.labels, card, sharded
        )

    def export_merged(self, job: Job, events: EventLog) -> list[str] | None:
        """Base + adapter merged -> merged/ (rank 0; other ranks return None at once).

        A separate step from the (possibly sharded) training state: in this process when no
        rank shards the model, else in a fresh single process (core/train/merge.py). No
        collective: the other ranks are done and may exit while rank 0 merges (a memory
        phase, which gathers from every rank, is measured only when there is one rank).
        """

        from core.train.merge import export_merged, export_merged_subprocess

        if not dist.is_main():
            return None
        alone = dist.world_size() == 1
        with MemoryPhase(events, "merge") if alone else nullcontext():
            if self.info["strategy"] in ("fsdp", "deepspeed"):
                return export_merged_subprocess(job.dir.root)
            return export_merged(job.dir.root)

    def finish(self, events: EventLog, result: Any) -> None:
        assert self.callback is not None
        state = self.trainer.state
        events.emit(
            "finished",
            step=int(state.global_step),
            total_steps=int(state.max_steps),
            train_loss=result.training_loss,
            last_loss=self.callback.last_logs.get("loss"),
            eval_loss=self.callback.last_eval.get("eval_loss"),
            early_stopped=self.callback.early_stopped,
            runtime_seconds=round(float(result.metrics.get("train_runtime", 0.0)), 3),
            wall_seconds=round(time.time() - self.t_start, 3),
            **self.callback.usage(state),
        )

"""What the trainer tells the outside world while it runs, and how it is told to stop.

Everything here runs inside transformers.Trainer's loop through TrainerCallback hooks. Hooks
run on *every* rank; only rank 0 writes events (EventLog is a no-op elsewhere), but every
rank takes part in the one collective per step that makes stop and NaN decisions agree.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from core.run.jobdir import checkpoint_step
from core.train import dist
from core.train.events import EventLog
from core.train.failures import nan_loss
from core.train.stop import STOP_REASONS, StopRequest

log = logging.getLogger("core.train")


def agree(stop: StopRequest, nonfinite: float, device: Any) -> tuple[int, bool]:
    """(stop code, loss non-finite) agreed by all ranks.

    Ranks must stop at the same step: a rank that leaves the loop while the others enter the
    next step's gradient all-reduce hangs them all. One MAX all-reduce of two numbers per
    step (free with one process) makes "any rank wants to stop" a global decision, and does
    the same for a NaN seen on any rank.
    """
    code, bad = dist.all_reduce_max([float(stop.local_code()), nonfinite], device)
    return int(code), bad > 0


def _finite(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and math.isfinite(v)


# TRL's logged metric -> our event field. rewards are beta * (log pi - log ref) of the answer
# (ORPO: beta * log pi); the margin is chosen - rejected; the accuracy the share of pairs
# whose chosen reward is above the rejected one.
METRICS = {
    "rewards/chosen": "reward_chosen",
    "rewards/rejected": "reward_rejected",
    "rewards/margins": "reward_margin",
    "rewards/accuracies": "reward_accuracy",
    "kl": "kl",
    # grpo (core/train/grpo.py): the grader's reward over the sampled answers (mean, and the
    # std over all answers of the batch), the answers' mean length in tokens and the share
    # cut at max_completion_length, the share of groups whose answers all scored the same
    # (no advantage: nothing learned from them).
    "reward": "reward",
    "reward_std": "reward_std",
    "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "completion_clipped_ratio",
    "frac_reward_zero_std": "reward_zero_std_share",
}


def event_metrics(logs: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The preference metrics of a Trainer log entry, under our event field names."""
    return {
        dst: float(logs[prefix + src]) for src, dst in METRICS.items() if prefix + src in logs
    }


class JobCallback(TrainerCallback):
    """started / progress / eval / checkpoint events, NaN guard, graceful stop, early stop."""

    def __init__(
        self,
        events: EventLog,
        job_root: Path,
        stop: StopRequest,
        started_fields: dict[str, Any],
        task: str,
        early_stopping_patience: int | None = None,
        *,
        check_prepared: Callable[[Any], dict[str, Any]] | None = None,
    ) -> None:
        self.events = events
        self.job_root = job_root
        self.stop = stop
        self.started_fields = started_fields
        self.task = task
        self.patience = early_stopping_patience
        self.trainer: Any = None  # bind(): the Trainer is built with this callback in it
        # Called on every rank with the prepared (wrapped, maybe sharded) model when training
        # begins; returns more "started" fields, or raises (e.g. FSDP that does not shard).
        self.check_prepared = check_prepared
        self.last_logs: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.train_metrics: dict[str, Any] = {}
        self._eval_extra: dict[str, float] = {}
        self.early_stopped = False
        # Off where eval_loss is not a token cross-entropy (grpo: a policy loss).
        self.perplexity = True
        self._best_eval: float | None = None
        self._evals_without_gain = 0
        self._t0 = time.time()
        self._tokens0 = 0
        self._step0 = 0

    def bind(self, trainer: Any) -> None:
        """The Trainer this callback reports on (its token and non-finite loss counts, the
        eval samples), known only once the Trainer is built with the callback in it."""
        self.trainer = trainer

    # -- helpers

    def _throughput(self, state: TrainerState) -> dict[str, Any]:
        """Tokens/s over this session: non-padding input tokens of *all* ranks (the Trainer
        gathers the count every micro-step) over wall time since training began."""
        elapsed = max(time.time() - self._t0, 1e-9)
        tokens = state.num_input_tokens_seen - self._tokens0
        done = state.global_step - self._step0
        eta = elapsed / done * (state.max_steps - state.global_step) if done > 0 else None
        return {
            "tokens_seen": state.num_input_tokens_seen,
            **self.usage(state),
            # None where no input tokens were counted (include_num_input_tokens_seen "no").
            "tokens_per_second": round(tokens / elapsed, 2) if tokens > 0 else None,
            "elapsed_seconds": round(elapsed, 2),
            "eta_seconds": round(eta, 1) if eta is not None else None,
        }

    def usage(self, state: TrainerState) -> dict[str, Any]:
        """What this attempt trained so far, over all ranks (core/jobs/usage.py sums attempts):
        non-padding input tokens, and the label tokens that carry a loss. The attempt is
        named: a line may reach the database only after the next attempt has started."""
        return {
            "attempt": self.started_fields.get("attempt"),
            "tokens_trained": int(state.num_input_tokens_seen - self._tokens0),
            "loss_tokens_trained": int(getattr(self.trainer, "loss_tokens_seen", 0)),
        }

    def _progress(self, state: TrainerState, **extra: Any) -> None:
        self.events.emit(
            "progress",
            step=state.global_step,
            total_steps=state.max_steps,
            epoch=round(state.epoch or 0.0, 4),
            **extra,
            **self._throughput(state),
        )

    # -- hooks

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        # The Trainer has computed max_steps and restored a resumed state by now: the total
        # is known before the first step, and the step count continues from a checkpoint.
        self._t0 = time.time()
        self._tokens0 = state.num_input_tokens_seen
        self._step0 = state.global_step
        model = kw.get("model")
        prepared = self.check_prepared(model) if self.check_prepared is not None else {}
        self.events.emit(
            "started",
            total_steps=state.max_steps,
            initial_step=state.global_step,
            num_train_epochs=state.num_train_epochs,
            # As in effect (the Trainer switches it on inside train()), not as asked.
            gradient_checkpointing=bool(getattr(model, "is_activation_checkpointing", False)),
            # Seconds the checkpoint's state took to load (resharded, if the world changed).
            resume_load_seconds=getattr(self.trainer, "resume_seconds", None),
            **self.started_fields,
            **prepared,
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        nonfinite = self.trainer.take_nonfinite() if self.trainer is not None else 0.0
        code, bad = agree(self.stop, nonfinite, args.device)
        if bad:
            raise nan_loss(state.global_step)
        if code and not self.stop.reason:
            self.stop.reason = STOP_REASONS[code]
            log.warning("graceful stop (%s) at step %d", self.stop.reason, state.global_step)
            # Checkpoint this step and leave the loop; log first so the checkpoint's
            # metrics include this step's loss.
            control.should_save = True
            control.should_training_stop = True
        if control.should_training_stop:
            control.should_log = True  # the last step always reports its loss
        if not control.should_log:
            # Between logging steps: a cheap heartbeat (no device sync, no collective).
            self._progress(state)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        logs = logs or {}
        if "loss" in logs:
            # The logged loss is the mean over ranks and steps since the last log (the
            # Trainer all-gathers it), so every rank sees the same value here.
            if not _finite(logs["loss"]):
                raise nan_loss(state.global_step, logs["loss"])
            self.last_logs = {
                k: logs[k] for k in ("loss", "learning_rate", "grad_norm") if k in logs
            }
            # Preference objectives: rewards of chosen/rejected answers, margin, accuracy.
            self.last_logs.update(event_metrics(logs))
            self._progress(state, **self.last_logs)
        elif "train_loss" in logs:
            self.train_metrics = dict(logs)
        elif "eval_loss" in logs:
            # TRL logs its eval metrics here, just before on_evaluate.
            self._eval_extra = event_metrics(logs, prefix="eval_")

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        metrics = metrics or {}
        loss = metrics.get("eval_loss")
        out: dict[str, Any] = {"eval_loss": loss}
        if self.task in ("causal_lm", "seq2seq_lm") and _finite(loss) and self.perplexity:
            # Perplexity = exp(mean token cross-entropy); past ~700 it overflows a double.
            out["perplexity"] = math.exp(loss) if loss < 700 else None
        # seq_cls: from the head's logits; seq2seq / prompt_completion with a small label set:
        # from greedy generation (eval_gen_*), with a few samples to look at.
        for name in ("accuracy", "f1"):
            for key in (f"eval_{name}", f"eval_gen_{name}"):
                if key in metrics:
                    out[name] = metrics[key]
        if "eval_gen_generated" in metrics:
            out["generated"] = int(metrics["eval_gen_generated"])
            samples = getattr(self.trainer, "last_eval_samples", None)
            if samples is not None:
                out["eval_samples"] = samples
        out.update(self._eval_extra)
        self._eval_extra = {}
        out["runtime_seconds"] = metrics.get("eval_runtime")
        self.last_eval = {
            k: v for k, v in out.items() if k in ("eval_loss", "perplexity", "accuracy", "f1")
        }
        self.events.emit("eval", step=state.global_step, epoch=round(state.epoch or 0.0, 4), **out)

        # Early stopping on eval_loss. Every rank sees the same (gathered) eval_loss, so
        # every rank takes the same decision and leaves the loop at the same step.
        if self.patience is not None and _finite(loss):
            if self._best_eval is None or loss < self._best_eval:
                self._best_eval, self._evals_without_gain = loss, 0
            else:
                self._evals_without_gain += 1
                if self._evals_without_gain >= self.patience:
                    self.early_stopped = True
                    control.should_training_stop = True
                    self.events.emit(
                        "log",
                        level="info",
                        message=f"early stopping at step {state.global_step}: eval_loss did "
                        f"not improve for {self.patience} evaluations",
                    )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        output_dir = Path(str(args.output_dir))
        path = output_dir / name
        try:
            rel = str(path.resolve().relative_to(self.job_root.resolve()))
        except ValueError:
            rel = str(path)
        retained = sorted(
            step for p in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
            if (step := checkpoint_step(p)) is not None
        )
        self.events.emit(
            "checkpoint",
            step=state.global_step,
            path=rel,
            metrics={**self.last_logs, **self.last_eval},
            retained_steps=retained,
            # Every file of the checkpoint, every rank (core/train/checkpoint.py).
            save_seconds=getattr(self.trainer, "checkpoint_seconds", None),
            # Of which the downloadable full model (checkpoint-N/model/), when it has one.
            model_save_seconds=getattr(self.trainer, "checkpoint_model_seconds", None),
        )


class LogLines(TrainerCallback):
    """The Trainer's logged values as JSON log lines (with the job id the trainer's logging
    binds), in place of the PrinterCallback's Python dict reprs in trainer.log."""

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if state.is_world_process_zero and logs:
            log.info("step %d: %s", state.global_step,
                     ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in logs.items()),
                     extra={"step": state.global_step})

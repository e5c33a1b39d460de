"""training.objective grpo with TRL's GRPOTrainer, rewards from the job's grader.

What differs from the other objectives, in one paragraph. Each step, the policy samples
``num_generations`` answers per prompt (``per_device_train_batch_size`` counts answers, so a
batch holds batch / num_generations prompts per process); the grader scores each answer in
[0, 1]; an answer's advantage is its reward minus its group's mean reward (divided by the
group's std with scale_rewards group), so only answers that differ in reward teach anything;
the loss is PPO's clipped ratio of new to old log-probabilities times the advantage, over
the answer's tokens, plus beta x KL to the reference (the base with the adapter disabled,
or a frozen copy of the base in full fine-tuning) when beta > 0. A falling loss says nothing
here: the reward curve (mean and spread per grader), the answers' length and the KL are what
to watch, and they reach the events.

Grader failures are never silent zeros: ``JobReward`` counts every exception and every
reward outside [0, 1] per grader (the 0 it scored is said with it) and fails the job
``grader_failed`` once a grader's failed share passes the operator's threshold. A run whose
rewards never differ within a group stops early with ``no_reward_signal``
(core/train/reward_signal.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

from core.data.datasets import Datasets
from core.data.grpo import ITEM_COLUMN, ROW_COLUMN
from core.graders.config import GraderRuntime
from core.graders.run import GraderStats, Grading
from core.graders.service import SOCKET_ENV, RemoteGrading
from core.infra.errors import ErrorCode, TrainFailure, invalid_dataset
from core.spec import JobSpec
from core.spec.graders import Grader
from core.train.checkpoint import CheckpointMixin
from core.train.reward_signal import RewardSignal, RewardSignalCheck
from core.train.trainer import NonFiniteFlag

MAX_SAMPLE_CHARS = 2000


def grader_failed(name: str, stats: GraderStats, max_ratio: float) -> TrainFailure:
    c = stats.by_name[name]
    return TrainFailure(
        ErrorCode.grader_failed,
        f"grader {name!r} failed {c.failed} of {c.calls} calls ({c.errors} errors, "
        f"{c.out_of_range} rewards outside [0, 1]), more than the {max_ratio:.0%} this "
        f"server allows; last at row {c.last_error_row}: {c.last_error}",
    )


class JobReward:
    """TRL's reward function: one reward per (prompt, answer), from the job's grader.

    Also keeps what the events report: the sub-scores' means, a few sampled answers with
    their scores, and the failure counts per grader."""

    def __init__(self, grader: Grader, runtime: GraderRuntime, samples_per_log: int,
                 num_generations: int) -> None:
        # The worker's grading process when it runs one (core/graders/service.py: it holds
        # the judge's key and the sandboxes); in-process otherwise (a run by hand).
        socket_path = os.environ.get(SOCKET_ENV)
        self.grading: Grading | RemoteGrading = (
            RemoteGrading(socket_path) if socket_path else Grading(grader, runtime))
        self.signal = RewardSignal(grader.name, num_generations, runtime.no_signal_steps)
        self.max_ratio = runtime.max_failure_ratio
        self.samples_per_log = samples_per_log
        self.samples: list[dict[str, Any]] = []
        self.sub_sums: dict[str, list[float]] = {}
        # TRL names the reward columns after the function.
        self.__name__ = grader.name

    def close(self) -> None:
        self.grading.close()

    def __call__(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[Any] | None = None,
        **columns: Any,
    ) -> list[float]:
        items = columns[ITEM_COLUMN]
        rows = columns[ROW_COLUMN]
        log_metric = columns.get("log_metric")
        rewards: list[float] = []
        texts = [_text(c) for c in completions]
        # One round trip for the whole batch when the grading process does it.
        scores = self.grading.grade_batch([(t, json.loads(i), int(r))
                                           for t, i, r in zip(texts, items, rows, strict=True)])
        for prompt, text, row, score in zip(prompts, texts, rows, scores, strict=True):
            rewards.append(score.reward)
            self.signal.keep_answer(int(row), text, score.reward, score.errors)
            for name, value in score.sub_scores.items():
                self.sub_sums.setdefault(name, []).append(value)
            if len(self.samples) < self.samples_per_log:
                self.samples.append({
                    "row": int(row),
                    "prompt": _text(prompt)[-MAX_SAMPLE_CHARS:],
                    "completion": text[:MAX_SAMPLE_CHARS],
                    "reward": score.reward,
                    "scores": score.sub_scores,
                    **({"errors": score.errors} if score.errors else {}),
                })
        if log_metric is not None and len(self.grading.stats.by_name) > 1:
            # Each sub-grader's mean, beside TRL's rewards/<grader>/mean of the whole.
            for name, values in self.sub_sums.items():
                if name != self.__name__:
                    log_metric(f"scores/{name}", sum(values) / len(values))
        self.sub_sums.clear()
        over = self.grading.stats.over_threshold(self.max_ratio)
        if over is not None:
            raise grader_failed(over[0], self.grading.stats, self.max_ratio)
        return rewards

    def take_samples(self) -> list[dict[str, Any]]:
        out, self.samples = self.samples, []
        return out


def _text(v: Any) -> str:
    """An answer or prompt as text: TRL gives conversational ones as message lists."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "\n".join(str(m.get("content", "")) for m in v if isinstance(m, dict))
    return str(v)


# ---------------------------------------------------------------------------- trainer


def grpo_config(spec: JobSpec, values: dict[str, Any]) -> Any:
    """TrainingArguments values -> TRL's GRPOConfig; every TRL default that differs from
    TrainingArguments' is passed explicitly from the spec."""
    from trl import GRPOConfig

    g = spec.training.grpo
    assert g is not None
    common = {
        **values,
        # TRL's name for the same switch, which it defaults to True.
        "gradient_checkpointing": bool(values["activation_checkpointing"]),
        "gradient_checkpointing_kwargs": values["activation_checkpointing_kwargs"],
        "bf16": bool(values["bf16"]),  # TRL defaults it on
        # Our extra columns (the item, the row number) must reach the reward function.
        "remove_unused_columns": False,
    }
    common.pop("label_names", None)
    return GRPOConfig(
        **common,
        num_generations=g.num_generations,
        max_completion_length=g.max_completion_length,
        temperature=g.temperature,
        top_p=g.top_p,
        beta=g.beta,
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        num_iterations=g.num_iterations,
        scale_rewards=g.scale_rewards,
        disable_dropout=True,
        log_completions=False,  # the samples go to events.jsonl, not to stdout tables
        shuffle_dataset=True,
    )


class GrpoTokenCounts:
    """``loss_tokens_seen`` for GRPO: the answer tokens the policy loss is made of
    (completion_mask), over all ranks, every micro-batch."""

    loss_tokens_seen = 0

    def _prepare_inputs(self, inputs: Any) -> Any:
        out = super()._prepare_inputs(inputs)  # type: ignore[misc]
        trainer: Any = self
        if trainer.model.training and isinstance(out, dict) and "completion_mask" in out:
            import torch

            local = torch.as_tensor(out["completion_mask"].sum(), dtype=torch.int64,
                                    device=trainer.args.device)
            self.loss_tokens_seen += int(trainer.accelerator.gather(local).sum().item())
        return out


def grpo_trainer(
    spec: JobSpec,
    model: Any,
    args: Any,
    data: Datasets,
    tokenizer: Any,
    callbacks: list[Any],
    runtime: GraderRuntime,
) -> tuple[Any, JobReward]:
    """TRL's GRPOTrainer over a PEFT model or (peft method full) the whole model, with the
    job's grader as its reward. In full, TRL loads the reference for beta > 0 from the
    policy's config._name_or_path: the job's local copy of the base."""
    from datasets import Dataset
    from trl import GRPOTrainer

    g = spec.training.grpo
    assert g is not None
    reward = JobReward(g.grader, runtime, g.samples_per_log, g.num_generations)
    # Checkpoints in ftune's own format (core/train/checkpoint.py), as the other objectives.
    cls = type("JobGRPOTrainer", (CheckpointMixin, NonFiniteFlag, GrpoTokenCounts,
                                  RewardSignalCheck, GRPOTrainer), {})
    trainer = cls(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=Dataset.from_list(data.train.examples),
        eval_dataset=Dataset.from_list(data.eval.examples) if data.eval else None,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    if data.train.stats.examples == 0:
        raise invalid_dataset("no training prompt")
    return trainer, reward


def grpo_callback(events: Any, reward: JobReward) -> Any:
    """A TrainerCallback that reports, at every logging step, a few sampled answers with
    their scores and each grader's calls and failures ("grader" events), watches the reward
    signal over the run's steps, and closes the grader's sandboxes when training ends."""
    from transformers import TrainerCallback

    class GrpoEvents(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kw: Any) -> None:
            logs = logs or {}
            if "reward" not in logs and "eval_reward" not in logs:
                return
            prefix = "eval_" if "eval_reward" in logs else ""
            # Each grader's (and sub-grader's) mean score over the logged steps.
            means = {
                key[len(prefix):]: value for key, value in logs.items()
                if key.startswith((f"{prefix}rewards/", f"{prefix}scores/"))
            }
            events.emit(
                "grader",
                step=state.global_step,
                phase="eval" if prefix else "train",
                scores=means,
                samples=reward.take_samples(),
                graders=reward.grading.stats.as_dict(),
            )

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            reward.signal.begin(state.max_steps)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            try:
                if state.global_step >= state.max_steps:  # not a stop asked for
                    reward.signal.finish(state.global_step)
            finally:
                reward.close()

    return GrpoEvents()

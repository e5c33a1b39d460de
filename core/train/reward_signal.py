"""Whether a GRPO run has anything to learn from, decided early.

GRPO's advantage is an answer's reward minus the mean reward of its group (the answers to the
same prompt). When every answer of every group earns the same reward (a grader that never
matches, a model that answers nothing, a reference no answer can reach), every advantage is 0:
the policy gradient is exactly zero and the run trains nothing, only the KL term, if any,
moves the weights. Left alone such a run spends its whole GPU budget and then fails the adapter
check ("lora_B tensors are all zero"), which names the wrong cause.

So the rewards are watched from the first step: once any group shows a spread, the run has a
signal and is left alone for good (a run that learns little but something succeeds; a run
whose answers all become right later has learned). If none has for the operator's number of
steps (``GraderRuntime.no_signal_steps``; default 10% of the run, at least 3), the run stops
with ``no_reward_signal``, naming the grader, the rewards seen and a few answers with their
scores, so the user can try the grader on them (/v1/graders/run, ``ftune grade``).

Every rank sees the same gathered rewards, so every rank decides alike (no rank waits in a
collective for one that stopped).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from core.infra.errors import ErrorCode, TrainFailure

SPREAD = 1e-6  # rewards closer than this are the same reward
MIN_STEPS = 3
SHOWN_ANSWERS = 3
SHOWN_CHARS = 200


def signal_window(no_signal_steps: int | None, max_steps: int) -> int:
    """Steps a run may go without any reward spread (0: no limit)."""
    if no_signal_steps is not None:
        return no_signal_steps
    return max(MIN_STEPS, math.ceil(0.1 * max_steps))


@dataclass
class RewardSignal:
    grader: str
    num_generations: int
    no_signal_steps: int | None = None  # the operator's (GraderRuntime.no_signal_steps)
    window: int = 0  # set by ``begin``; 0: never stop
    seen: bool = False
    first_step: int | None = None
    rewards_seen: set[float] = field(default_factory=set)
    answers: list[dict[str, Any]] = field(default_factory=list)  # a few, with their scores

    def begin(self, max_steps: int) -> None:
        self.window = signal_window(self.no_signal_steps, max_steps)

    def keep_answer(self, row: int, completion: str, reward: float,
                    errors: dict[str, str]) -> None:
        if not self.seen and len(self.answers) < SHOWN_ANSWERS:
            self.answers.append({"row": row, "answer": completion[:SHOWN_CHARS],
                                 "reward": reward, **({"errors": errors} if errors else {})})

    def observe(self, step: int, rewards: list[float]) -> None:
        """The rewards of one generation batch (all ranks', in group order), generated at
        ``step`` (optimizer steps done). Raises no_reward_signal once the window is over
        without a spread."""
        if self.first_step is None:
            # A run resumed past the window had its signal before it was stopped.
            self.first_step = step
        if self.seen or self.window <= 0 or self.first_step >= self.window:
            return
        n = self.num_generations
        groups = [rewards[i:i + n] for i in range(0, len(rewards) - n + 1, n)]
        finite = [[r for r in g if math.isfinite(r)] for g in groups]
        if any(g and max(g) - min(g) > SPREAD for g in finite):
            self.seen = True
            self.answers.clear()
            return
        self.rewards_seen.update(round(r, 4) for g in finite for r in g)
        if step >= self.window:
            raise self.failure(step)

    def finish(self, step: int) -> None:
        """Training ended: a run that never had a signal inside its window trained nothing."""
        if (not self.seen and self.window > 0 and self.first_step is not None
                and self.first_step < self.window):
            raise self.failure(step)

    def failure(self, step: int) -> TrainFailure:
        seen = sorted(self.rewards_seen)
        said = (f"every answer earned {seen[0]:g}" if len(seen) == 1 else
                "every answer to a prompt earned the same reward (rewards seen: "
                + ", ".join(f"{r:g}" for r in seen[:8]) + (", ..." if len(seen) > 8 else "")
                + ")")
        answers = "; ".join(json.dumps(a, ensure_ascii=False) for a in self.answers)
        return TrainFailure(
            ErrorCode.no_reward_signal,
            f"no reward signal: in the first {step} steps, grader {self.grader!r} gave the "
            f"{self.num_generations} answers to each prompt the same reward ({said}), so "
            "every advantage was 0 and GRPO had nothing to learn from; stopped early. Try "
            "the grader on these answers with /v1/graders/run (or `ftune grade`) and fix it, "
            "or make answers differ (training.grpo.temperature, num_generations, "
            f"max_completion_length). Answers: {answers}",
        )


class RewardSignalCheck:
    """Mixed into the GRPOTrainer: hands each training generation batch's rewards (gathered
    over the ranks by TRL) to the reward function's ``signal``."""

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any,
                           completion_ids_list: Any) -> Any:
        out = super()._calculate_rewards(  # type: ignore[misc]
            inputs, prompts, completions, completion_ids_list)
        trainer: Any = self
        if trainer.model.training:
            signal: RewardSignal = trainer.reward_funcs[0].signal
            signal.observe(trainer.state.global_step, out[:, 0].tolist())
        return out

"""When a GRPO run has no reward signal: the decision on given rewards (the run itself is in
test_grpo_runs.py)."""

from __future__ import annotations

import pytest

from core.infra.errors import ErrorCode, TrainFailure
from core.train.reward_signal import RewardSignal, signal_window


def test_the_window_is_a_tenth_of_the_run_and_at_least_three_steps() -> None:
    assert signal_window(None, 10) == 3
    assert signal_window(None, 200) == 20
    assert signal_window(5, 200) == 5
    assert signal_window(0, 200) == 0


def signal(window: int = 3) -> RewardSignal:
    s = RewardSignal("exact", num_generations=2)
    s.window = window
    return s


def test_no_spread_in_any_group_for_the_window_stops_naming_grader_rewards_and_answers() -> None:
    s = signal()
    s.keep_answer(4, "a cat", 0.0, {})
    for step in range(3):
        s.observe(step, [0.0, 0.0, 1.0, 1.0])
    with pytest.raises(TrainFailure) as e:
        s.observe(3, [0.0, 0.0, 0.0, 0.0])
    assert e.value.code == ErrorCode.no_reward_signal
    message = e.value.message
    assert "in the first 3 steps" in message and "grader 'exact'" in message
    assert "rewards seen: 0, 1" in message and '"answer": "a cat"' in message
    assert "/v1/graders/run" in message


def test_one_group_with_a_spread_is_a_signal_for_the_rest_of_the_run() -> None:
    s = signal()
    s.observe(0, [0.0, 0.0, 0.0, 0.5])
    for step in range(1, 20):
        s.observe(step, [1.0, 1.0, 1.0, 1.0])  # every answer right: learned, not stuck
    s.finish(20)


def test_a_run_shorter_than_the_window_without_signal_fails_at_its_end() -> None:
    s = signal(window=3)
    s.observe(0, [0.0, 0.0])
    s.observe(1, [0.0, 0.0])
    with pytest.raises(TrainFailure) as e:
        s.finish(2)
    assert "every answer earned 0" in e.value.message


def test_a_run_resumed_past_the_window_is_not_judged_again() -> None:
    s = signal(window=3)
    for step in range(5, 10):
        s.observe(step, [0.0, 0.0])
    s.finish(10)


def test_window_zero_never_stops() -> None:
    s = signal(window=0)
    for step in range(10):
        s.observe(step, [0.0, 0.0])
    s.finish(10)

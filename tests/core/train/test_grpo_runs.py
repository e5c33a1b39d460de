"""GRPO for real (TRL 1.16 GRPOTrainer) on the tiny Llama, graded by the job's grader.

* Direction, not only "it ran": with a reward for answers that contain the word in the
  row's ``animal`` field ({{item.animal}}), the trained adapter's mean reward on held-out
  prompts (sampled answers, same seed) is above the base model's.
* Honest progress: reward mean and spread, answer length and the held-out reward reach the
  events; sampled answers with their scores and the graders' call counts too.
* A grader that fails on most answers fails the job grader_failed, naming it and a row.
* A grader no answer can satisfy stops the run early with no_reward_signal (not the adapter
  check's "all zero" at the end), naming the grader, the reward and answers with scores.
* Two processes under DDP train and write an adapter.
* Full fine-tuning (peft method full, beta > 0: a frozen copy of the base as reference)
  writes a whole model that transformers loads, with weights moved from the base.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils.jobdirs import events, launch, make_job, of_type
from tests.utils.tiny import sentences

GRADER = {"type": "string_check", "name": "animal", "input": "{{sample.output_text}}",
          "reference": "{{item.animal}}", "operation": "like"}
MAX_NEW = 12


def prompts(n: int, seed: int) -> list[dict[str, Any]]:
    return [{"messages": [{"role": "user", "content": s}], "animal": "dog"}
            for s in sentences(n, seed)]


def grpo_job(root: Path, model: Path, rows: list[dict[str, Any]], **over: Any) -> Path:
    training = {
        "objective": "grpo", "max_steps": 30, "learning_rate": 0.05,
        "lr_scheduler_type": "constant", "per_device_train_batch_size": 32,
        "logging_steps": 5, "save_steps": 100, "eval_steps": 15,
        "grpo": {"grader": GRADER, "num_generations": 8, "max_completion_length": MAX_NEW,
                 "samples_per_log": 3},
        **over.pop("training", {}),
    }
    return make_job(root, model, rows, spec={
        "dataset": {"format": "chat", "max_seq_length": 64, "eval_split": 0.25},
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                 "target_modules": "all-linear"},
        "training": training, **over,
    })


def run(job: Path) -> int:
    from core.train.__main__ import main

    previous = signal.getsignal(signal.SIGTERM)  # main installs its own
    try:
        return main([str(job)])
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="module")
def grpo_run(tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    job = grpo_job(tmp_path_factory.mktemp("grpo"), tiny_causal_lm, prompts(48, 3))
    assert run(job) == 0, (job / "error.json").read_text()
    return job


def mean_reward(model: Any, tok: Any, rows: list[dict[str, Any]], samples: int = 8) -> float:
    from core.graders.config import GraderRuntime
    from core.graders.run import Grading
    from core.spec.graders import parse_grader

    torch.manual_seed(0)
    rewards = []
    with Grading(parse_grader(GRADER), GraderRuntime()) as grading:
        for r in rows:
            ids = tok.apply_chat_template(r["messages"], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)
            with torch.no_grad():
                out = model.generate(**ids, do_sample=True, max_new_tokens=MAX_NEW,
                                     num_return_sequences=samples, pad_token_id=tok.pad_token_id)
            for seq in out:
                text = tok.decode(seq[ids["input_ids"].shape[1]:], skip_special_tokens=True)
                rewards.append(grading.grade(text, r).reward)
    return sum(rewards) / len(rewards)


def test_grpo_adapter_earns_more_reward_on_held_out_prompts_than_the_base(
    grpo_run: Path, tiny_causal_lm: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_causal_lm)
    held_out = prompts(24, seed=99)  # prompts the run never saw
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm).eval()
    before = mean_reward(base, tok, held_out)
    tuned = PeftModel.from_pretrained(base, grpo_run / "adapter").eval()
    after = mean_reward(tuned, tok, held_out)
    assert after > before + 0.05, (before, after)


def test_grpo_rewards_lengths_and_samples_reach_the_events(grpo_run: Path) -> None:
    evs = events(grpo_run)
    logged = [e for e in of_type(evs, "progress") if "reward" in e]
    assert logged and all(0.0 <= e["reward"] <= 1.0 for e in logged)
    assert all("reward_std" in e and 0 < e["completion_length"] <= MAX_NEW for e in logged)
    evals = of_type(evs, "eval")
    assert [e["step"] for e in evals] == [15, 30]
    assert all("reward" in e and "perplexity" not in e for e in evals)

    graders = of_type(evs, "grader")
    train = [e for e in graders if e["phase"] == "train"]
    assert train and all(len(e["samples"]) == 3 for e in train)
    sample = train[-1]["samples"][0]
    assert set(sample) >= {"row", "prompt", "completion", "reward", "scores"}
    assert sample["scores"]["animal"] == sample["reward"]
    assert "rewards/animal/mean" in train[-1]["scores"]
    stats = graders[-1]["graders"]["animal"]
    assert stats["calls"] > 0 and stats["errors"] == 0 and stats["out_of_range"] == 0
    started = of_type(evs, "started")[0]
    assert started["objective"] == "grpo"
    assert started["lm_head"] == "fused"  # log-probs at the answer tokens only (test_loss.py)


def test_a_failing_grader_fails_the_job_naming_it_and_a_row(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    # Passes the submit checks (no item field is missing), but the answers of a random
    # model are not JSON: every call fails.
    grader = {**GRADER, "name": "json_city", "input": "{{sample.output_json.city}}"}
    job = grpo_job(tmp_path, tiny_causal_lm, prompts(16, 4), dataset={"format": "chat"},
                   training={"max_steps": 4, "per_device_train_batch_size": 16,
                             "eval_steps": None,
                             "grpo": {"grader": grader, "num_generations": 8,
                                      "max_completion_length": 4}})
    assert run(job) != 0
    error = json.loads((job / "error.json").read_text())
    assert error["code"] == "grader_failed"
    assert "grader 'json_city' failed" in error["message"]
    assert "at row" in error["message"] and "output_json" in error["message"]


def test_a_grader_that_never_differs_stops_the_run_early_saying_so(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    never = {**GRADER, "name": "unicorn", "reference": "unicorn-{{item.animal}}-42",
             "operation": "eq"}
    job = grpo_job(tmp_path, tiny_causal_lm, prompts(8, 4), dataset={"format": "chat"},
                   training={"max_steps": 40, "per_device_train_batch_size": 8,
                             "logging_steps": 1, "eval_steps": None,
                             "grpo": {"grader": never, "num_generations": 4,
                                      "max_completion_length": 4}})
    assert run(job) != 0
    error = json.loads((job / "error.json").read_text())
    assert error["code"] == "no_reward_signal", error["message"]
    message = error["message"]
    assert "in the first 4 steps" in message  # 10% of 40 steps
    assert "grader 'unicorn'" in message and "every answer earned 0" in message
    assert '"answer": ' in message and '"reward": 0.0' in message
    steps = [e["step"] for e in of_type(events(job), "progress") if "reward" in e]
    assert max(steps) <= 4  # stopped early, not after 40 steps


# A reward that differs between answers of the same prompt (see the DDP test below).
SIMILAR = {"type": "text_similarity", "name": "similar", "input": "{{sample.output_text}}",
           "reference": "{{item.animal}} {{item.animal}}", "evaluation_metric": "fuzzy_match"}


def test_full_grpo_saves_a_whole_model_that_moved_from_the_base(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from worker.run.adapter_check import artifact_problem

    job = grpo_job(tmp_path, tiny_causal_lm, prompts(8, 6), peft={"method": "full"},
                   training={"max_steps": 2, "per_device_train_batch_size": 8,
                             "learning_rate": 1e-3, "logging_steps": 1, "eval_steps": None,
                             "grpo": {"grader": SIMILAR, "num_generations": 4, "beta": 0.04,
                                      "max_completion_length": 4}})
    assert run(job) == 0, (job / "error.json").read_text()
    evs = events(job)
    started = of_type(evs, "started")[0]
    assert (started["method"], started["objective"]) == ("full", "grpo")
    assert started["trainable_params"] == started["total_params"]
    assert any("kl" in e for e in of_type(evs, "progress"))  # the reference pass ran
    assert not (job / "adapter").exists()
    assert artifact_problem(job / "model") is None  # the worker's check before success
    tuned = AutoModelForCausalLM.from_pretrained(job / "model").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_causal_lm).state_dict()
    assert tuned.keys() == base.keys()
    assert all(tuned[n].dtype == base[n].dtype for n in base)  # moved, not only cast
    moved = [n for n in base if not torch.equal(tuned[n], base[n])]
    assert len(moved) > len(base) // 2, moved


@pytest.mark.e2e
def test_grpo_under_ddp_trains_an_adapter(tiny_causal_lm: Path, tmp_path: Path) -> None:
    # A reward that differs between answers of the same prompt: with all answers scored
    # alike, every advantage is 0, nothing is learned, and the adapter check says so.
    job = grpo_job(tmp_path, tiny_causal_lm, prompts(16, 5),
                   distributed={"strategy": "ddp", "num_processes": 2},
                   training={"max_steps": 2, "per_device_train_batch_size": 8,
                             "logging_steps": 1, "eval_steps": None,
                             "grpo": {"grader": SIMILAR, "num_generations": 4,
                                      "max_completion_length": 4}})
    launch(job)
    evs = events(job)
    started = of_type(evs, "started")[0]
    assert started["strategy"] == "ddp" and started["world_size"] == 2
    assert of_type(evs, "finished")[0]["step"] == 2
    assert (job / "adapter" / "adapter_model.safetensors").exists()

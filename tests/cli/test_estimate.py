"""`ftune estimate`: exact parameter counts on the meta device, sharding divides state."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from cli.main import app
from core.model.estimate import estimate
from core.spec import parse_job_spec
from tests.utils.specs import spec_body


def spec(model: Path, **distributed: object) -> dict:
    return spec_body(model, dataset={"file_id": "file-x", "max_seq_length": 64},
                     peft={"method": "lora", "r": 4, "target_modules": "all-linear"},
                     training={"per_device_train_batch_size": 4, "num_train_epochs": 2},
                     distributed=distributed or {"strategy": "none"})


def test_trainable_count_matches_the_real_peft_model(tiny_causal_lm: Path) -> None:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from core.model.peft import peft_config

    s = parse_job_spec(spec(tiny_causal_lm))
    real = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_causal_lm), peft_config(s, ""))
    est = estimate(s, str(tiny_causal_lm), rows=100)
    assert (est.trainable_params, est.total_params) == real.get_nb_trainable_parameters()
    assert est.steps == 2 * 25  # ceil(100 / 4) per epoch


def test_zero3_with_offload_moves_weights_and_optimizer_to_cpu(tiny_causal_lm: Path) -> None:
    ddp = estimate(
        parse_job_spec(spec(tiny_causal_lm, strategy="ddp", num_processes=2)), str(tiny_causal_lm)
    )
    z3 = estimate(
        parse_job_spec(
            spec(
                tiny_causal_lm,
                strategy="deepspeed",
                num_processes=2,
                deepspeed={
                    "zero_stage": 3,
                    "offload_param_device": "cpu",
                    "offload_optimizer_device": "cpu",
                },
            )
        ),
        str(tiny_causal_lm),
    )
    assert z3.gpu_weights_mb == 0 and z3.cpu_offloaded_mb > 0
    assert z3.gpu_training_state_mb < ddp.gpu_training_state_mb


def test_cli_prints_the_table(tiny_causal_lm: Path, tmp_path: Path) -> None:
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec(tiny_causal_lm)))
    result = CliRunner().invoke(app, ["estimate", str(f), "--rows", "100"])
    assert result.exit_code == 0, result.output
    assert "trainable" in result.output and "50" in result.output


def test_a_quantized_base_costs_its_quantized_bytes(tiny_causal_lm: Path) -> None:
    """4-bit ~0.5 B per Linear weight (+ constants), 8-bit ~1 B; checked against the Linear
    weights bitsandbytes really quantizes in the loaded model."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    full = estimate(parse_job_spec(spec(tiny_causal_lm)), str(tiny_causal_lm))
    body = spec(tiny_causal_lm)
    body["model"]["quantization"] = {"load_in": "4bit"}
    four = estimate(parse_job_spec(body), str(tiny_causal_lm))
    body["model"]["quantization"] = {"load_in": "8bit"}
    eight = estimate(parse_job_spec(body), str(tiny_causal_lm))

    real = AutoModelForCausalLM.from_pretrained(
        tiny_causal_lm, quantization_config=BitsAndBytesConfig(load_in_4bit=True)
    )
    linear4 = [m for m in real.modules() if type(m).__name__ == "Linear4bit"]
    assert four.quantized_params == sum(2 * m.weight.numel() for m in linear4)  # 2 per byte
    q = four.quantized_params
    saved_4 = (full.gpu_weights_mb - four.gpu_weights_mb) * 2**20
    saved_8 = (full.gpu_weights_mb - eight.gpu_weights_mb) * 2**20
    assert abs(saved_4 - q * (4 - 0.5 - 4 / 64)) < 1 and abs(saved_8 - q * 3) < 1
    assert four.weights_dtype == "4bit + float32"


def test_cli_counts_tokens_of_a_local_dataset(tiny_causal_lm: Path, tmp_path: Path) -> None:
    from core.data.counts import count_tokens

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": f"the cat sat {i}"}) + "\n" for i in range(10)))
    body = spec(tiny_causal_lm)
    body["dataset"] = {"path": str(data), "format": "text", "max_seq_length": 64}
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(body))
    result = CliRunner().invoke(app, ["estimate", str(f)], terminal_width=200)
    assert result.exit_code == 0, result.output
    count = count_tokens(parse_job_spec(body), str(tiny_causal_lm), data, None)
    assert f"{count.tokens:,} ({count.loss_tokens:,} with a loss)" in result.output
    assert f"{2 * count.tokens:,}" in result.output  # 2 epochs of 3 steps


def test_preference_objectives_cost_their_extra_passes_not_a_second_model(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    def with_objective(objective: str, fmt: str) -> dict:
        s = spec(tiny_causal_lm)
        s["dataset"]["format"] = fmt
        s["training"]["objective"] = objective
        return s

    # Chat SFT, like DPO and KTO, scores through the fused LM head (no full logits kept).
    sft = estimate(parse_job_spec(with_objective("sft", "chat")), str(tiny_causal_lm))
    dpo = estimate(parse_job_spec(with_objective("dpo", "preference")), str(tiny_causal_lm))
    kto = estimate(parse_job_spec(with_objective("kto", "kto")), str(tiny_causal_lm))
    # The reference is the adapter disabled: the same weights, no second copy.
    assert dpo.gpu_weights_mb == sft.gpu_weights_mb == kto.gpu_weights_mb
    assert dpo.gpu_training_state_mb == sft.gpu_training_state_mb
    # Both answers of a pair keep activations; the reference passes store none.
    assert dpo.gpu_activations_mb == 2 * sft.gpu_activations_mb
    assert kto.gpu_activations_mb == sft.gpu_activations_mb
    assert (sft.compute_vs_sft, dpo.compute_vs_sft, kto.compute_vs_sft) == (1.0, 8 / 3, 2.0)
    f = tmp_path / "dpo.json"
    f.write_text(json.dumps(with_objective("dpo", "preference")))
    result = CliRunner().invoke(app, ["estimate", str(f)])
    assert result.exit_code == 0, result.output
    assert "dpo" in result.output and "2.67x" in result.output


def test_show_prints_rows_as_trained_with_loss_tokens_marked(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    from tests.utils import samples
    from tests.utils.tiny import write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [samples.ALPACA[1]])
    f = tmp_path / "spec.json"
    f.write_text(json.dumps({"model": {"name_or_path": str(tiny_causal_lm)},
                             "dataset": {"path": str(data)}}))
    result = CliRunner().invoke(app, ["estimate", str(f), "--show", "1"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert ("data: alpaca [alpaca], detected; columns used: instruction (prompt), output "
            "(response), input (query); ignored: none") in result.output
    # The tiny vocabulary lacks capitals: "Telegram" decodes as <unk>elegram.
    assert "--- row 1: " in result.output
    assert "«<|assistant|><unk>elegram</s>»" in result.output


def test_grpo_estimate_counts_what_it_generates(tiny_causal_lm: Path, tmp_path: Path) -> None:
    from core.data.counts import count_tokens, optimizer_steps
    from tests.utils.tiny import write_jsonl

    rows = [{"messages": [{"role": "user", "content": "two dogs"}], "animal": "dog"}] * 6
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    grader = {"type": "string_check", "name": "a", "input": "{{sample.output_text}}",
              "reference": "{{item.animal}}", "operation": "like"}
    spec = parse_job_spec({
        "model": {"name_or_path": str(tiny_causal_lm)},
        "dataset": {"path": str(data), "format": "chat"},
        "training": {"objective": "grpo", "per_device_train_batch_size": 8,
                     "grpo": {"grader": grader, "num_generations": 4,
                              "max_completion_length": 10}},
    })
    count = count_tokens(spec, str(tiny_causal_lm), data, None)
    assert count.generated_tokens == 6 * 4 * 10
    assert count.batch_rows == 24  # answers, which a per-device batch counts
    assert count.tokens > count.generated_tokens
    assert optimizer_steps(count.batch_rows, spec) == (3, 3)


def test_the_ftune_process_estimates_without_bitsandbytes_and_counts_the_same(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    """A local `ftune estimate` skips importing bitsandbytes (peft pulls it in, and it pulls
    in torch's inductor: most of the command's time); the counts stay peft's own."""
    import subprocess
    import sys

    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from core.model.peft import peft_config

    body = spec(tiny_causal_lm)
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(body))
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cli.main", "estimate", str(f)],
        check=False, capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines()}
    assert "peft" in imported and "bitsandbytes.nn" not in imported
    model = AutoModelForCausalLM.from_pretrained(tiny_causal_lm)
    trainable, total = get_peft_model(
        model, peft_config(parse_job_spec(body), "")
    ).get_nb_trainable_parameters()
    assert f"{total:,} " in run.stdout and f"{trainable:,} (" in run.stdout

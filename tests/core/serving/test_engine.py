"""The engine's command line and environment (core/serving/engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

from core.infra.settings import Settings
from core.serving.engine import deployment_memory_mb, engine_argv, engine_env


def test_each_call_builds_a_fresh_argv_with_lora_and_a_cpu_dtype(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path, serving_max_loras=3, serving_max_lora_rank=16)
    a = engine_argv(s, model="/m", port=9000, lora=True, gpu=False)
    b = engine_argv(s, model="/m", port=9000, lora=True, gpu=False)
    assert a == b and a is not b
    assert a[:3] == [str(s.engine_python), "-m", "vllm.entrypoints.openai.api_server"]
    def flag(name: str) -> str:
        return a[a.index(name) + 1]

    assert "--enable-lora" in a and flag("--dtype") == "float32" and flag("--max-loras") == "3"
    assert flag("--max-lora-rank") == "16" and flag("--served-model-name") == "base"
    assert "-O0" in a  # no torch.compile on CPU
    full = engine_argv(s, model="/m", port=9000, lora=False, gpu=True)
    assert "--enable-lora" not in full and full[full.index("--dtype") + 1] == "auto"
    assert "-O0" not in full


def test_the_engine_gets_its_key_and_runtime_adapters_but_not_ftunes_path(
        tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path, serving_kv_cache_mb=2048)
    env = engine_env({"PYTHONPATH": "/repo", "HOME": "/root"}, api_key="k", settings=s)
    assert env["VLLM_API_KEY"] == "k" and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and "PYTHONPATH" not in env


def test_a_deployment_needs_its_weights_and_its_kv_cache(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    s = Settings(data_dir=tmp_path, serving_kv_cache_mb=2048)
    assert deployment_memory_mb(tmp_path, s) == 3 + 2048


def test_a_long_context_needs_at_least_one_whole_sequence_of_kv_cache(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_size": 4096, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}))
    s = Settings(data_dir=tmp_path, serving_kv_cache_mb=2048)
    # 2 x 32 layers x 8 heads x 128 x 2 bytes = 128 KiB a token, 131,072 tokens: 16 GiB
    assert deployment_memory_mb(tmp_path, s) == 1 + 16384


def test_an_engine_on_gpus_sees_only_its_own_and_runs_tensor_parallel_over_them(
        tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    argv = engine_argv(s, model="/m", port=9000, lora=True, gpu=True, tensor_parallel=2)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in engine_argv(s, model="/m", port=9000, lora=True,
                                                       gpu=True)
    env = engine_env({}, api_key="k", settings=s, gpu_ids=(2, 3))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "CUDA_VISIBLE_DEVICES" not in engine_env({}, api_key="k", settings=s)

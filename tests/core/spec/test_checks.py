"""JobSpec validation: field checks and cross-field checks, every problem with its path."""

from __future__ import annotations

from typing import Any

import pytest

from core.infra.settings import Settings
from core.spec import SpecError, parse_job_spec


def base(**over) -> dict:
    spec = {
        "model": {"name_or_path": "org/tiny"},
        "dataset": {"file_id": "file-1"},
    }
    for k, v in over.items():
        spec[k] = v
    return spec


def params(data: dict) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_job_spec(data)
    return [p.param for p in e.value.problems]


def test_minimal_spec_gets_documented_defaults() -> None:
    spec = parse_job_spec(base())
    assert spec.peft.method == "lora" and spec.peft.r == 8
    assert spec.training.learning_rate == 2e-4
    assert spec.distributed.strategy == "none"
    assert spec.model.task == "causal_lm"


def spec_fields(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every property reachable from the JobSpec component (nested sections, union members,
    list items), by its path, e.g. "DistributedSpec.fsdp" -> its schema."""
    components = openapi["components"]["schemas"]
    found: dict[str, dict[str, Any]] = {}
    seen: set[str] = set()

    def walk(node: Any, where: str) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, where)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[-1]
            if name not in seen:
                seen.add(name)
                walk(components[name], name)
        for field, prop in node.get("properties", {}).items():
            found[f"{where}.{field}"] = prop
            walk(prop, where)
        for key in ("anyOf", "oneOf", "allOf", "items", "additionalProperties"):
            walk(node.get(key), where)

    walk({"$ref": "#/components/schemas/JobSpec"}, "JobSpec")
    return found


def test_every_field_of_the_spec_has_a_description_in_the_openapi_schema() -> None:
    from api.main import create_app

    fields = spec_fields(create_app(Settings()).openapi())
    # Every section and every nested option is reached (123 fields when this was written).
    assert "JobSpec.model" in fields and "FsdpSpec.min_num_params" in fields
    assert "PrefixTuningSpec.encoder_hidden_size" in fields and len(fields) >= 123
    missing = sorted(name for name, prop in fields.items() if not prop.get("description"))
    assert missing == []


def test_unknown_key_is_rejected_with_its_path() -> None:
    assert params(base(training={"learnig_rate": 1e-4})) == ["training.learnig_rate"]


def test_field_errors_are_all_collected() -> None:
    got = params(base(training={"learning_rate": -1, "per_device_train_batch_size": 0}))
    assert set(got) == {"training.learning_rate", "training.per_device_train_batch_size"}


def test_peft_union_errors_use_user_paths() -> None:
    assert params(base(peft={"method": "lora", "r": 0})) == ["peft.r"]


def test_unknown_peft_method_is_rejected() -> None:
    assert params(base(peft={"method": "qlora"})) == ["peft"]


def test_cross_field_problems_are_all_collected() -> None:
    data = base(
        dataset={"file_id": "f", "path": "/data/x.jsonl", "format": "classification"},
        distributed={"strategy": "none", "num_processes": 2},
    )
    got = params(data)
    assert "dataset.file_id" in got  # both file_id and path
    assert "dataset.format" in got  # classification with causal_lm
    assert "distributed.num_processes" in got


def test_ddp_needs_two_processes() -> None:
    assert params(base(distributed={"strategy": "ddp", "num_processes": 1})) == [
        "distributed.num_processes"
    ]


def test_eval_steps_need_eval_data() -> None:
    assert params(base(training={"eval_steps": 10})) == ["training.eval_steps"]


def test_eval_split_enables_eval_steps() -> None:
    parse_job_spec(base(dataset={"file_id": "f", "eval_split": 0.1}, training={"eval_steps": 5}))


def test_format_must_fit_task() -> None:
    got = params(base(model={"name_or_path": "m", "task": "seq_cls"},
                      dataset={"file_id": "file-1", "format": "text"}))
    assert got == ["dataset.format"]


def test_fsdp_block_with_ddp_would_be_ignored() -> None:
    got = params(
        base(distributed={"strategy": "ddp", "num_processes": 2, "fsdp": {"offload_params": True}})
    )
    assert got == ["distributed.fsdp"]


def test_size_based_wrap_needs_min_num_params() -> None:
    got = params(
        base(
            distributed={"strategy": "fsdp", "fsdp": {"auto_wrap_policy": "SIZE_BASED_WRAP"}},
        )
    )
    assert got == ["distributed.fsdp.min_num_params"]


def test_fsdp2_refuses_fsdp1_only_options() -> None:
    got = params(
        base(
            distributed={
                "strategy": "fsdp",
                "fsdp": {
                    "version": 2,
                    "forward_prefetch": True,
                    "state_dict_type": "LOCAL_STATE_DICT",
                    "use_orig_params": False,
                    "sharding_strategy": "HYBRID_SHARD",
                },
            }
        )
    )
    assert set(got) == {
        "distributed.fsdp.forward_prefetch",
        "distributed.fsdp.state_dict_type",
        "distributed.fsdp.use_orig_params",
        "distributed.fsdp.sharding_strategy",
    }


def test_fsdp1_cpu_efficient_loading_needs_sync_module_states() -> None:
    got = params(
        base(
            distributed={
                "strategy": "fsdp",
                "fsdp": {"version": 1, "sync_module_states": False},
            }
        )
    )
    assert got == ["distributed.fsdp.sync_module_states"]


def test_fsdp_activation_checkpointing_conflicts_with_gradient_checkpointing() -> None:
    got = params(
        base(
            training={"gradient_checkpointing": True},
            distributed={"strategy": "fsdp", "fsdp": {"activation_checkpointing": True}},
        )
    )
    assert got == ["distributed.fsdp.activation_checkpointing"]


def test_param_offload_needs_zero3_and_optimizer_offload_needs_zero2() -> None:
    got = params(
        base(
            distributed={
                "strategy": "deepspeed",
                "num_processes": 2,
                "deepspeed": {
                    "zero_stage": 1,
                    "offload_param_device": "cpu",
                    "offload_optimizer_device": "cpu",
                },
            }
        )
    )
    assert set(got) == {
        "distributed.deepspeed.offload_param_device",
        "distributed.deepspeed.offload_optimizer_device",
    }


def test_nvme_offload_needs_an_absolute_path() -> None:
    got = params(
        base(distributed={"strategy": "deepspeed", "deepspeed": {"offload_param_device": "nvme"}})
    )
    assert got == ["distributed.deepspeed.nvme_path"]


def test_zero3_only_flags_with_zero2_would_be_ignored() -> None:
    got = params(
        base(
            distributed={
                "strategy": "deepspeed",
                "deepspeed": {"zero_stage": 2, "zero3_init_flag": False},
            }
        )
    )
    assert got == ["distributed.deepspeed.zero3_init_flag"]


def test_deepspeed_clipping_must_agree_with_max_grad_norm() -> None:
    got = params(
        base(
            training={"max_grad_norm": 1.0},
            distributed={"strategy": "deepspeed", "deepspeed": {"gradient_clipping": 0.5}},
        )
    )
    assert got == ["distributed.deepspeed.gradient_clipping"]


def test_zero3_with_cpu_offload_is_valid() -> None:
    spec = parse_job_spec(
        base(
            distributed={
                "strategy": "deepspeed",
                "num_processes": 2,
                "deepspeed": {
                    "zero_stage": 3,
                    "offload_optimizer_device": "cpu",
                    "offload_param_device": "cpu",
                },
            }
        )
    )
    assert spec.distributed.deepspeed.zero_stage == 3


def test_multi_node_leaves_main_process_ip_to_the_executor() -> None:
    # SLURM picks the nodes, so the first node's address is the executor's to set.
    spec = parse_job_spec(base(distributed={"strategy": "ddp", "num_processes": 4,
                                            "num_machines": 2}))
    assert spec.distributed.main_process_ip is None


def test_prompt_tuning_text_init_needs_text() -> None:
    got = params(base(peft={"method": "prompt_tuning", "prompt_tuning_init": "TEXT"}))
    assert got == ["peft.prompt_tuning_init_text"]


def test_name_rejects_control_characters() -> None:
    assert params(base(name="a\nb")) == ["name"]


def test_target_modules_all_linear_or_list() -> None:
    assert parse_job_spec(base(peft={"target_modules": "all-linear"})).peft.target_modules == "all-linear"
    assert params(base(peft={"target_modules": "q_proj"})) == ["peft.target_modules"]


def test_processes_split_evenly_over_machines() -> None:
    got = params(
        base(
            distributed={
                "strategy": "ddp",
                "num_processes": 3,
                "num_machines": 2,
                "main_process_ip": "10.0.0.1",
            }
        )
    )
    assert got == ["distributed.num_processes"]


# --- sharding rules audited against accelerate 1.15 / torch FSDP / DeepSpeed 0.19 -----------


def fsdp(version: int = 1, num_machines: int = 1, model: dict | None = None, **f) -> dict:
    dist: dict = {"strategy": "fsdp", "num_processes": 2 * num_machines, "fsdp": {"version": version, **f}}
    if num_machines > 1:
        dist.update(num_machines=num_machines, main_process_ip="10.0.0.1")
    body = base(distributed=dist)
    if model:
        body["model"] = {**body["model"], **model}
    return body


def problems(data: dict) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        parse_job_spec(data)
    return {p.param: p.message for p in e.value.problems}


def test_fsdp1_use_orig_params_false_cannot_train_an_adapter() -> None:
    # torch FSDP1: "Must flatten tensors with uniform requires_grad when use_orig_params=False"
    got = problems(fsdp(use_orig_params=False))
    assert list(got) == ["distributed.fsdp.use_orig_params"]
    assert "frozen base" in got["distributed.fsdp.use_orig_params"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fsdp1_needs_one_dtype_for_base_and_adapter(dtype: str) -> None:
    # torch FSDP1: "Must flatten tensors with uniform dtype"; peft keeps the adapter in fp32.
    got = problems(fsdp(model={"dtype": dtype}))
    assert list(got) == ["model.dtype"] and "version 2" in got["model.dtype"]
    assert parse_job_spec(fsdp(version=2, model={"dtype": dtype}))  # FSDP2 casts per group


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"])
def test_hybrid_sharding_needs_several_machines(strategy: str) -> None:
    got = problems(fsdp(sharding_strategy=strategy))
    assert list(got) == ["distributed.fsdp.sharding_strategy"]
    assert "on one machine" in got["distributed.fsdp.sharding_strategy"]
    spec = parse_job_spec(fsdp(num_machines=2, sharding_strategy=strategy))
    assert spec.distributed.fsdp.sharding_strategy == strategy


def test_hybrid_sharding_needs_an_auto_wrap_policy() -> None:
    # torch: "Manual wrapping with HYBRID_SHARD requires explicit specification of process
    # group or device_mesh"
    got = problems(fsdp(num_machines=2, sharding_strategy="HYBRID_SHARD", auto_wrap_policy="NO_WRAP"))
    assert list(got) == ["distributed.fsdp.auto_wrap_policy"]


def test_fsdp2_has_no_hybrid_or_no_shard() -> None:
    for strategy in ("NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"):
        got = problems(fsdp(version=2, num_machines=2, sharding_strategy=strategy))
        assert list(got) == ["distributed.fsdp.sharding_strategy"]


def test_activation_checkpointing_offload_is_fsdp2_with_checkpointing() -> None:
    got = problems(fsdp(version=2, activation_checkpointing_offload=True))
    assert list(got) == ["distributed.fsdp.activation_checkpointing_offload"]
    assert "needs activation_checkpointing" in got["distributed.fsdp.activation_checkpointing_offload"]
    got = problems(fsdp(activation_checkpointing=True, activation_checkpointing_offload=True))
    assert "FSDP2 only" in got["distributed.fsdp.activation_checkpointing_offload"]
    spec = parse_job_spec(
        fsdp(version=2, activation_checkpointing=True, activation_checkpointing_offload=True)
    )
    assert spec.distributed.fsdp.activation_checkpointing_offload


def test_fsdp2_offload_params_is_valid() -> None:
    # accelerate turns it into torch's CPUOffloadPolicy (tests/worker/run/test_accelerate_launches.py)
    assert parse_job_spec(fsdp(version=2, offload_params=True)).distributed.fsdp.offload_params


def test_nvme_optimizer_offload_needs_zero3() -> None:
    # ZeRO-1/2 treat any optimizer offload device as cpu: NVMe would be silently unused.
    body = base(
        distributed={
            "strategy": "deepspeed",
            "deepspeed": {
                "zero_stage": 2,
                "offload_optimizer_device": "nvme",
                "nvme_path": "/nvme",
            },
        }
    )
    got = problems(body)
    assert list(got) == ["distributed.deepspeed.offload_optimizer_device"]
    body["distributed"]["deepspeed"]["zero_stage"] = 3
    assert parse_job_spec(body)


def test_zero3_without_16bit_gather_would_be_ignored_for_an_adapter() -> None:
    body = base(distributed={"strategy": "deepspeed", "deepspeed": {"zero3_save_16bit_model": False}})
    got = problems(body)
    assert list(got) == ["distributed.deepspeed.zero3_save_16bit_model"]
    assert "ignored" in got["distributed.deepspeed.zero3_save_16bit_model"]


def test_main_process_ip_on_one_machine_would_be_ignored() -> None:
    body = base(distributed={"strategy": "ddp", "num_processes": 2, "main_process_ip": "10.0.0.1"})
    assert list(problems(body)) == ["distributed.main_process_ip"]


def test_main_process_port_without_a_process_group_would_be_ignored() -> None:
    assert list(problems(base(distributed={"main_process_port": 29600}))) == [
        "distributed.main_process_port"
    ]
    spec = parse_job_spec(
        base(distributed={"strategy": "ddp", "num_processes": 2, "main_process_port": 29600})
    )
    assert spec.distributed.main_process_port == 29600


def test_every_sharding_problem_comes_in_one_error() -> None:
    got = problems(
        fsdp(
            model={"dtype": "bfloat16"},
            use_orig_params=False,
            sharding_strategy="HYBRID_SHARD",
            auto_wrap_policy="NO_WRAP",
            activation_checkpointing_offload=True,
        )
    )
    assert set(got) == {
        "model.dtype",
        "distributed.fsdp.use_orig_params",
        "distributed.fsdp.sharding_strategy",
        "distributed.fsdp.auto_wrap_policy",
        "distributed.fsdp.activation_checkpointing_offload",
    }


@pytest.mark.parametrize(
    "distributed",
    [
        {"strategy": "none"},
        {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 2}},
        {"strategy": "fsdp", "num_processes": 2, "fsdp": {"version": 1}},
        {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 2}},
        {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 3}},
    ],
)
def test_the_resolved_spec_fills_defaults_that_apply_and_validates(
    distributed: dict[str, object],
) -> None:
    from core.spec import resolved_spec

    body = {"model": {"name_or_path": "org/m"}, "dataset": {"file_id": "file-x"},
            "distributed": distributed}
    spec = parse_job_spec(body)
    resolved = resolved_spec(spec)
    assert resolved["training"]["learning_rate"] == 2e-4 and resolved["peft"]["r"] == 8
    assert parse_job_spec(resolved).model_dump() == spec.model_dump()  # the same job
    assert ("fsdp" in resolved["distributed"]) == (distributed["strategy"] == "fsdp")
    assert ("deepspeed" in resolved["distributed"]) == (distributed["strategy"] == "deepspeed")


@pytest.mark.parametrize(("distributed", "processes", "per_node"), [
    ({"strategy": "none"}, 1, 1),
    ({"strategy": "ddp", "num_processes": 4}, 4, 4),
    ({"strategy": "fsdp", "num_processes": 8, "num_machines": 2}, 8, 4),
])
def test_the_processes_a_job_starts(distributed: dict[str, Any], processes: int,
                                    per_node: int) -> None:
    from core.spec import DistributedSpec

    dist = DistributedSpec.model_validate(distributed)
    assert (dist.processes, dist.processes_per_node) == (processes, per_node)
    # Strategy none runs one process whatever num_processes says (a spec stored before
    # the cross-field check refused that).
    assert DistributedSpec(strategy="none", num_processes=4).processes == 1


@pytest.mark.parametrize(("distributed", "says"), [
    ({"strategy": "none", "resume_on": [2]}, "strategy none runs one process"),
    ({"strategy": "ddp", "num_processes": 8, "num_machines": 2, "main_process_ip": "10.0.0.1",
      "resume_on": [4]}, "single-machine jobs only"),
    ({"strategy": "ddp", "num_processes": 4, "resume_on": [2, 2]}, "twice"),
    ({"strategy": "deepspeed", "num_processes": 4, "resume_on": [2],
      "deepspeed": {"zero_stage": 3, "offload_optimizer_device": "nvme",
                    "nvme_path": "/local_nvme"}}, "per-rank swap files"),
], ids=["strategy-none", "multi-machine", "duplicate", "deepspeed-nvme-optimizer"])
def test_resume_on_is_refused_where_no_scheduler_choice_could_apply(
        distributed: dict[str, Any], says: str) -> None:
    got = problems(base(distributed=distributed))
    assert says in got["distributed.resume_on"]


def test_a_layout_on_another_count_keeps_its_options() -> None:
    from core.spec import DistributedSpec

    ddp = DistributedSpec(strategy="ddp", num_processes=4, resume_on=[2, 1])
    assert (ddp.on(2).strategy, ddp.on(2).processes) == ("ddp", 2)
    assert (ddp.on(1).strategy, ddp.on(1).processes) == ("none", 1)  # ddp needs two
    assert ddp.on(2).resume_on is None  # one run's layout: the choice is made
    fsdp = DistributedSpec.model_validate({"strategy": "fsdp", "num_processes": 2,
                                           "fsdp": {"offload_params": True}})
    assert (fsdp.on(1).strategy, fsdp.on(1).fsdp.offload_params) == ("fsdp", True)

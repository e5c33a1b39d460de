"""spec.distributed: the strategy (none, ddp, fsdp, deepspeed), the process layout, and
the FSDP and DeepSpeed options."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from core.spec.base import _Strict


class FsdpSpec(_Strict):
    version: Literal[1, 2] = Field(default=2, description="FSDP1 or FSDP2 (fully_shard).")
    sharding_strategy: Literal[
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"
    ] = Field(
        default="FULL_SHARD",
        description="FSDP2: FULL_SHARD (reshard after forward) or SHARD_GRAD_OP. FSDP1 also: "
        "NO_SHARD, and HYBRID_SHARD / HYBRID_SHARD_ZERO2 (shard within a machine, replicate "
        "across machines: needs num_machines > 1).",
    )
    offload_params: bool = Field(
        default=False,
        description="Keep parameters (and gradients, optimizer step) on CPU: CPUOffload in "
        "FSDP1, CPUOffloadPolicy in FSDP2.",
    )
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = (
        "TRANSFORMER_BASED_WRAP"
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        default=None, description="Default: the model's _no_split_modules."
    )
    min_num_params: int | None = Field(default=None, ge=1, description="SIZE_BASED_WRAP only.")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"] = "BACKWARD_PRE"
    forward_prefetch: bool = False
    state_dict_type: Literal["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"] = (
        "SHARDED_STATE_DICT"
    )
    cpu_ram_efficient_loading: bool = True
    sync_module_states: bool = True
    use_orig_params: bool = Field(
        default=True,
        description="FSDP1 only. Must stay true: a PEFT adapter trains inside frozen layers, "
        "and FSDP1 can only flatten those together with use_orig_params.",
    )
    activation_checkpointing: bool = False
    activation_checkpointing_offload: bool = Field(
        default=False,
        description="FSDP2 with activation_checkpointing: keep the checkpointed activations "
        "in CPU memory between forward and backward.",
    )


class DeepSpeedSpec(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 3
    offload_optimizer_device: Literal["none", "cpu", "nvme"] = "none"
    offload_param_device: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = Field(default=None, description="Absolute path for NVMe offload.")
    zero3_init_flag: bool = True
    zero3_save_16bit_model: bool = Field(
        default=True,
        description="ZeRO-3: gather the weights for every save. ftune trains PEFT adapters, "
        "which the Trainer always gathers (trainable weights only), so false is refused.",
    )
    gradient_clipping: float | None = Field(
        default=None, ge=0, description="Default: training.max_grad_norm."
    )


class DistributedSpec(_Strict):
    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] = "none"
    num_processes: int = Field(default=1, ge=1, le=1024, description="Processes in total.")
    num_machines: int = Field(
        default=1, ge=1, le=128,
        description="Machines (nodes) the processes are spread over; more than 1 runs on a "
        "SLURM pool, which picks the nodes and the main process address.",
    )
    machine_rank: int = Field(default=0, ge=0)
    main_process_ip: str | None = Field(
        default=None, max_length=255,
        description="Rendezvous address for a run by hand; on SLURM it is the allocation's "
        "first node (leave unset).",
    )
    main_process_port: int | None = Field(default=None, ge=1024, le=65535)
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)

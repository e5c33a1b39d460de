"""spec.distributed: the strategy (none, ddp, fsdp, deepspeed), the process layout, and
the FSDP and DeepSpeed options."""

from __future__ import annotations

from typing import Annotated, Literal

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
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"] = Field(
        default="TRANSFORMER_BASED_WRAP",
        description="Which modules become FSDP units: TRANSFORMER_BASED_WRAP (each layer of "
        "transformer_layer_cls_to_wrap), SIZE_BASED_WRAP (modules of at least "
        "min_num_params parameters) or NO_WRAP (the whole model as one unit).",
    )
    transformer_layer_cls_to_wrap: list[str] | None = Field(
        default=None, description="Default: the model's _no_split_modules."
    )
    min_num_params: int | None = Field(default=None, ge=1, description="SIZE_BASED_WRAP only.")
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"] = Field(
        default="BACKWARD_PRE",
        description="FSDP1 only: when backward fetches the next unit's parameters: "
        "BACKWARD_PRE (before the current unit's gradients: faster, more memory), "
        "BACKWARD_POST (after) or NO_PREFETCH.",
    )
    forward_prefetch: bool = Field(
        default=False,
        description="FSDP1 only: fetch the next unit's parameters in forward before the "
        "current unit finishes (FSDP2 does not implement it).",
    )
    state_dict_type: Literal["FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"] = Field(
        default="SHARDED_STATE_DICT",
        description="How checkpoints are saved: SHARDED_STATE_DICT (each rank writes its "
        "shard; under FSDP2 each checkpoint also gets a consolidated adapter), "
        "FULL_STATE_DICT (gathered on rank 0) or LOCAL_STATE_DICT (FSDP1 only). The final "
        "adapter is always consolidated.",
    )
    cpu_ram_efficient_loading: bool = Field(
        default=True,
        description="Only rank 0 reads the base weights; the other ranks get their shards "
        "when training starts (less CPU memory per machine). Must be false with "
        "model.quantization.",
    )
    sync_module_states: bool = Field(
        default=True,
        description="FSDP1 only: broadcast rank 0's weights to every rank when wrapping; "
        "must stay true with cpu_ram_efficient_loading.",
    )
    use_orig_params: bool = Field(
        default=True,
        description="FSDP1 only. Must stay true: a PEFT adapter trains inside frozen layers, "
        "and FSDP1 can only flatten those together with use_orig_params.",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="FSDP's own activation checkpointing: recompute each unit's activations "
        "in backward instead of storing them. Use it or training.gradient_checkpointing, not "
        "both.",
    )
    activation_checkpointing_offload: bool = Field(
        default=False,
        description="FSDP2 with activation_checkpointing: keep the checkpointed activations "
        "in CPU memory between forward and backward.",
    )


class DeepSpeedSpec(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=3,
        description="ZeRO stage: 0 (plain data parallel), 1 (optimizer states sharded), 2 "
        "(gradients too), 3 (parameters too).",
    )
    offload_optimizer_device: Literal["none", "cpu", "nvme"] = Field(
        default="none",
        description="Where optimizer states live and the optimizer steps: none (on the GPU), "
        "cpu (zero_stage 2 or 3) or nvme (zero_stage 3, under nvme_path).",
    )
    offload_param_device: Literal["none", "cpu", "nvme"] = Field(
        default="none",
        description="zero_stage 3 only: where parameters live between uses: none (on the "
        "GPU), cpu or nvme (under nvme_path).",
    )
    nvme_path: str | None = Field(default=None, description="Absolute path for NVMe offload.")
    zero3_init_flag: bool = Field(
        default=True,
        description="zero_stage 3: build the model already partitioned across ranks as it "
        "loads (deepspeed.zero.Init), so no rank holds it whole. Must be false with "
        "model.quantization.",
    )
    zero3_save_16bit_model: bool = Field(
        default=True,
        description="ZeRO-3: gather the weights for every save. ftune trains PEFT adapters, "
        "which the Trainer always gathers (trainable weights only), so false is refused.",
    )
    gradient_clipping: float | None = Field(
        default=None, ge=0, description="Default: training.max_grad_norm."
    )


class DistributedSpec(_Strict):
    strategy: Literal["none", "ddp", "fsdp", "deepspeed"] = Field(
        default="none",
        description="none (one process), ddp (data parallel: a whole copy of the model per "
        "process), fsdp (PyTorch FSDP: parameters, gradients and optimizer states sharded "
        "over the processes) or deepspeed (ZeRO).",
    )
    num_processes: int = Field(default=1, ge=1, le=1024, description="Processes in total.")
    num_machines: int = Field(
        default=1, ge=1, le=128,
        description="Machines (nodes) the processes are spread over; more than 1 runs on a "
        "SLURM pool, which picks the nodes and the main process address.",
    )
    machine_rank: int = Field(
        default=0,
        ge=0,
        description="This machine's rank among num_machines, for a run by hand; on SLURM "
        "each node gets its own (leave 0).",
    )
    main_process_ip: str | None = Field(
        default=None, max_length=255,
        description="Rendezvous address for a run by hand; on SLURM it is the allocation's "
        "first node (leave unset).",
    )
    main_process_port: int | None = Field(
        default=None,
        ge=1024,
        le=65535,
        description="Rendezvous port of the main process; default: a free port on one "
        "machine, 29500 over several.",
    )
    resume_on: list[Annotated[int, Field(ge=1, le=1024)]] | None = Field(
        default=None, max_length=16,
        description="Other process counts this job may continue on after a pause or a "
        "preemption, instead of waiting for its own slice: the scheduler starts it on the "
        "largest count (num_processes or one of these) that fits a worker's free GPUs now "
        "and over which its latest checkpoint's global batch splits (the per-device batch "
        "and accumulation are adapted, so the loss curve continues), and says so in a "
        "\"resized\" event. The choice holds for that attempt: the job keeps num_processes, "
        "and each later attempt chooses again. On 1 process a ddp job runs as strategy none. "
        "Default: none (the job waits for its own slice, or is resized through POST "
        "/v1/jobs/{id}/resume). Single-machine jobs under ddp, fsdp or deepspeed (a DeepSpeed "
        "checkpoint continues only on its own count).",
    )
    fsdp: FsdpSpec = Field(
        default_factory=FsdpSpec, description="FSDP options; strategy fsdp only."
    )
    deepspeed: DeepSpeedSpec = Field(
        default_factory=DeepSpeedSpec, description="DeepSpeed ZeRO options; strategy deepspeed only."
    )

    # Derived facts: the one definition every caller (scheduler, worker, SLURM, trainer,
    # estimate) uses, so none counts processes its own way.
    @property
    def processes(self) -> int:
        """Processes the job starts over all machines: strategy none runs one, whatever
        num_processes says."""
        return 1 if self.strategy == "none" else self.num_processes

    @property
    def processes_per_node(self) -> int:
        """Processes on each machine (the total split evenly; at least one)."""
        return max(1, self.processes // self.num_machines)

    def on(self, processes: int) -> DistributedSpec:
        """The layout of one run on ``processes`` processes (a resumed run the scheduler
        placed on another count, ``resume_on``): one ddp process runs as strategy none (ddp
        needs two; FSDP and DeepSpeed keep their options on one). The choice is made, so the
        run's layout has no ``resume_on``; the job's stored spec keeps it for later attempts."""
        strategy = "none" if self.strategy == "ddp" and processes == 1 else self.strategy
        return self.model_copy(update={"num_processes": processes, "strategy": strategy,
                                       "resume_on": None})

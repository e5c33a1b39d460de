"""Multi-machine admission: what a SLURM pool can run (core/policy/slurm.py)."""

from __future__ import annotations

from core.infra.errors import ErrorCode
from core.policy import SlurmPool, runs_on_slurm, slurm_pool_refusal
from core.spec import JobSpec
from tests.utils.specs import spec_body

CPU_POOL = SlurmPool("debug", max_nodes=2, gpus_per_node=0, cpus_per_node=2)
GPU_POOL = SlurmPool("gpu", max_nodes=4, gpus_per_node=8, cpus_per_node=64)


def spec(**dist: object) -> JobSpec:
    return JobSpec.model_validate(
        spec_body(dataset={"file_id": "file-x", "format": "text"}, distributed=dist))


def test_no_pool_refuses_several_machines_naming_the_field() -> None:
    r = slurm_pool_refusal(spec(strategy="ddp", num_processes=2, num_machines=2), None)
    assert r is not None and r.param == "distributed.num_machines"
    assert r.code == ErrorCode.unsupported_hardware


def test_no_pool_accepts_one_machine() -> None:
    assert slurm_pool_refusal(spec(strategy="ddp", num_processes=2), None) is None


def test_pool_accepts_up_to_its_nodes() -> None:
    assert slurm_pool_refusal(spec(strategy="ddp", num_processes=2, num_machines=2),
                              CPU_POOL) is None
    assert slurm_pool_refusal(spec(strategy="ddp", num_processes=32, num_machines=4),
                              GPU_POOL) is None


def test_more_nodes_than_the_partition_allows() -> None:
    r = slurm_pool_refusal(spec(strategy="ddp", num_processes=3, num_machines=3), CPU_POOL)
    assert r is not None and r.param == "distributed.num_machines"
    assert "at most 2 node(s)" in r.message


def test_more_processes_per_node_than_gpus_or_cpus() -> None:
    r = slurm_pool_refusal(spec(strategy="ddp", num_processes=18, num_machines=2), GPU_POOL)
    assert r is not None and r.param == "distributed.num_processes" and "8 GPU" in r.message
    r = slurm_pool_refusal(spec(strategy="ddp", num_processes=6, num_machines=2), CPU_POOL)
    assert r is not None and r.param == "distributed.num_processes" and "2 CPU" in r.message


def test_main_process_ip_is_slurms_to_choose() -> None:
    r = slurm_pool_refusal(spec(strategy="ddp", num_processes=2, num_machines=2,
                                main_process_ip="10.0.0.1"), CPU_POOL)
    assert r is not None and r.param == "distributed.main_process_ip"


def test_cpu_pool_applies_the_cpu_rules() -> None:
    r = slurm_pool_refusal(spec(strategy="fsdp", num_processes=2, num_machines=2,
                                fsdp={"version": 2}), CPU_POOL)
    assert r is not None and r.param == "distributed.strategy"


def test_single_node_jobs_go_to_slurm_only_when_the_operator_says_so() -> None:
    one = spec(strategy="ddp", num_processes=2)
    assert not runs_on_slurm(one, CPU_POOL)
    assert runs_on_slurm(one, SlurmPool("debug", 2, 0, 2, single_node=True))
    assert runs_on_slurm(spec(strategy="ddp", num_processes=2, num_machines=2), CPU_POOL)
    assert not runs_on_slurm(spec(strategy="ddp", num_processes=2, num_machines=2), None)

"""Strategy and process count for jobs that do not choose them."""

from __future__ import annotations

from core.policy.placement import GpuWorker, MemoryNeed, choose_placement

NEED = MemoryNeed(weights_mb=16_000, training_state_mb=40_000, activations_mb=4_000)


def test_the_catalog_gpu_count_wins() -> None:
    p = choose_placement(NEED, [GpuWorker(8, 80_000)], catalog_gpus=4)
    assert (p.strategy, p.num_processes) == ("fsdp", 4)


def test_a_cpu_fleet_runs_one_process() -> None:
    p = choose_placement(NEED, [GpuWorker(0, 0)])
    assert (p.strategy, p.num_processes) == ("none", 1)


def test_a_job_that_fits_one_gpu_is_not_sharded() -> None:
    p = choose_placement(NEED, [GpuWorker(8, 80_000)])
    assert (p.strategy, p.num_processes) == ("none", 1)


def test_a_job_too_big_for_one_gpu_is_sharded_over_the_fewest_that_fit() -> None:
    # 56,000 / n + 4,000 <= 0.85 * 24,000 = 20,400  ->  n = 4
    p = choose_placement(NEED, [GpuWorker(8, 24_000), GpuWorker(2, 40_000)])
    assert (p.strategy, p.num_processes) == ("fsdp", 2)  # 2 x 40 GB: 32,000 <= 34,000
    p = choose_placement(NEED, [GpuWorker(8, 24_000)])
    assert (p.strategy, p.num_processes) == ("fsdp", 4)
    assert "FSDP over 4" in p.reason


def test_a_job_that_fits_nowhere_says_so() -> None:
    p = choose_placement(NEED, [GpuWorker(2, 16_000)])
    assert (p.strategy, p.num_processes) == ("none", 1) and "fits no worker" in p.reason

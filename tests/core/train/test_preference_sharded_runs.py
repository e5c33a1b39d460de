"""DPO (TRL) under DDP, DeepSpeed ZeRO-3 and FSDP2 (the CPU route, runtime.cpu_fsdp2), each on
two CPU processes launched as the worker launches them.

The reference pass runs through the same wrapped model with the adapter disabled, so under
ZeRO-3 and FSDP2 it gathers the same shards as the policy pass. All the runs see the same
data in the same order on each rank, so they must log the same losses and rewards and save
the same adapter as DDP: that is what proves the sharded reference pass is right. ZeRO-1 and
2 shard no parameter (only optimizer state and gradients), so their reference pass is DDP's
and is not run here (one launch of two ranks fewer); DeepSpeed's DPO engine is ZeRO-3's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.utils.adapters import assert_loads, assert_same_adapter
from tests.utils.jobdirs import events, launch, losses, make_job, of_type
from tests.utils.tiny import preference_rows

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason="deepspeed is not installed (extra: deepspeed)",
    ),
]

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp", "num_processes": 2},
    "zero3": {"strategy": "deepspeed", "num_processes": 2, "deepspeed": {"zero_stage": 3}},
    "fsdp2": {
        "strategy": "fsdp",
        "num_processes": 2,
        "fsdp": {"version": 2, "cpu_ram_efficient_loading": False},
    },
}


def dpo_job(root: Path, model: Path, distributed: dict[str, Any]) -> Path:
    return make_job(
        root,
        model,
        preference_rows(32),
        spec={
            "dataset": {"format": "preference"},
            "training": {
                "objective": "dpo",
                "max_steps": 4,
                "logging_steps": 1,
                "save_steps": 4,
                "learning_rate": 1e-2,
            },
            "distributed": distributed,
        },
        runtime={"cpu_fsdp2": distributed["strategy"] == "fsdp"},
    )


@pytest.fixture(scope="module")
def runs(
    tiny_causal_lm: Path,
    tmp_path_factory: pytest.TempPathFactory,
    cpu_adam: float,  # DeepSpeed's op, built once outside the run's timeout (conftest.py)
) -> dict[str, Path]:
    out = {}
    for name, distributed in STRATEGIES.items():
        job = dpo_job(tmp_path_factory.mktemp(name), tiny_causal_lm, distributed)
        launch(job, timeout=600)
        out[name] = job
    return out


@pytest.mark.parametrize("name", ["zero3", "fsdp2"])
def test_sharded_dpo_trains_like_ddp(name: str, runs: dict[str, Path], tiny_causal_lm: Path) -> None:
    job, ddp = runs[name], runs["ddp"]
    (started,) = of_type(events(job), "started")
    assert (started["objective"], started["world_size"]) == ("dpo", 2)
    assert started["strategy"] == STRATEGIES[name]["strategy"]
    if name == "fsdp2":
        assert started["fsdp_sharded_params"] > 0 and started["fsdp_unsharded_params"] == 0
    else:
        assert started["zero_stage"] == STRATEGIES[name]["deepspeed"]["zero_stage"]
    want, got = losses(events(ddp)), losses(events(job))
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step
    margins = {e["step"]: e["reward_margin"] for e in of_type(events(job), "progress") if "loss" in e}
    assert margins[4] > margins[1]  # the preference is being learned
    assert_same_adapter(job / "adapter", ddp / "adapter")
    assert_loads(tiny_causal_lm, job / "adapter")

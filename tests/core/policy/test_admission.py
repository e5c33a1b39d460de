"""core.policy.admission: each refusal is raised at the earliest stage that has its facts
(spec and operator rules at submit, the GPUs a run holds at claim, CUDA and bf16 at
preflight), and again at every later stage that has them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.infra.settings import Settings
from core.policy import admission
from core.policy.admission import Device, Installed, Machine, Stage
from core.policy.fleet import Inventory
from core.spec import JobSpec
from tests.utils.specs import parsed_spec

EVERYTHING = Installed(bitsandbytes=True, trl=True)
BIG_GPU_WORKER = Inventory("w-8", gpus=8, capabilities={"bf16": True, "flash_attn": True})


def spec(**sections: Any) -> JobSpec:
    return parsed_spec(**sections)


def settings(tmp_path: Path, **over: Any) -> Settings:
    return Settings(data_dir=tmp_path, **over)


def refused_at(s: JobSpec, cfg: Settings, *, gpus: int = 8, cuda: bool = True,
               bf16_ok: bool = True, installed: Installed = EVERYTHING,
               fleet: tuple[Inventory, ...] = (BIG_GPU_WORKER,)) -> dict[Stage, list[str]]:
    """The params each stage refuses for ``s``: submit to ``fleet``, claimed with ``gpus``,
    started where torch sees ``cuda`` / ``bf16_ok``."""
    device: Device = Device("cuda" if gpus else "cpu", cuda_available=cuda, bf16_ok=bf16_ok)
    found = {
        Stage.submit: admission.submit(s, settings=cfg, tenant="acme", inventories=fleet,
                                       pool=None),
        Stage.claim: admission.claim(s, settings=cfg, machine=Machine(gpus),
                                     installed=installed),
        Stage.preflight: admission.preflight(s, allow_remote_code=cfg.allow_trust_remote_code,
                                             device=device, installed=installed),
    }
    return {stage: [r.param for r in rs] for stage, rs in found.items()}


def test_each_rule_is_first_checked_where_its_facts_are() -> None:
    earliest = {rule.name: rule.earliest for rule in admission.RULES}
    assert earliest == {
        "priority_bound": Stage.submit,
        "remote_code": Stage.submit,
        "tracking": Stage.submit,
        "graders": Stage.submit,
        "fleet": Stage.submit,
        "memory_fit": Stage.submit,
        "machine": Stage.claim,
        "packages": Stage.claim,
        "device": Stage.preflight,
    }


def test_remote_code_is_refused_at_every_stage(tmp_path: Path) -> None:
    s = spec(model={"name_or_path": "org/m", "trust_remote_code": True})
    got = refused_at(s, settings(tmp_path))
    assert all(got[stage] == ["model.trust_remote_code"] for stage in Stage), got


def test_an_untracked_tracker_is_refused_at_submit_and_claim(tmp_path: Path) -> None:
    got = refused_at(spec(tracking={"report_to": ["wandb"]}), settings(tmp_path))
    assert got == {Stage.submit: ["tracking.report_to"], Stage.claim: ["tracking.report_to"],
                   Stage.preflight: []}


def test_the_tenant_priority_bound_is_a_submit_rule(tmp_path: Path) -> None:
    cfg = settings(tmp_path, tenant_limits={"acme": {"max_priority": 5}})
    got = refused_at(spec(priority=9), cfg)
    assert got == {Stage.submit: ["priority"], Stage.claim: [], Stage.preflight: []}


def test_a_job_larger_than_the_fleet_is_refused_at_submit(tmp_path: Path) -> None:
    s = spec(distributed={"strategy": "ddp", "num_processes": 16})
    got = refused_at(s, settings(tmp_path), gpus=16)
    assert got[Stage.submit] == ["distributed.num_processes"]


def test_the_gpus_a_run_holds_are_checked_at_claim(tmp_path: Path) -> None:
    # The fleet has an 8-GPU worker, so submit admits it; the claim holds 2 GPUs.
    s = spec(distributed={"strategy": "ddp", "num_processes": 4})
    got = refused_at(s, settings(tmp_path), gpus=2)
    assert got == {Stage.submit: [], Stage.claim: ["distributed.num_processes"],
                   Stage.preflight: []}


def test_a_missing_package_is_refused_at_claim_and_preflight(tmp_path: Path) -> None:
    s = spec(training={"objective": "dpo"}, dataset={"path": "/d", "format": "preference"})
    got = refused_at(s, settings(tmp_path), installed=Installed(bitsandbytes=True, trl=False))
    assert got == {Stage.submit: [], Stage.claim: ["training.objective"],
                   Stage.preflight: ["training.objective"]}


@pytest.mark.parametrize(("cuda", "bf16_ok", "param"), [
    (True, False, "training.mixed_precision"),  # a pre-Ampere GPU
    (False, True, "runtime.device"),  # resolved for cuda, started where none is visible
])
def test_what_torch_sees_is_checked_at_preflight(
    tmp_path: Path, cuda: bool, bf16_ok: bool, param: str
) -> None:
    got = refused_at(spec(training={"mixed_precision": "bf16"}), settings(tmp_path),
                     gpus=1, cuda=cuda, bf16_ok=bf16_ok)
    assert got == {Stage.submit: [], Stage.claim: [], Stage.preflight: [param]}


def test_a_stage_must_be_given_all_its_facts() -> None:
    with pytest.raises(AssertionError, match="machine"):
        admission.check(Stage.claim, spec(), admission.Facts(
            settings=Settings(), allow_remote_code=False, installed=EVERYTHING))

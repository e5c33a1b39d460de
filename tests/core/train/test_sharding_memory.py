"""Memory per phase (load, train, eval, save) and per rank.

* Two real DDP processes (gloo, CPU) launched as the worker launches them: every rank's
  figures reach events.jsonl (rank 0 writes them after one all_gather_object per phase end),
  evaluation inside training is its own "eval" phase, and the worker's monitor folds them
  into job.memory (one entry per phase and rank) and job.peak_memory_mb.
* In-process: nested phases keep the outer phase's GPU peak although CUDA has one peak
  counter per process (a fake CUDA counter stands in for the GPU here).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.train.events import EventLog, MemoryPhase, measure_calls
from tests.utils.jobdirs import events, launch, make_job, of_type
from tests.utils.tiny import text_rows

PHASES = ("load", "train", "eval", "save")


@pytest.mark.e2e
def test_two_process_ddp_reports_memory_of_both_ranks_per_phase(
    tiny_causal_lm: Path, tmp_path: Path
) -> None:
    job = make_job(
        tmp_path,
        tiny_causal_lm,
        text_rows(64),
        spec={
            "dataset": {"eval_split": 0.25},
            "training": {"max_steps": 6, "eval_steps": 3, "save_steps": 6},
            "distributed": {"strategy": "ddp", "num_processes": 2},
        },
    )
    launch(job)  # as the worker launches it; asserts a clean exit

    evs = events(job)
    (started,) = of_type(evs, "started")
    assert (started["strategy"], started["world_size"]) == ("ddp", 2)
    mem = of_type(evs, "memory")
    assert {(m["phase"], m["rank"]) for m in mem} == {(p, r) for p in PHASES for r in (0, 1)}
    # One eval phase per evaluation, on both ranks, tagged with its step.
    assert sorted((m["step"], m["rank"]) for m in mem if m["phase"] == "eval") == [
        (3, 0),
        (3, 1),
        (6, 0),
        (6, 1),
    ]
    for m in mem:
        assert 0 < m["cpu_mb_begin"] <= m["cpu_mb_peak"], m
        assert m["cpu_mb_end"] <= m["cpu_mb_peak"], m
        assert "gpu_mb_peak" not in m  # no CUDA here: no made-up GPU figures
    # Each phase has exactly one record per rank (gathered, not duplicated from rank 0).
    assert len(mem) == len({(m["phase"], m.get("step"), m["rank"]) for m in mem})

    from core.db.models import Job
    from worker.run.ingest import _fold

    # A transient row: _fold reads only the columns it merges into.
    values = _fold(Job(), evs)
    keys = set(values["memory"])
    assert keys == {p for p in PHASES} | {f"{p}/rank1" for p in PHASES}
    assert values["memory"]["train/rank1"]["rank"] == 1
    assert values["peak_memory_mb"] == max(m["cpu_mb_peak"] for m in mem)


class _FakeCuda:
    """torch.cuda's allocator counters, driven by hand."""

    def __init__(self) -> None:
        self.allocated = 0.0
        self.peak = 0.0

    def alloc(self, mb: float) -> None:
        self.allocated += mb
        self.peak = max(self.peak, self.allocated)

    def free(self, mb: float) -> None:
        self.allocated -= mb

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        mib = 2**20
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated * mib)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak * mib)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: self.peak * mib)

        def reset(*a: Any) -> None:
            self.peak = self.allocated

        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)


def _memory(path: Path) -> dict[str, dict[str, Any]]:
    out = {}
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if e["type"] == "memory":
            out[e["phase"]] = e
    return out


def test_a_nested_phase_does_not_hide_the_outer_phases_gpu_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    log = EventLog(tmp_path / "events.jsonl", enabled=True)
    with MemoryPhase(log, "train"):
        cuda.alloc(1000)  # the training peak, before the first evaluation
        cuda.free(900)
        with MemoryPhase(log, "eval", fields={"step": 3}):  # resets the CUDA peak counter
            cuda.alloc(200)
            cuda.free(200)
        cuda.alloc(50)
    mem = _memory(tmp_path / "events.jsonl")
    assert mem["eval"]["gpu_mb_peak"] == 300 and mem["eval"]["step"] == 3
    assert mem["eval"]["gpu_mb_begin"] == 100
    assert mem["train"]["gpu_mb_peak"] == 1000  # not 300: banked before the reset
    assert mem["train"]["gpu_mb_end"] == 150


def test_measure_calls_turns_each_call_into_a_phase(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "events.jsonl", enabled=True)
    obj = SimpleNamespace(state=SimpleNamespace(global_step=7), evaluate=lambda: {"loss": 1.0})
    measure_calls(obj, "evaluate", log, "eval")
    assert obj.evaluate() == {"loss": 1.0}
    mem = _memory(tmp_path / "events.jsonl")
    assert mem["eval"]["step"] == 7 and mem["eval"]["rank"] == 0

"""What the benchmarks share: a Llama of a chosen shape built offline, a job directory's run
plan written through ``RunPlan`` (the class the worker writes and the trainer reads, so a
benchmark's spec.json cannot drift from the real one), ``python -m core.train`` run on it,
and the CPU seconds a run cost (a figure that load from other processes inflates far less
than wall time on a shared machine).
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cli.demo_assets import build_tokenizer, tiny_llama_config
from core.run.jobdir import read_events
from core.run.plan import RunPlan, Runtime
from testkit.launch import REPO_ROOT, trainer_env


def llama_shape(hidden: int, layers: int, *, intermediate: int | None = None,
                heads: int | None = None, kv_heads: int | None = None) -> dict[str, Any]:
    """Config fields for a Llama ``hidden`` wide and ``layers`` deep: heads of 64, half as
    many key/value heads (GQA), an MLP 4 x hidden unless ``intermediate`` says."""
    heads = heads or max(1, hidden // 64)
    return {
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": intermediate or hidden * 4,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or max(1, hidden // 128),
    }


def llama(out: Path, *, tokenizer_vocab: int = 256, seed: int = 0, device: str = "cpu",
          dtype: Any = None, **config: Any) -> Path:
    """A Llama with random weights (seeded) and the repository's BPE tokenizer, saved to
    ``out``: the tests' tiny shape (cli/demo_assets.py) with ``config`` fields over it
    (``llama_shape(...)`` for a size; ``vocab_size`` for a head wider than the tokenizer's
    ids). Built on ``device``, saved in ``dtype`` (default: float32)."""
    import torch
    from transformers import LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, vocab_size=tokenizer_vocab)
    cfg = tiny_llama_config(**{
        "vocab_size": len(tok),
        "max_position_embeddings": 512,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "tie_word_embeddings": False,
        **config,
    })
    torch.manual_seed(seed)
    with torch.device(device):
        model: Any = LlamaForCausalLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(out)
    return out


def write_plan(job: Path, spec: dict[str, Any], *, model: Path | str, train: Path,
               device: Literal["cpu", "cuda"] = "cpu", **runtime: Any) -> RunPlan:
    """spec.json in ``job`` (made if missing) as the worker writes it: ``spec`` parsed as a
    JobSpec, ``runtime`` fields over the defaults (the job id: bench-<folder name>)."""
    job.mkdir(parents=True, exist_ok=True)
    runtime.setdefault("job_id", f"bench-{job.name}")
    plan = RunPlan.model_validate({
        "spec": spec,
        "runtime": Runtime(model_path=str(model), train_path=train, device=device,
                           **runtime).model_dump(exclude_unset=True),
    })
    plan.write(job / "spec.json")
    return plan


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the children it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), \
        resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@dataclass
class Run:
    """One ``python -m core.train`` run: its exit code, stderr, wall and CPU seconds (the
    trainer's, all its processes), and the events it wrote."""

    returncode: int
    stderr: str
    wall_seconds: float
    cpu_seconds: float
    events: list[dict[str, Any]] = field(default_factory=list)

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]


def run_trainer(job: Path, *, argv: list[str] | None = None,
                env: dict[str, str] | None = None) -> Run:
    """The trainer on ``job``: ``python -m core.train <job>`` unless ``argv`` (an
    ``accelerate launch``, testkit/launch.py) says otherwise; offline, the repository
    importable."""
    argv = argv or [sys.executable, "-m", "core.train", str(job)]
    cpu0, t0 = _children_cpu(), time.monotonic()
    proc = subprocess.run(argv, cwd=REPO_ROOT, env=env or trainer_env(), capture_output=True,
                          text=True, check=False)
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    events = [e for _, e in read_events(job / "events.jsonl")]
    return Run(proc.returncode, proc.stderr, wall, cpu, events)


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime

"""One sharding configuration as a fine-tuning job, run exactly as the worker runs it
(bench/sharding.py says which and why): its ``distributed`` section, its job directory's run
plan, ``accelerate launch -m core.train`` through testkit/launch.py, an optional resume on
another process count, and the figures read back from the job's events and memory probe.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.harness import write_plan
from core.run.jobdir import read_events
from core.train.probe import PROBE_ENV
from testkit.build_ops import VENV_EXTENSIONS
from testkit.launch import REPO_ROOT, trainer_env, write_launch_files

CONFIGS = ("ddp", "fsdp2", "fsdp2_cre", "zero2", "zero3", "zero3_local", "fsdp1", "fsdp2_offload")


GPU_ONLY = {"fsdp1", "fsdp2_offload"}


def distributed(name: str, processes: int) -> dict[str, Any]:
    if name == "ddp":
        if processes < 2:
            return {"strategy": "none"}
        return {"strategy": "ddp", "num_processes": processes}
    if name == "zero2":
        zero = {"zero_stage": 2, "offload_optimizer_device": "cpu"}
        return {"strategy": "deepspeed", "num_processes": processes, "deepspeed": zero}
    if name == "zero3":
        zero = {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}
        return {"strategy": "deepspeed", "num_processes": processes, "deepspeed": zero}
    if name == "zero3_local":
        # No offload: on CPU the partitions already live in the memory offload would move
        # them to, and DeepSpeed's offload path always clones an fp32 master partition
        # (stage3.py _create_fp32_partitions), while without it a float32 partition on the
        # optimizer's device is its own master.
        zero = {"zero_stage": 3}
        return {"strategy": "deepspeed", "num_processes": processes, "deepspeed": zero}
    if name == "fsdp1":
        fsdp = {"version": 1, "sharding_strategy": "FULL_SHARD", "offload_params": True}
        return {"strategy": "fsdp", "num_processes": processes, "fsdp": fsdp}
    if name in ("fsdp2", "fsdp2_cre", "fsdp2_offload"):
        fsdp = {
            "version": 2,
            "sharding_strategy": "FULL_SHARD",
            "offload_params": name == "fsdp2_offload",
            "cpu_ram_efficient_loading": name == "fsdp2_cre",
        }
        return {"strategy": "fsdp", "num_processes": processes, "fsdp": fsdp}
    raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")


def make_job(
    root: Path,
    model: Path,
    train: Path,
    dist: dict[str, Any],
    args: argparse.Namespace,
    *,
    steps: int | None = None,
    resume: Path | None = None,
) -> Path:
    job = root / "job"
    steps = steps or args.steps
    spec = {
        "model": {"name_or_path": str(model), "task": "causal_lm", "dtype": "float32"},
        "dataset": {"path": str(train), "format": "text", "max_seq_length": args.seq_len},
        "peft": {"method": "full"} if args.method == "full" else {
            "method": "lora",
            "r": 16,
            "lora_alpha": 32,
            "lora_dropout": 0.0,
            "target_modules": "all-linear",
        },
        "training": {
            "max_steps": steps,
            "learning_rate": 1e-5 if args.method == "full" else 1e-4,
            "per_device_train_batch_size": args.batch,
            "logging_steps": max(1, steps // 5),
            "save_steps": args.steps,  # one checkpoint at the end of the first run
            "mixed_precision": "bf16" if args.device == "cuda" else "no",
            "seed": 0,
        },
        "distributed": dist,
    }
    write_plan(job, spec, model=model, train=train, device=args.device,
               job_id=f"bench-{root.name}", resume_from_checkpoint=resume,
               cpu_fsdp2=args.device == "cpu")  # as a worker with FTUNE_CPU_FSDP2 writes it
    return job


def run_config(name: str, args: argparse.Namespace, model: Path, train: Path, work: Path) -> dict:
    result: dict[str, Any] = {"config": name}
    if name in GPU_ONLY and args.device != "cuda":
        result.update(
            status="skipped",
            note="GPU only: FSDP1 cannot save a consolidated adapter on CPU, and offloading "
            "parameters to CPU means nothing there; run `python -m bench.sharding --gpu`",
        )
        return result
    dist = distributed(name, args.processes)
    result["distributed"] = dist
    job = make_job(work / name, model, train, dist, args)
    result.update(launch(job, args))
    if result["status"] == "ok" and args.resume:
        result["resume"] = resume_elsewhere(name, job, args, model, train, work)
    return result


def resume_elsewhere(
    name: str, source: Path, args: argparse.Namespace, model: Path, train: Path, work: Path
) -> dict[str, Any]:
    """Resume the run's final checkpoint on another process count (1 <-> N; strategy none on
    one process, DeepSpeed on DeepSpeed through its universal checkpoint) for 2 more steps:
    how long its save took (of which the downloadable full model, model/), how long the
    resharding load took (DCP: ``resume_load_seconds``; DeepSpeed: the universal conversion,
    as its engine loads inside ``trainer.train``), how long the resumed launch took to its
    first step against the original run's (``startup_seconds``: process start, model load,
    conversion and state load), and whether the steps went on."""
    ckpt = source / "checkpoints" / f"checkpoint-{args.steps}"
    evs = [e for _, e in read_events(source / "events.jsonl")]
    saved = next((e for e in evs if e["type"] == "checkpoint"), {})
    if name.startswith("zero") and args.processes > 1:
        dist, note = distributed(name, 1), f"{args.processes} -> 1 (universal)"
    elif name.startswith("zero"):
        dist, note = distributed(name, 2), "1 -> 2 (universal)"
    elif args.processes > 1:
        dist, note = {"strategy": "none"}, f"{args.processes} -> 1"
    else:
        dist, note = distributed(name, 2), "1 -> 2"
    job = make_job(work / f"{name}-resumed", model, train, dist, args,
                   steps=args.steps + 2, resume=ckpt)  # fmt: skip
    r = launch(job, args)
    out: dict[str, Any] = {"to": note, "status": r["status"],
                           "save_seconds": saved.get("save_seconds"),
                           "model_save_seconds": saved.get("model_save_seconds"),
                           "checkpoint_mb": round(_dir_bytes(ckpt) / 2**20, 2)}  # fmt: skip
    if r["status"] == "ok":
        started = next(e for e in r["events"] if e["type"] == "started")
        out.update(
            load_seconds=started.get("resume_load_seconds"),
            universal_seconds=started.get("universal_checkpoint_seconds"),
            startup_seconds=r.get("startup_seconds"),
            initial_step=started.get("initial_step"),
            wall_seconds=r["wall_seconds"],
            gradient_accumulation_steps=started.get("gradient_accumulation_steps"),
        )
    else:
        out["error"] = r.get("error")
    return out


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def launch(job: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run one job as the worker does; its status, wall time and events."""
    result: dict[str, Any] = {}
    world = json.loads((job / "spec.json").read_text())["spec"]["distributed"]
    threads = max(1, (os.cpu_count() or 1) // max(1, world.get("num_processes", 1)))
    # core/train/probe.py: each rank's held bytes at its optimizer steps and its final save.
    probe = job / "probe"
    env = {**trainer_env(), "OMP_NUM_THREADS": str(threads), PROBE_ENV: str(probe)}
    # DeepSpeed's CPU ops where the tests build them (testkit/build_ops.py).
    env.setdefault("TORCH_EXTENSIONS_DIR", VENV_EXTENSIONS)
    argv, env = write_launch_files(job, device=args.device, env=env)
    t0, epoch0 = time.monotonic(), time.time()
    log = (job / "trainer.log").open("w")
    try:
        proc = subprocess.run(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=args.timeout,
            check=False,
        )
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    finally:
        log.close()
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    return read_result(job, rc, epoch0, result)


def read_result(
    job: Path, rc: int | str, epoch0: float, result: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A finished launch's figures from its job directory (``epoch0``: when it started)."""
    result = {} if result is None else result
    result["job_dir"] = str(job)
    probe = job / "probe"
    evs = (
        [e for _, e in read_events(job / "events.jsonl")] if (job / "events.jsonl").exists() else []
    )
    result["events"] = evs
    if rc != 0:
        err = job / "error.json"
        message = json.loads(err.read_text()).get("message") if err.exists() else None
        tail = (job / "trainer.log").read_text()[-1500:]
        result.update(status="failed", returncode=rc, error=message, log_tail=tail)
        return result
    result["status"] = "ok"
    started = next((e for e in evs if e["type"] == "started"), {})
    # Launch to the first step: what a resume on another count adds shows against the
    # original run's figure (same model, same machine).
    result["startup_seconds"] = round(started["time"] - epoch0, 1) if started else None
    result["world_size"] = started.get("world_size")
    result["total_params"] = started.get("total_params")
    result["trainable_params"] = started.get("trainable_params")
    result["strategy_in_effect"] = {
        k: started.get(k)
        for k in (
            "strategy",
            "distributed_type",
            "zero_stage",
            "offload_optimizer_device",
            "offload_param_device",
            "params_partitioned_at_load",
            "fsdp_version",
            "fsdp_offload_params",
            "process_group_backend",
        )
        if k in started
    }
    progress = [e for e in evs if e["type"] == "progress"]
    finished = next((e for e in evs if e["type"] == "finished"), {})
    result["steps"] = finished.get("step")
    result["tokens_per_second"] = progress[-1].get("tokens_per_second") if progress else None
    result["tokens_seen"] = progress[-1].get("tokens_seen") if progress else None
    result["train_loss"] = finished.get("train_loss")
    per_rank: dict[int, dict[str, Any]] = {}
    for m in (e for e in evs if e["type"] == "memory"):
        r = per_rank.setdefault(int(m["rank"]), {"phases": {}})
        r["phases"][m["phase"]] = {k: v for k, v in m.items() if k not in ("type", "time")}
        for key in ("cpu_mb_peak", "gpu_mb_peak", "gpu_mb_reserved_peak"):
            if m.get(key) is not None:
                r[key] = max(r.get(key, 0.0), m[key])
    for rank, mb in enumerate(started.get("param_mb_per_rank") or []):
        per_rank.setdefault(rank, {"phases": {}})["param_mb"] = mb
    for rank, r in per_rank.items():
        r["optimizer_mb"] = r["phases"].get("train", {}).get("optimizer_mb")
        r["weights_read_mb"] = r["phases"].get("load", {}).get("weights_read_mb")
        r["load_cpu_mb_end"] = r["phases"].get("load", {}).get("cpu_mb_end")
    for path in sorted(probe.glob("held-rank*.json")):
        got = json.loads(path.read_text())
        r = per_rank.setdefault(int(got["rank"]), {"phases": {}})
        r["held"], r["held_step"], r["save"] = got.get("held"), got.get("held_step"), got.get("save")
        r["held_named"], r["held_shared"] = got.get("named"), got.get("shared")
    result["per_rank"] = {str(k): per_rank[k] for k in sorted(per_rank)}
    save_phase = [e for e in evs if e["type"] == "memory" and e["phase"] == "save"]
    result["final_save_seconds"] = max((e["seconds"] for e in save_phase), default=None)
    saved = next((e for e in evs if e["type"] == "checkpoint"), {})
    result["save_seconds"] = saved.get("save_seconds")
    result["model_save_seconds"] = saved.get("model_save_seconds")
    return result

"""Memory and throughput per sharding strategy, through the real job path.

Usage:
    python -m bench.sharding                  # CPU here: ddp, fsdp2, fsdp2_cre, zero2, zero3
    python -m bench.sharding --gpu            # a GPU machine: every configuration
    python -m bench.sharding --configs zero3,fsdp2 --steps 40 --processes 2
    python -m bench.sharding --method full --steps 2 --resume   # full fine-tuning (issue 22)

Each configuration is one fine-tuning job (LoRA on a small Llama built offline, text rows)
run exactly as the worker runs it: spec.json, the accelerate YAML from
``worker.run.accelerate_config.accelerate_config`` plus ``launch_env``, and
``accelerate launch -m core.train <job_dir>`` (testkit/launch.py, as the trainer tests). The figures come from the job's own
events.jsonl: the per-rank "memory" events of every phase (load, train, eval, save) and the
trainer's tokens/s (non-padding input tokens of all ranks over training wall time).

Configurations:
    ddp            DistributedDataParallel (one process: strategy none, as DDP needs two)
    fsdp2          FSDP2 fully_shard, FULL_SHARD, every rank reads the weights
    fsdp2_cre      the same with cpu_ram_efficient_loading: rank 0 reads, broadcasts shards
    zero2          DeepSpeed ZeRO-2, optimizer state offloaded to CPU
    zero3          DeepSpeed ZeRO-3, optimizer state and parameters offloaded to CPU
    zero3_local    DeepSpeed ZeRO-3 without offload (on CPU: what FSDP2 is compared as)
    fsdp1          FSDP1 FULL_SHARD with parameter offload (CPUOffload)        GPU only
    fsdp2_offload  FSDP2 with parameter offload (CPUOffloadPolicy)               GPU only

On CPU, FSDP2 runs over gloo as a worker with FTUNE_CPU_FSDP2 runs it (runtime.cpu_fsdp2);
FSDP1 and parameter offload (to the memory the parameters are already in) are skipped. On a
GPU machine the number of processes defaults to the number of GPUs (at most 2); with one
GPU, ddp runs as strategy none and FSDP/ZeRO shard over one rank (what they still buy there
is the offload). The first DeepSpeed run on a machine compiles the cpu_adam op (minutes).

Per rank: parameter MB held after the model was prepared (a shard under FSDP2 / ZeRO-3),
optimizer state MB after training, weights read from disk at load, CPU RSS peak, GPU peak.

--method full (every weight trained; ddp, fsdp2, zero3_local and zero3 on a ~142M-parameter
Llama 1024x12) adds, from the trainer's memory probe (core/train/probe.py,
FTUNE_MEMORY_PROBE): the bytes of parameters, gradients, optimizer state and the wrapper's
own buffers each rank holds after an optimizer step, counted from the tensors (ratio to
DDP's; target <= 0.55), and the same bytes by the attribute that holds them (which buffer
is what, and which names only held views of storage already counted); the final save's
resident-memory growth per rank (exact peak) against 1/world of the model plus its largest
layer; tokens/s against DDP's in the same run; with --resume, the checkpoint's save time (of
which its downloadable model/) and a resume on another process count (DeepSpeed through its
universal checkpoint), with launch-to-first-step seconds against the original run's.

Prints a table and writes bench/results/sharding-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from bench.harness import llama, llama_shape, write_plan
from bench.record import write_record
from core.run.jobdir import read_events
from core.train.probe import CATEGORIES, PROBE_ENV
from testkit.build_ops import VENV_EXTENSIONS
from testkit.launch import trainer_env, write_launch_files

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


def build_model(out: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A Llama of the given size (at least 4 heads, an MLP 11/4 x hidden) with random
    weights and a locally trained tokenizer; kept in ``out`` for the next configuration."""
    if (out / "config.json").is_file():
        return out
    heads = max(4, hidden // 64)
    return llama(out, seed=seed, tokenizer_vocab=2048, max_position_embeddings=2048,
                 **llama_shape(hidden, layers, intermediate=hidden * 11 // 4, heads=heads,
                               kv_heads=max(1, heads // 2)))


def size_facts(sizes: list[tuple[str, int]]) -> dict[str, Any]:
    """Bytes of a model's tensors (name, bytes), of its largest tensor and of its largest
    layer: a decoder block (every tensor under one ``...layers.<i>.``), or a tensor outside
    the blocks (an embedding, the LM head) when that is larger."""
    layers: dict[str, int] = {}
    for name, n in sizes:
        m = re.match(r"(.*\.layers\.\d+)\.", name)
        key = m.group(1) if m else name
        layers[key] = layers.get(key, 0) + n
    largest = max(layers, key=lambda k: layers[k]) if layers else None
    return {
        "model_bytes": sum(n for _, n in sizes),
        "largest_tensor_bytes": max((n for _, n in sizes), default=0),
        "largest_layer": largest,
        "largest_layer_bytes": layers.get(largest, 0) if largest else 0,
    }


def model_facts(model_dir: Path, dtype_bytes: int = 4) -> dict[str, Any]:
    """size_facts of the saved model (float32 here), from a meta-device copy (no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sizes = [(n, p.numel() * dtype_bytes) for n, p in model.named_parameters()]
    return {"parameters": sum(p.numel() for p in model.parameters()), **size_facts(sizes)}


def save_target(facts: dict[str, Any], world: int) -> int:
    """Issue 22's bound on the final save's memory growth per rank, before overhead: its
    1/world of the model plus the model's largest layer."""
    return int(facts["model_bytes"] / max(1, world) + facts["largest_layer_bytes"])


def held_total(held: dict[str, int] | None, with_buffers: bool = False) -> int | None:
    """Parameter + gradient + optimizer-state bytes (and the wrapper's buffers, if asked)."""
    if not held:
        return None
    keys = CATEGORIES if with_buffers else ("params", "grads", "optimizer")
    return sum(int(held.get(k, 0)) for k in keys)


def write_rows(path: Path, n: int) -> Path:
    from cli.demo_assets import sentences

    path.parent.mkdir(parents=True, exist_ok=True)
    words = sentences(n * 8, seed=3)
    with path.open("w") as f:
        for i in range(n):  # ~8 sentences (~100 tokens) per row
            f.write(json.dumps({"text": " ".join(words[i * 8 : (i + 1) * 8])}) + "\n")
    return path


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
            cwd=REPO,
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


def environment_of(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "device": device,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    for pkg in ("accelerate", "transformers", "peft", "deepspeed"):
        try:
            info[pkg] = __import__(pkg).__version__
        except ImportError:  # deepspeed is optional
            info[pkg] = None
    return info


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(results: list[dict]) -> str:
    head = (
        f"{'config':<13} {'world':>5} {'rank':>4} {'param MB':>9} {'optim MB':>9} "
        f"{'read MB':>8} {'load RSS':>8} {'cpu peak MB':>11} {'gpu peak MB':>11} "
        f"{'tokens/s':>9} {'wall s':>7}  status"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        if r["status"] != "ok":
            note = r.get("note") or r.get("error") or f"rc {r.get('returncode')}"
            lines.append(
                f"{r['config']:<13} {'':>5} {'':>4} {'':>9} {'':>9} {'':>8} {'':>8} {'':>11} "
                f"{'':>11} {'':>9} {r.get('wall_seconds', ''):>7}  {r['status']}: {note}"
            )
            continue
        for i, (rank, m) in enumerate(r["per_rank"].items()):
            gpu = m.get("gpu_mb_peak")
            tps = r["tokens_per_second"] if i == 0 else ""
            wall = r["wall_seconds"] if i == 0 else ""
            lines.append(
                f"{r['config'] if i == 0 else '':<13} {r['world_size'] if i == 0 else '':>5} "
                f"{rank:>4} {_mb(m.get('param_mb')):>9} {_mb(m.get('optimizer_mb')):>9} "
                f"{_mb(m.get('weights_read_mb')):>8} {_mb(m.get('load_cpu_mb_end')):>8} "
                f"{m.get('cpu_mb_peak', 0):>11.1f} "
                f"{'-' if gpu is None else f'{gpu:.1f}':>11} {tps:>9} {wall:>7}  "
                f"{'ok' if i == 0 else ''}"
            )
    resumed = [r for r in results if r.get("resume")]
    if resumed:
        lines += ["", ("checkpoint save (s: all files, of which model/: the downloadable full "
                       "model) and resume on another process count (load s: DCP reshard, or "
                       "DeepSpeed's universal conversion; to step 1 s: launch to the first step, "
                       "resumed run / original run)"),
                  (f"{'config':<13} {'checkpoint MB':>13} {'save s':>7} {'model/ s':>8} "
                   f"{'resume on':>22} {'load s':>7} {'to step 1 s':>13} {'from step':>9} "
                   f"{'accum':>5} {'wall s':>7}  status")]
        for r in resumed:
            x = r["resume"]
            load = x.get("load_seconds") or x.get("universal_seconds") or "-"
            startup = f"{x.get('startup_seconds') or '-'} / {r.get('startup_seconds') or '-'}"
            lines.append(
                f"{r['config']:<13} {x['checkpoint_mb']:>13} {x.get('save_seconds') or '-':>7} "
                f"{x.get('model_save_seconds') or '-':>8} "
                f"{x['to']:>22} {load:>7} {startup:>13} "
                f"{x.get('initial_step') or '-':>9} {x.get('gradient_accumulation_steps') or '-':>5} "
                f"{x.get('wall_seconds') or '-':>7}  {x['status']} {x.get('error') or ''}"
            )
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.3f}"


def _baseline(results: list[dict], key: Any) -> float | None:
    """The mean over DDP's ranks of ``key(rank figures)`` (the baseline of the ratios)."""
    ddp = next((r for r in results if r["config"] == "ddp" and r["status"] == "ok"), None)
    if ddp is None:
        return None
    vals = [key(m) for m in ddp["per_rank"].values()]
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else None


HELD_TARGET = 0.55  # issue 22: FSDP2 and ZeRO-3 hold at most 0.55 of DDP's bytes per rank


def full_tables(results: list[dict], facts: dict[str, Any]) -> str:
    """Full fine-tuning: held bytes per rank against DDP's, the final save's memory growth
    per rank against 1/world of the model plus its largest layer, tokens/s against DDP."""
    mb = 2**20
    ok = [r for r in results if r["status"] == "ok"]
    base = _baseline(results, lambda m: held_total(m.get("held")))
    base_all = _baseline(results, lambda m: held_total(m.get("held"), with_buffers=True))
    head = (f"{'config':<11} {'rank':>4} {'params':>8} {'grads':>8} {'optim':>8} {'p+g+o':>8} "
            f"{'vs DDP':>7} {'target':>7} {'buffers':>8} {'all':>8} {'vs DDP':>7}")
    lines = [(f"held per rank after an optimizer step, MB (target: FSDP2 and ZeRO-3 p+g+o at "
             f"most {HELD_TARGET} of DDP's)"), head, "-" * len(head)]
    for r in ok:
        for rank, m in r["per_rank"].items():
            h = m.get("held") or {}
            tot, tot_all = held_total(h), held_total(h, with_buffers=True)
            verdict = ""
            if r["config"] != "ddp" and tot is not None and base:
                verdict = "ok" if tot / base <= HELD_TARGET else "OVER"
            lines.append(
                f"{r['config']:<11} {rank:>4} "
                + " ".join(f"{h.get(k, 0) / mb:>8.1f}" for k in ("params", "grads", "optimizer"))
                + f" {(tot or 0) / mb:>8.1f} {_ratio(tot, base):>7} {verdict:>7} "
                f"{h.get('buffers', 0) / mb:>8.1f} {(tot_all or 0) / mb:>8.1f} "
                f"{_ratio(tot_all, base_all):>7}"
            )
    head = (f"{'config':<11} {'rank':>4} {'RSS at start':>12} {'peak growth':>11} "
            f"{'anon':>8} {'file':>8} {'target':>8} {'growth/target':>13} {'save s':>7}")
    lines += ["", (f"final save per rank, MB: growth of resident memory over the save (exact "
              f"peak); anon = heap, file = mapped safetensors pages (sampled every 10 ms); "
              f"target = model/world + largest layer ({facts['model_bytes'] / mb:.1f}/world + "
              f"{facts['largest_layer_bytes'] / mb:.1f}), overhead not included"), head,
              "-" * len(head)]
    for r in ok:
        target = save_target(facts, r["world_size"] or 1)
        for rank, m in r["per_rank"].items():
            sv = m.get("save") or {}
            if not sv:
                continue
            growth = sv["rss_peak"] - sv["rss_begin"]
            lines.append(
                f"{r['config']:<11} {rank:>4} {sv['rss_begin'] / mb:>12.1f} {growth / mb:>11.1f} "
                f"{(sv['anon_peak_sampled'] - sv['anon_begin']) / mb:>8.1f} "
                f"{(sv['file_peak_sampled'] - sv['file_begin']) / mb:>8.1f} "
                f"{target / mb:>8.1f} {growth / target:>13.3f} {sv['seconds']:>7.1f}"
            )
    lines += ["", ("held by name, MB, rank 0 (each storage counted once, under the first name "
                   "that reached it; 'views of' = a name whose tensors were only views into "
                   "storage already counted)")]
    for r in ok:
        first: dict[str, Any] = next(iter(r["per_rank"].values()), {})
        named = first.get("held_named") or {}
        if not named:
            continue
        lines.append(f"{r['config']}:")
        for name, e in sorted(named.items(), key=lambda kv: -kv[1]["bytes"]):
            lines.append(f"    {e['category']:<9} {e['bytes'] / mb:>9.1f}  {e['dtype']:<9} {name}")
        for name, owner in sorted((first.get("held_shared") or {}).items()):
            lines.append(f"    {'':<9} {'':>9}  {'':<9} {name}: views of {owner}")
    tps = next((r["tokens_per_second"] for r in ok if r["config"] == "ddp"), None)
    head = f"{'config':<11} {'tokens/s':>9} {'vs DDP':>7} {'train loss':>10} {'wall s':>7}"
    lines += ["", "throughput (timings depend on the machine's load: see the record)", head,
              "-" * len(head)]
    for r in ok:
        lines.append(f"{r['config']:<11} {r['tokens_per_second'] or 0:>9.1f} "
                     f"{_ratio(r['tokens_per_second'], tps):>7} "
                     f"{r['train_loss'] or 0:>10.4f} {r['wall_seconds']:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dev = p.add_mutually_exclusive_group()
    dev.add_argument("--gpu", action="store_true", help="run on CUDA (every configuration)")
    dev.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is visible")
    p.add_argument("--configs", default=None,
                   help=f"default: {','.join(CONFIGS)}; with --method full: ddp,fsdp2,zero3")
    p.add_argument("--method", choices=("lora", "full"), default="lora",
                   help="peft method: lora (r=16, all-linear) or full fine-tuning")
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="processes per run (default: 2 on CPU, the GPU count (<= 2) on GPU)",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--batch", type=int, default=4, help="per-device batch size")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument(
        "--hidden", type=int, default=None, help="model width (default cpu 512, gpu 1024)"
    )
    p.add_argument("--layers", type=int, default=None, help="model depth (default cpu 8, gpu 8)")
    p.add_argument("--model", type=Path, default=None, help="an existing causal LM directory")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per run")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--keep", action="store_true", help="keep the job directories")
    p.add_argument(
        "--resume",
        action="store_true",
        help="also resume each run's checkpoint on another process count (save/load times)",
    )
    args = p.parse_args(argv)

    import torch

    if args.gpu and not torch.cuda.is_available():
        p.error("--gpu: no CUDA device is visible")
    args.device = "cuda" if args.gpu or (not args.cpu and torch.cuda.is_available()) else "cpu"
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.processes is None:
        args.processes = min(2, gpus) if args.device == "cuda" else 2
    if args.device == "cuda" and args.processes > gpus:
        p.error(f"--processes {args.processes}: only {gpus} GPU(s)")
    gpu = args.device == "cuda"
    full = args.method == "full"
    if args.configs is None:
        args.configs = "ddp,fsdp2,zero3_local,zero3" if full else ",".join(CONFIGS)
    args.steps = args.steps or (30 if gpu else 3 if full else 12)
    # On CPU ~28M parameters (112 MB fp32): large enough that 1/world shards show in MB.
    # Full fine-tuning: ~146M (584 MB fp32; with gradients and Adam 2.3 GB per DDP rank),
    # so that a shard's bytes dwarf the noise of a process's own allocations.
    hidden = args.hidden or (1024 if gpu or full else 512)
    layers = args.layers or (12 if full else 8)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for n in names:
        distributed(n, 2)  # unknown names fail before any work

    work = Path(tempfile.mkdtemp(prefix="ftune-bench-sharding-"))
    model = args.model or build_model(work / f"llama-{hidden}x{layers}", hidden, layers)
    rows = args.steps * args.batch * args.processes + 16
    train = write_rows(work / "data" / "train.jsonl", rows)
    print(
        f"device {args.device}, {args.processes} process(es), model {model} "
        f"({hidden}x{layers}), {args.steps} steps x batch {args.batch} x seq {args.seq_len}; "
        f"work dir {work}",
        flush=True,
    )

    facts = model_facts(model)
    print(f"model: {facts['parameters'] / 1e6:.1f}M parameters, {facts['model_bytes'] / 2**20:.1f} "
          f"MB float32, largest layer {facts['largest_layer']} "
          f"{facts['largest_layer_bytes'] / 2**20:.1f} MB", flush=True)
    results = []
    for n in names:
        print(f"[{n}] ...", flush=True)
        r = run_config(n, args, model, train, work)
        extra = f" {r['wall_seconds']} s" if "wall_seconds" in r else ""
        print(f"[{n}] {r['status']}{extra}", flush=True)
        results.append(r)

    settings = {
        "processes": args.processes,
        "steps": args.steps,
        "per_device_train_batch_size": args.batch,
        "max_seq_length": args.seq_len,
        "model": {"path": str(model), "hidden_size": hidden, "layers": layers},
        "peft": "full" if full else "lora r=16 all-linear",
        "model_facts": facts,
        "mixed_precision": "bf16" if gpu else "no",
    }
    print()
    print(table(results))
    print()
    if full:
        print(full_tables(results, facts))
        print()
    if not args.keep:
        # The job directories are gone: the record keeps figures, not paths into them.
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        for r in results:
            r.pop("job_dir", None)
            r.pop("events", None)
    write_record(f"sharding-{args.device}", results, args=args, folder=args.out,
                 environment=environment_of(args.device), settings=settings)
    return 0 if all(r["status"] in ("ok", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

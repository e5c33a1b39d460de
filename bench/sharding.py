"""Memory and throughput per sharding strategy, through the real job path.

Usage:
    python -m bench.sharding                  # CPU here: ddp, fsdp2, fsdp2_cre, zero2, zero3
    python -m bench.sharding --gpu            # a GPU machine: every configuration
    python -m bench.sharding --configs zero3,fsdp2 --steps 40 --processes 2
    python -m bench.sharding --method full --steps 2 --resume   # full fine-tuning (issue 22)

Each configuration is one fine-tuning job (LoRA on a small Llama built offline, text rows)
run exactly as the worker runs it: spec.json, the accelerate YAML from
``worker.run.accelerate_config.accelerate_config`` plus ``launch_env``, and
``accelerate launch -m core.train <job_dir>`` (testkit/launch.py, as the trainer tests; one
configuration's run: bench/sharding_runs.py). The figures come from the job's own
events.jsonl: the per-rank "memory" events of every phase (load, train, eval, save) and the
trainer's tokens/s (non-padding input tokens of all ranks over training wall time); the
tables printed from them are bench/sharding_tables.py.

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
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

from bench.harness import llama, llama_shape
from bench.record import write_record
from bench.sharding_runs import CONFIGS, distributed, run_config
from bench.sharding_tables import full_tables, table


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


def write_rows(path: Path, n: int) -> Path:
    from cli.demo_assets import sentences

    path.parent.mkdir(parents=True, exist_ok=True)
    words = sentences(n * 8, seed=3)
    with path.open("w") as f:
        for i in range(n):  # ~8 sentences (~100 tokens) per row
            f.write(json.dumps({"text": " ".join(words[i * 8 : (i + 1) * 8])}) + "\n")
    return path


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

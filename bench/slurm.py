"""The same 2-process LoRA job as 1 node x 2 processes (the local executor's launch) and as
2 nodes x 1 process (the SLURM executor's batch script, on a real SLURM cluster started
here: testkit/slurm.py, slurmctld + two slurmd nodes in network namespaces; needs root and
slurm-wlm + munge, ``make slurm``).

Usage:
    python -m bench.slurm                      # 20 steps, Llama 256x4, batch 4, seq 128
    python -m bench.slurm --steps 40 --repeat 2
    python -m bench.slurm --strategy zero3     # DeepSpeed ZeRO-3 with CPU offload

Both runs are the real trainer (core.train) under ``accelerate launch``, DDP over gloo on
CPU, with the worker's own YAML generator and launch environment; the SLURM one uses the
worker's batch script builder (worker/slurm/script.py) and sbatch. The "nodes" share this
machine's cores, so the comparison isolates what SLURM adds (scheduling, srun, a rendezvous
over a network interface instead of loopback), not the cost of a real network.

Figures per run: wall time from submit (Popen / sbatch) to the end, the trainer's tokens/s
(last progress event: non-padding tokens of all ranks over training time), submit -> first
training step (the first progress event, logging every step), and for SLURM submit ->
RUNNING (squeue). Ratios are SLURM over local, from the same invocation.

Prints a table and writes bench/results/slurm-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import write_plan
from bench.record import write_record
from bench.sharding import build_model, write_rows
from core.run.jobdir import read_events
from testkit.launch import write_launch_files
from testkit.slurm import SlurmCluster, unavailable

STRATEGIES: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    # DeepSpeed ZeRO-3, optimizer and parameters offloaded to CPU (multi-node: torchrun per
    # node, accelerate's "standard" DeepSpeed launcher).
    "zero3": {"strategy": "deepspeed", "deepspeed": {
        "zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu"}},
}


def make_job(root: Path, name: str, model: Path, train: Path, machines: int,
             args: argparse.Namespace) -> Path:
    job = root / name
    spec = {
        "model": {"name_or_path": str(model), "task": "causal_lm", "dtype": "float32"},
        "dataset": {"path": str(train), "format": "text", "max_seq_length": args.seq_len},
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                 "target_modules": "all-linear"},
        "training": {"max_steps": args.steps, "learning_rate": 1e-4,
                     "per_device_train_batch_size": args.batch, "logging_steps": 1,
                     "save_steps": args.steps, "seed": 0},
        "distributed": {**STRATEGIES[args.strategy], "num_processes": 2,
                        "num_machines": machines},
    }
    write_plan(job, spec, model=model, train=train)
    return job


def figures(job: Path, t_submit: float, t_end: float) -> dict[str, Any]:
    evs = [e for _, e in read_events(job / "events.jsonl", 0)]
    progress = [e for e in evs if e.get("type") == "progress"]
    started = [e for e in evs if e.get("type") == "started"]
    ok = (job / "adapter" / "adapter_model.safetensors").is_file()
    return {
        "ok": ok,
        "wall_s": round(t_end - t_submit, 2),
        "tokens_per_s": progress[-1].get("tokens_per_second") if progress else None,
        "submit_to_first_step_s": round(progress[0]["time"] - t_submit, 2) if progress else None,
        "world_size": started[0].get("world_size") if started else None,
        "num_machines": started[0].get("num_machines") if started else None,
    }


def run_local(job: Path) -> dict[str, Any]:
    argv, env = write_launch_files(job)
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.time()
    with open(job / "trainer.log", "wb") as log:
        rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            check=False).returncode
    out = figures(job, t0, time.time())
    out["returncode"] = rc
    return out


def run_slurm(job: Path, cluster: SlurmCluster) -> dict[str, Any]:
    from worker.slurm import commands, states
    from worker.slurm.script import SCRIPT_FILE, BatchJob, render, sbatch_argv

    _, env = write_launch_files(job)
    launch = {k: v for k, v in env.items()
              if k.startswith(("ACCELERATE_", "DS_")) and k not in os.environ}
    batch = BatchJob(job_id=job.name.replace("_", "-"), attempt=1, job_dir=job,
                     partition=cluster.partition, nodes=2, processes_per_node=1,
                     time_minutes=30, python=sys.executable,
                     env={**launch, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    script = job / SCRIPT_FILE
    script.write_text(render(batch))
    env = {**env, **cluster.env}
    os.environ.update(cluster.env)  # squeue below
    t0 = time.time()
    slurm_id = commands.sbatch(sbatch_argv(batch, script), env=env)
    running_at = None
    while True:
        sj = commands.find(slurm_id)
        state = sj.state if sj else "UNKNOWN"
        if running_at is None and state == "RUNNING":
            running_at = time.time()
        if sj is not None and states.phase(state) == states.Phase.ended:
            break
        time.sleep(0.1)
    out = figures(job, t0, time.time())
    out.update(slurm_state=state, slurm_job_id=slurm_id,
               submit_to_running_s=round(running_at - t0, 2) if running_at else None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--strategy", choices=sorted(STRATEGIES), default="ddp")
    args = p.parse_args(argv)
    why = unavailable()
    if why:
        print(f"cannot start a SLURM cluster here: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="ftune-bench-slurm-"))
    model = build_model(work / "model", args.hidden, args.layers)
    train = write_rows(work / "train.jsonl", 512)
    cluster = SlurmCluster(work / "cluster").start()  # its own names and subnet
    results: list[dict[str, Any]] = []
    try:
        for i in range(args.repeat):
            local = run_local(make_job(work, f"local_{i}", model, train, 1, args))
            slurm = run_slurm(make_job(work, f"slurm_{i}", model, train, 2, args), cluster)
            results.append({"local_1x2": local, "slurm_2x1": slurm})
    finally:
        cluster.stop()
    print(f"{'run':<10} {'ok':<3} {'world':>5} {'machines':>8} {'wall s':>7} {'tok/s':>8} "
          f"{'->step1 s':>9} {'->RUNNING s':>11}")
    for r in results:
        for name, f in r.items():
            print(f"{name:<10} {'y' if f['ok'] else 'n':<3} {f['world_size']!s:>5} "
                  f"{f['num_machines']!s:>8} {f['wall_s']:>7} {f['tokens_per_s']!s:>8} "
                  f"{f['submit_to_first_step_s']!s:>9} {f.get('submit_to_running_s', '-')!s:>11}")
        lo, sl = r["local_1x2"], r["slurm_2x1"]
        if lo["tokens_per_s"] and sl["tokens_per_s"]:
            print(f"  SLURM/local: wall x{sl['wall_s'] / lo['wall_s']:.2f}, tokens/s "
                  f"x{sl['tokens_per_s'] / lo['tokens_per_s']:.2f}, first-step overhead "
                  f"{sl['submit_to_first_step_s'] - lo['submit_to_first_step_s']:+.1f} s")
    write_record("slurm", results, args=args)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

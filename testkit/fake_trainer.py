"""A stand-in for core.train, for worker tests: run under `accelerate launch` in place of
``core.train`` by setting ``FTUNE_TRAINER_MODULE=testkit.fake_trainer``.

It honours the trainer's side of the job-dir contract (core/run/jobdir.py) and picks its
behaviour from the spec's ``name`` (``fake:<mode>``):

    succeed     progress + checkpoint events, a valid adapter, exit 0
    crash       error.json (out_of_memory), exit 1
    crash_raw   a traceback on stderr, no error.json, exit 3
    no_adapter  exit 0 with no adapter
    empty       exit 0 with an adapter file holding only empty tensors (like a sharded save)
    zeros       exit 0 with an all-zero adapter
    slow        runs until STOP/SIGTERM (then a "stopped" event, exit 0); starts a child,
                a grandchild, and a grandchild that called setsid(), all sleeping
    stubborn    like slow, but ignores SIGTERM and STOP (must be SIGKILLed)
    train       a resumable run: training.max_steps steps (default 20) of 0.2 s, a checkpoint
                every training.save_steps (default 4); resumes from the runtime's checkpoint;
                a stop saves a checkpoint at the stop step, then exits 0. Its checkpoints
                carry the trainer's manifest (core/run/checkpoints.py), and a resume on
                another process count keeps the global batch as core.train does (the
                "started" event says so)
    slow_load   "loads the model" until STOP/SIGTERM, then a "stopped" event, exit 0
    slow_save   4 steps, then a save that ignores STOP and SIGTERM for 120 s
    hog         one step, then takes memory (100 MB at a time, up to FAKE_HOG_MB, default
                4000) and holds it until stopped: for a memory limit to kill
    oom         as train, but a first attempt takes memory as hog does after its first
                checkpoint: for the kernel's OOM killer to kill (a resumed one trains on)
    env         writes env.json (its environment), then succeeds

A spec whose name is not ``fake:...`` runs the real trainer (core.train). Ranks other than 0
(``RANK``) write nothing and wait for the stop (modes slow, stubborn, train, slow_load).
Every mode first checks the placement it was given (``_check_placement``): with GPUs in
the runtime, CUDA_VISIBLE_DEVICES must name exactly those, or it fails (exit 4); it writes
placement.json (GPUs, port, CPU cores and OMP_NUM_THREADS, start and end times) for tests
that run jobs side by side.
Mode ``train`` sleeps FAKE_STEP_SECONDS (default 0.2) per step.

Like core.train, it watches its parent (core/train/lifeline.py): an orphan stops, then exits.

It writes ``pids.json`` (its own pid and its descendants') so tests can check that none
survive. Stdlib + numpy + safetensors and ftune's pure-Python modules only: it starts in a
fraction of a second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from core.run.jobdir import JobDir, write_json_atomic
from core.train.lifeline import watch_parent

SLEEPER = "import time\nwhile True: time.sleep(1)\n"
TOKENS_PER_STEP = 10
LOSS_TOKENS_PER_STEP = 6


def append_event(path: Path, event_type: str, /, **fields: object) -> None:
    # core.run.jobdir.append_event cannot take a "path" field (its own first parameter).
    line = json.dumps({"time": time.time(), "type": event_type, **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _sleeper_tree(jd: JobDir) -> list[int]:
    """child -> grandchild, plus child2 -> setsid grandchild: 3 levels below this process."""
    code = (
        "import os, subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]).pid,\n"
        f"        subprocess.Popen([sys.executable, '-c', {SLEEPER!r}],\n"
        "                         start_new_session=True).pid]\n"
        "open(sys.argv[1], 'w').write(' '.join(map(str, kids)))\n"
        "while True: time.sleep(1)\n"
    )
    marker = jd.root / "grandchildren.txt"
    child = subprocess.Popen([sys.executable, "-c", code, str(marker)])
    for _ in range(100):
        if marker.exists() and marker.read_text().strip():
            break
        time.sleep(0.05)
    grandkids = [int(x) for x in marker.read_text().split()]
    return [child.pid, *grandkids]


def _write_adapter(jd: JobDir, mode: str) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    tmp = jd.adapter_tmp
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    if mode == "empty":
        tensors = {"base_model.model.layers.0.q_proj.lora_A.weight": np.zeros((0,), np.float32)}
    elif mode == "zeros":
        tensors = {"base_model.model.layers.0.q_proj.lora_A.weight": np.zeros((4, 8), np.float32)}
    else:
        rng = np.random.default_rng(0)
        tensors = {
            "base_model.model.layers.0.q_proj.lora_A.weight": rng.standard_normal((4, 8)).astype(
                np.float32),
            "base_model.model.layers.0.q_proj.lora_B.weight": np.zeros((8, 4), np.float32),
        }
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    os.replace(tmp, jd.adapter)


def _checkpoint(jd: JobDir, step: int, manifest: Any = None) -> None:
    ckpt = jd.checkpoints / f"checkpoint-{step}"
    ckpt.mkdir(parents=True, exist_ok=True)
    if manifest is not None:
        replace(manifest, step=step).write(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    append_event(jd.events, "checkpoint", step=step, path=f"checkpoints/checkpoint-{step}",
                 metrics={"loss": 1.0 / step})


def _train(jd: JobDir, spec: dict, runtime: dict, stop: dict, *, hog: bool = False) -> int:
    """Steady, resumable training: what a resumed attempt must continue, not repeat.
    ``hog``: take memory after the first checkpoint, until killed."""
    ev = jd.events
    training = spec.get("training") or {}
    total = int(training.get("max_steps") or -1)
    total = total if total > 0 else 20
    every = int(training.get("save_steps") or 4)
    resume = runtime.get("resume_from_checkpoint")
    step = int(Path(resume).name.rsplit("-", 1)[1]) if resume else 0
    # The batch layout as core.train decides it (core/run/checkpoints.py and
    # core/train/checkpoint.py's plan_resume are pure Python):
    # the spec's, or on another process count the one that keeps the checkpoint's global
    # batch; its checkpoints say how they were taken.
    from core.run.checkpoints import FORMAT_DCP, FORMAT_DEEPSPEED, Manifest
    from core.run.plan import RunPlan
    from core.train.checkpoint import plan_resume

    typed = RunPlan.read(jd.spec).spec
    strategy, world = typed.distributed.strategy, typed.distributed.processes
    per_device = typed.training.per_device_train_batch_size
    accumulation = typed.training.gradient_accumulation_steps
    resized: dict[str, Any] = {}
    if resume:
        layout = plan_resume(Path(resume), strategy, world, per_device, accumulation)
        per_device = layout.per_device_train_batch_size
        accumulation = layout.gradient_accumulation_steps
        resized = layout.event_fields(strategy, world)
    fmt = FORMAT_DEEPSPEED if strategy == "deepspeed" else FORMAT_DCP
    manifest = Manifest(format=fmt, step=step, strategy=strategy, world_size=world,
                        per_device_train_batch_size=per_device,
                        gradient_accumulation_steps=accumulation, trainable="adapter")
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    append_event(ev, "started", world_size=world, strategy=strategy, distributed_type="NO",
                 total_steps=total, attempt=runtime["attempt"], device="cpu",
                 target_modules=["q_proj", "v_proj"],
                 resumed_from=f"checkpoints/{Path(resume).name}" if resume else None,
                 **resized)
    print(f"fake trainer: train from step {step} to {total}", flush=True)
    first = step
    step_seconds = float(os.environ.get("FAKE_STEP_SECONDS") or 0.2)
    while step < total:
        time.sleep(step_seconds)
        step += 1
        # Usage as core.train reports it: this attempt's tokens (TOKENS_PER_STEP a step).
        append_event(ev, "progress", step=step, total_steps=total, epoch=step / total,
                     loss=1.0 / step, learning_rate=1e-4, attempt=runtime["attempt"],
                     tokens_trained=TOKENS_PER_STEP * (step - first),
                     loss_tokens_trained=LOSS_TOKENS_PER_STEP * (step - first))
        deadline = runtime.get("deadline")
        if stop["now"] or jd.stop.exists() or (deadline and time.time() > deadline):
            _checkpoint(jd, step, manifest)
            append_event(ev, "stopped", step=step, reason="stop requested",
                         checkpoint=f"checkpoints/checkpoint-{step}")
            return 0
        if step % every == 0:
            _checkpoint(jd, step, manifest)
            if hog:
                _take_memory(jd, stop)
    _write_adapter(jd, "succeed")
    append_event(ev, "saved", path="adapter", files=["adapter_config.json",
                                                     "adapter_model.safetensors"])
    append_event(ev, "finished", step=step, total_steps=total, train_loss=1.0 / total)
    return 0


def _slow_load(jd: JobDir, runtime: dict, stop: dict) -> int:
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    append_event(jd.events, "log", level="info", message="loading the model (slowly)")
    while not (stop["now"] or jd.stop.exists()):
        time.sleep(0.1)
    append_event(jd.events, "stopped", step=0, reason="stop requested", checkpoint=None)
    return 0


def _hog(jd: JobDir, runtime: dict, stop: dict) -> int:
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    append_event(jd.events, "started", world_size=int(os.environ.get("WORLD_SIZE", "1")),
                 strategy="none", distributed_type="NO", total_steps=4,
                 attempt=runtime["attempt"])
    append_event(jd.events, "progress", step=1, total_steps=4, epoch=0.25, loss=1.0,
                 learning_rate=1e-4)
    _take_memory(jd, stop)
    return 0


def _take_memory(jd: JobDir, stop: dict) -> None:
    held: list[bytearray] = []
    cap = int(os.environ.get("FAKE_HOG_MB") or 4000) // 100
    while not (stop["now"] or jd.stop.exists()):
        if len(held) < cap:
            held.append(bytearray(b"x" * (100 << 20)))  # written: resident, not just mapped
        time.sleep(0.05)


def _follower(jd: JobDir, mode: str, stop: dict) -> int:
    """A rank other than 0 (several processes or machines): it writes nothing, and stays up
    as long as a real rank would, so tests see a process on every node."""
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif mode in ("slow", "slow_load", "train", "hog"):
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    else:
        return 0
    while mode == "stubborn" or not (stop["now"] or jd.stop.exists() or jd.adapter.exists()):
        time.sleep(0.1)
    return 0


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _check_placement(jd: JobDir, runtime: dict) -> str | None:
    """What is wrong with the GPUs this run was given, or None; rank 0 records them
    either way (ranks on several machines share the job directory: two writers of one file
    race on its temporary name, and one of them crashed)."""
    gpu_ids = [int(i) for i in runtime.get("gpu_ids") or []]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if _is_rank0():
        write_json_atomic(jd.root / "placement.json", {
            "gpu_ids": gpu_ids, "cuda_visible_devices": visible,
            "main_process_port": runtime.get("main_process_port"), "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "started": time.time()})
    if gpu_ids and visible != ",".join(map(str, gpu_ids)):
        return f"CUDA_VISIBLE_DEVICES={visible!r} but the runtime gave GPUs {gpu_ids}"
    return None


def _record_end(jd: JobDir) -> None:
    path = jd.root / "placement.json"
    if _is_rank0() and path.exists():
        write_json_atomic(path, {**json.loads(path.read_text()), "ended": time.time()})


def main() -> int:
    jd = JobDir(Path(sys.argv[1]))
    raw = jd.read_spec()
    name = raw["spec"].get("name") or "fake:succeed"
    if not name.startswith("fake:"):
        # Not a fake job: the real trainer (a stack whose jobs mix both, e.g. on SLURM).
        import runpy

        runpy.run_module("core.train", run_name="__main__", alter_sys=True)
        return 0
    # The plan the worker wrote must be one the real trainer reads (core/run/plan.py).
    from core.run.plan import RunPlan

    RunPlan.read(jd.spec)
    runtime = raw["runtime"]
    problem = _check_placement(jd, runtime)
    if problem is not None:
        write_json_atomic(jd.error, {"code": "internal", "message": problem})
        return 4
    try:
        return _run(jd, raw, runtime)
    finally:
        _record_end(jd)


def _run(jd: JobDir, raw: dict, runtime: dict) -> int:
    mode = (raw["spec"].get("name") or "fake:succeed").split(":")[1]  # fake:<mode>[:label]
    ev = jd.events
    stop = {"now": False}
    watch_parent(lambda: stop.update(now=True), jd.stop)
    if not _is_rank0():
        return _follower(jd, mode, stop)
    write_json_atomic(jd.root / "pids.json", {"trainer": os.getpid(), "tree": []})
    if mode in ("train", "oom"):
        return _train(jd, raw["spec"], runtime, stop,
                      hog=mode == "oom" and not runtime.get("resume_from_checkpoint"))
    if mode == "slow_load":
        return _slow_load(jd, runtime, stop)
    if mode == "hog":
        return _hog(jd, runtime, stop)
    if mode == "env":
        write_json_atomic(jd.root / "env.json", dict(os.environ))
    append_event(ev, "started", world_size=int(os.environ.get("WORLD_SIZE", "1")),
                 strategy="none", distributed_type="NO", total_steps=4, attempt=runtime["attempt"],
                 resume_from_checkpoint=runtime["resume_from_checkpoint"])
    print(f"fake trainer mode={mode} attempt={runtime['attempt']}", flush=True)

    if mode in ("slow", "stubborn"):
        if mode == "slow":
            signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        else:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        tree = _sleeper_tree(jd)
        write_json_atomic(jd.root / "pids.json", {"trainer": os.getpid(), "tree": tree})
        step = 0
        while True:
            step += 1
            append_event(ev, "progress", step=step, total_steps=1000, epoch=step / 1000,
                         loss=2.0 / step, learning_rate=1e-4)
            if mode == "slow" and (stop["now"] or jd.stop.exists()):
                _checkpoint(jd, step)  # a graceful stop saves where it stopped
                append_event(ev, "stopped", step=step, reason="stop requested",
                             checkpoint=f"checkpoints/checkpoint-{step}")
                return 0
            if runtime.get("deadline") and time.time() > runtime["deadline"] and mode == "slow":
                append_event(ev, "stopped", step=step, reason="deadline")
                return 0
            time.sleep(0.1)

    for step in (1, 2, 3, 4):
        append_event(ev, "progress", step=step, total_steps=4, epoch=step / 4, loss=1.0 / step,
                     learning_rate=1e-4, tokens_per_second=100.0 + step)
    ckpt = jd.checkpoints / "checkpoint-2"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer_state.json").write_text("{}")
    append_event(ev, "checkpoint", step=2, path="checkpoints/checkpoint-2",
                 metrics={"loss": 0.5}, retained_steps=[2])
    append_event(ev, "memory", phase="train", rank=0, cpu_mb_begin=10.0, cpu_mb_end=20.0,
                 cpu_mb_peak=123.0)

    if mode == "crash":
        print("Traceback (most recent call last):\nRuntimeError: CUDA out of memory", flush=True)
        write_json_atomic(jd.error, {"code": "out_of_memory", "message": "ran out of memory",
                                     "traceback": "Traceback ...\nOutOfMemoryError"})
        return 1
    if mode == "crash_raw":
        print("Traceback (most recent call last):\nValueError: something broke", file=sys.stderr,
              flush=True)
        return 3
    if mode == "no_adapter":
        return 0
    if mode == "slow_save":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        append_event(ev, "log", level="info", message="saving the adapter (slowly)")
        time.sleep(120)
    _write_adapter(jd, mode)
    append_event(ev, "saved", path="adapter", files=["adapter_config.json",
                                                     "adapter_model.safetensors"])
    append_event(ev, "finished", step=4, train_loss=0.25, runtime_seconds=0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`ftune demo`: the whole product in one command, on this machine, offline.

Builds a tiny Llama and a small dataset locally, starts the embedded stack (API + worker,
SQLite, filesystem broker), uploads the data and submits a LoRA job over HTTP, follows it,
downloads the adapter zip through the API and loads it with PeftModel.from_pretrained.
"""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path

from rich.console import Console

console = Console(stderr=True, soft_wrap=True)


def run_demo(data_dir: Path, *, steps: int = 40) -> Path:
    from cli.demo_assets import build_causal_lm, text_rows, write_jsonl
    from cli.embedded import EMBEDDED_WORKER_NICE, EmbeddedStack
    from cli.follow import follow_job
    from client import FtuneClient

    # Offline, and quiet: the demo's own output is the story.
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error"),
                 ("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(k, v)
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars: noise in a pipe
    data_dir = data_dir.resolve()
    models = data_dir / "models"
    model_dir = models / "tiny-llama"
    if not (model_dir / "config.json").exists():
        console.print("building a tiny Llama and tokenizer offline...")
        build_causal_lm(model_dir)
    train = write_jsonl(data_dir / "demo" / "train.jsonl", text_rows(256))

    spec = {
        "name": "demo: LoRA on a tiny Llama",
        "model": {"name_or_path": str(model_dir), "task": "causal_lm"},
        "dataset": {"format": "text", "max_seq_length": 64},
        "peft": {"method": "lora", "r": 8, "lora_alpha": 16, "target_modules": "all-linear"},
        "training": {
            "max_steps": steps,
            "learning_rate": 3e-3,
            "per_device_train_batch_size": 8,
            "logging_steps": 5,
            "save_steps": max(10, steps // 2),
        },
    }
    stack = EmbeddedStack(
        data_dir=data_dir / "service",
        env_overrides={"FTUNE_ALLOWED_MODEL_ROOTS": str(models), "HF_HUB_OFFLINE": "1"},
        worker_nice=EMBEDDED_WORKER_NICE,
    )
    console.print("starting the embedded stack (API + worker, SQLite, filesystem broker)...")
    with stack:
        console.print(f"API at {stack.url}")
        with FtuneClient(stack.url, stack.api_key) as c:
            spec["dataset"]["file_id"] = c.upload_file(train)["id"]  # type: ignore[index]
            created = c.create_job(spec)
            console.print(f"submitted {created['id']}")
            job = follow_job(c, created["id"], poll_seconds=0.5)
            if job["status"] != "succeeded":
                console.print(f"[red]job {job['status']}: {job.get('error')}[/red]")
                for line in c.logs(job["id"], tail=30):
                    console.print(line, markup=False)
                raise SystemExit(1)
            out = data_dir / "adapter"
            zpath = c.download_adapter(job["id"], data_dir / "adapter.zip")
    with zipfile.ZipFile(zpath) as z:
        z.extractall(out)
    console.print(f"downloaded the adapter to {out}: {sorted(p.name for p in out.iterdir())}")

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out)
    ids = tok("the cat", return_tensors="pt").input_ids
    with torch.no_grad():
        delta = (model(ids).logits - base(ids).logits).abs().max().item()
        gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    console.print(f"loaded with PeftModel.from_pretrained; max logit change vs base: {delta:.4f}")
    console.print(f"sample: {tok.decode(gen[0], skip_special_tokens=True)!r}")
    console.print(f"[green]demo finished: job {job['id']} succeeded, adapter in {out}[/green]")
    return out

"""Optional export of the base model with the adapter merged in (training.export_merged).

A separate step, after the adapter was saved and verified, on rank 0 only:

1. load the base model *fresh*, in float32 (the adapter's update is added to the weights
   in full precision, then the result is rounded once to the output dtype);
2. ``PeftModel.from_pretrained`` with the published adapter/ (so what is merged is exactly
   what the user downloads), run a probe input through it;
3. ``merge_and_unload`` folds W + scale * B @ A (LoRA, DoRA, rsLoRA) or W * l (IA3) into
   the base weights and drops the adapter modules (modules_to_save become plain modules);
4. the merged model must give the same logits on the probe, then it is cast to the
   base's dtype and saved with the tokenizer to merged.tmp/, renamed to merged/.

Never inside a sharded run: under FSDP/ZeRO no rank holds whole weights, and the global
sharding state would also make from_pretrained load partitioned. The recipe runs this module
as its own single process there (``python -m core.train.merge <job_dir>``); without sharding
it runs in the trainer's process after training. Prompt and prefix tuning add virtual
tokens, not weight deltas: there is nothing to merge (core/spec/ refuses the combination).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from core.infra.errors import adapter_invalid
from core.run.jobdir import publish_dir

log = logging.getLogger("core.train")

MERGED_DIR = "merged"
MERGEABLE = ("LORA", "IA3")
_PROBE = "the quick brown fox jumps over the lazy dog"


def output_dtype(spec_dtype: str, base_config: Any) -> torch.dtype:
    """spec.model.dtype if set, else the dtype the base checkpoint was saved in."""
    named = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if spec_dtype in named:
        return named[spec_dtype]
    saved = getattr(base_config, "dtype", None) or getattr(base_config, "torch_dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def _probe_logits(model: Any, tokenizer: Any) -> torch.Tensor:
    enc = tokenizer([_PROBE], return_tensors="pt")
    kwargs: dict[str, Any] = {
        "input_ids": enc["input_ids"],
        "attention_mask": enc["attention_mask"],
    }
    if getattr(model.config, "is_encoder_decoder", False):
        start = model.config.decoder_start_token_id
        kwargs["decoder_input_ids"] = torch.tensor([[start, *enc["input_ids"][0, :3].tolist()]])
    with torch.no_grad():
        return model(**kwargs).logits.float()


def merge_adapter(
    base: Any, adapter_dir: Path, out_dir: Path, tokenizer: Any, dtype: torch.dtype
) -> list[str]:
    """base (float32, freshly loaded) + adapter_dir -> out_dir (published atomically).

    Returns the file names written. Raises adapter_invalid if the adapter cannot be merged
    or the merged model's outputs differ from the adapter's.
    """
    from peft import PeftModel

    model: Any = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    peft_type = str(getattr(model.peft_config["default"].peft_type, "value", ""))
    if peft_type not in MERGEABLE:
        raise adapter_invalid(f"a {peft_type} adapter cannot be merged into the base weights")
    expected = _probe_logits(model, tokenizer)
    # safe_merge: merge into a copy first and refuse NaN/inf instead of writing them.
    merged = model.merge_and_unload(safe_merge=True)
    got = _probe_logits(merged, tokenizer)
    # Same numbers, computed in another order (W x + B A x vs (W + B A) x): float32
    # rounding only.
    diff = float((got - expected).abs().max())
    if diff > 1e-4 * (1.0 + float(expected.abs().max())):
        raise adapter_invalid(
            f"the merged model's logits differ from the adapter's by {diff:.3g}: not exported"
        )
    if getattr(merged.config, "use_cache", None) is False:
        merged.config.use_cache = True  # switched off for training; inference wants it

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.to(dtype).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    files = sorted(p.name for p in tmp.iterdir() if p.is_file())
    publish_dir(tmp, out_dir)
    log.info("merged model saved to %s (%s, max logit difference %.3g)", out_dir, dtype, diff)
    return files


def export_merged(job_root: Path) -> list[str]:
    """Merge <job_root>/adapter into a fresh base and publish <job_root>/merged."""
    from transformers import AutoConfig, AutoTokenizer

    from core.model.peft import seq2seq_peft_compat
    from core.train.job import load_job
    from core.train.model import load_model

    job = load_job(job_root)
    spec, rt = job.spec, job.runtime
    adapter_dir = job.dir.adapter
    labels = None
    labels_file = adapter_dir / "labels.json"
    if labels_file.exists():
        id2label = json.loads(labels_file.read_text())["id2label"]
        labels = [id2label[str(i)] for i in range(len(id2label))]
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    config = AutoConfig.from_pretrained(
        rt.model_path, revision=spec.model.revision, trust_remote_code=spec.model.trust_remote_code
    )
    # Never the quantized base a QLoRA run trained on: the adapter is folded into the
    # full-precision weights (rounding them to 4 or 8 bits again would throw away most of
    # what the adapter adds).
    base = load_model(spec, rt.model_path, tokenizer, labels, dtype=torch.float32, quantize=False)
    if spec.model.task == "seq2seq_lm":
        seq2seq_peft_compat(base)
    return merge_adapter(
        base, adapter_dir, job_root / MERGED_DIR, tokenizer, output_dtype(spec.model.dtype, config)
    )


def export_merged_subprocess(job_root: Path) -> list[str]:
    """export_merged in a fresh single process: no process group, no FSDP/ZeRO state."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ACCELERATE_", "FSDP_", "DEEPSPEED", "MASTER_", "TORCHELASTIC_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    }
    proc = subprocess.run(
        [sys.executable, "-m", "core.train.merge", str(job_root)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    sys.stderr.write(proc.stderr)  # into trainer.log with the rest
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise adapter_invalid(f"exporting the merged model failed: {tail}")
    return list(json.loads(proc.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.stderr.write("usage: python -m core.train.merge <job_dir>\n")
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    files = export_merged(Path(argv[0]).resolve())
    sys.stdout.write(json.dumps(files) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

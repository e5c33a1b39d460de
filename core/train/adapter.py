"""The final adapter: consolidated save, verification, atomic publish (its model card:
core/train/model_card.py).

Saving goes through ``Trainer.save_model`` on every rank, because under sharding the
weights must be gathered collectively before rank 0 can write them: FSDP needs the
FULL_STATE_DICT type for that (with SHARDED_STATE_DICT, save_model writes no adapter
weights at all), and under ZeRO-3 the Trainer gathers the partitioned trainable weights
layer by layer (for a PEFT model it gathers only those, whatever
stage3_gather_16bit_weights_on_model_save says); a direct save_pretrained on a partitioned
model writes empty LoRA tensors, which verification reports. The files land in
adapter.tmp/; only after they are verified is the directory renamed to adapter/, so a
reader never sees a partial final adapter.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.infra.errors import adapter_invalid
from core.run.jobdir import publish_dir
from core.train import dist

log = logging.getLogger("core.train")

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LABELS_FILE = "labels.json"
CARD_FILE = "README.md"
# The Trainer also pickles its TrainingArguments next to the weights; a pickle is no part
# of a downloadable adapter (loading it runs code), so it is removed.
_NOT_PUBLISHED = ("training_args.bin",)


def _real_shape(t: torch.Tensor) -> tuple[int, ...]:
    # Under ZeRO-3 a parameter is a 0-element placeholder; DeepSpeed keeps the real shape.
    ds_shape = getattr(t, "ds_shape", None)
    return tuple(ds_shape) if ds_shape is not None else tuple(t.shape)


@dataclass
class AdapterReference:
    """The adapter as built, before training: names and shapes (and, when the weights are
    materialised on this rank, the initial values, to check that training changed them)."""

    shapes: dict[str, tuple[int, ...]]
    initial: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @classmethod
    def capture(cls, peft_model: Any) -> AdapterReference:
        from peft.utils import get_peft_model_state_dict

        sd = get_peft_model_state_dict(peft_model)
        shapes = {k: _real_shape(v) for k, v in sd.items()}
        # ZeRO-3 placeholders, or meta tensors on the ranks that start without weights (FSDP
        # cpu_ram_efficient_loading): no initial values to compare with on this rank.
        partitioned = any(hasattr(v, "ds_shape") or v.is_meta for v in sd.values())
        initial = None if partitioned else {k: v.detach().cpu().clone() for k, v in sd.items()}
        return cls(shapes, initial)


def verify_adapter(
    saved: dict[str, torch.Tensor],
    ref: AdapterReference,
    trained: dict[str, torch.Tensor] | None,
    peft_type: str,
) -> list[str]:
    """Problems with the saved weights (empty: fine).

    * same tensor names and shapes as the adapter that was built;
    * every value finite;
    * LoRA: lora_B starts at exactly zero (so the adapter starts as a no-op); after training
      a B that is still all zero means the update never reached the saved file;
    * when the trained weights are available unsharded on this rank, the file must hold
      exactly them.
    """
    problems: list[str] = []
    missing = sorted(set(ref.shapes) - set(saved))
    extra = sorted(set(saved) - set(ref.shapes))
    if missing:
        problems.append(f"{len(missing)} tensors missing from the file, e.g. {missing[0]}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors in the file, e.g. {extra[0]}")
    for name, t in saved.items():
        want = ref.shapes.get(name)
        if want is not None and tuple(t.shape) != want:
            problems.append(f"{name}: shape {tuple(t.shape)}, expected {want}")
        if t.numel() == 0:
            # What save_pretrained writes from a ZeRO-3 model: the 0-element placeholders
            # each rank holds in place of a partitioned parameter.
            problems.append(f"{name}: empty tensor (partitioned weights saved without gathering)")
        elif t.is_floating_point() and not bool(torch.isfinite(t).all()):
            problems.append(f"{name}: non-finite values")
    if peft_type == "LORA":
        zero_b = [n for n in saved if "lora_B" in n and not bool(saved[n].any())]
        if zero_b:
            problems.append(
                f"{len(zero_b)} lora_B tensors are all zero (e.g. {zero_b[0]}): their update "
                "never reached the saved file"
            )
    elif (
        ref.initial is not None
        and saved
        and all(n in ref.initial and torch.equal(saved[n].cpu(), ref.initial[n]) for n in saved)
    ):
        problems.append("every tensor still holds its initial value: training changed nothing")
    if trained is not None:
        for name, t in trained.items():
            s = saved.get(name)
            if s is not None and s.shape == t.shape and not torch.equal(s.cpu(), t.detach().cpu()):
                problems.append(f"{name}: the file differs from the trained weights")
                break
    return problems


def _labels_json(labels: list[str]) -> dict[str, Any]:
    return {
        "num_labels": len(labels),
        "id2label": {str(i): n for i, n in enumerate(labels)},
        "label2id": {n: i for i, n in enumerate(labels)},
    }


def save_final_adapter(
    trainer: Any,
    job_root: Path,
    ref: AdapterReference,
    labels: list[str] | None,
    card: str,
    sharded: bool,
) -> list[str]:
    """Save, verify and publish <job_dir>/adapter. Call on every rank. Returns file names."""
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    tmp, final = job_root / "adapter.tmp", job_root / "adapter"
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted earlier save
    dist.barrier()

    from core.train.sharding import fsdp1_wrapped

    if fsdp1_wrapped(trainer.model_wrapped):
        # FSDP1: the adapter's row chunks gathered one tensor at a time, as for every
        # checkpoint (its FULL_STATE_DICT gather crashed on CPU).
        from core.train.checkpoint import save_adapter

        save_adapter(trainer, tmp)
    else:
        if trainer.is_fsdp_enabled:
            # Checkpoints may be SHARDED_STATE_DICT (fast, per rank); the deliverable must be
            # one consolidated file, gathered to rank 0.
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(str(tmp))
    trainer.accelerator.wait_for_everyone()

    problem: str | None = None
    files: list[str] = []
    if dist.is_main():
        for name in _NOT_PUBLISHED:
            (tmp / name).unlink(missing_ok=True)
        if labels is not None:
            (tmp / LABELS_FILE).write_text(json.dumps(_labels_json(labels), indent=2))
        (tmp / CARD_FILE).write_text(card)
        try:
            saved = load_peft_weights(str(tmp), device="cpu")
        except Exception as e:  # noqa: BLE001 - a missing or unreadable file is what we check for
            saved, problem = {}, f"cannot read the saved weights: {e}"
            if trainer.is_deepspeed_enabled:
                problem += (
                    " (under DeepSpeed the adapter must be saved through Trainer.save_model, "
                    "which gathers the partitioned trainable weights on every rank)"
                )
        if problem is None:
            peft_model = trainer.accelerator.unwrap_model(trainer.model)
            trained = None if sharded else get_peft_model_state_dict(peft_model)
            peft_type = str(peft_model.peft_config["default"].peft_type.value)
            problems = verify_adapter(saved, ref, trained, peft_type)
            problem = "; ".join(problems[:5]) or None
        if problem is None:
            files = sorted(p.name for p in tmp.iterdir() if p.is_file())
            publish_dir(tmp, final)
    # Every rank learns rank 0's verdict, so all of them fail (or succeed) together.
    problem = dist.gather_objects(problem)[0]
    if problem is not None:
        raise adapter_invalid(f"the saved adapter failed verification: {problem}")
    return files

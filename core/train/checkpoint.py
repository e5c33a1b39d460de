"""Checkpoints: save, load and reshard, in one place.

An intermediate checkpoint (``checkpoints/checkpoint-N``) holds:

* ``state/``: the *trainable* parameters and their optimizer state, written by every rank in
  parallel with torch.distributed.checkpoint (DCP): each rank writes the shards it owns
  (FSDP2 DTensor shards, FSDP1 flat-parameter slices; replicated DDP tensors once). The
  tensors are keyed by their fully qualified names as ``get_state_dict`` normalises them (no
  ``module.`` / FSDP wrapper prefixes), so the same checkpoint loads into any world size and
  any of none / DDP / FSDP1 / FSDP2: DCP reshards at load, each rank reading the slices its
  own layout needs. A frozen base (adapters, and QLoRA's 4-bit weights) is not saved: it is
  read again from the base model. For a full fine-tune every parameter is trainable, so the
  whole model is in ``state/``.
* ``scheduler.pt``, ``rng_state*.pth``, ``trainer_state.json`` (the step, the log history):
  the Trainer's own files, written as it always does.
* ``ftune_checkpoint.json`` (the manifest, core/run/checkpoints.py): the step, the world
  size and batch layout it was taken with, so a resume on another process count can keep
  the global batch, and with it the data position (see ``rebatch`` there).
* an adapter, for adapter jobs: the trainable tensors gathered to rank 0 and saved as
  ``adapter_model.safetensors`` + ``adapter_config.json`` + tokenizer, so every checkpoint
  can be downloaded and loaded with ``PeftModel.from_pretrained``, under every strategy.
* ``model/``, for full fine-tunes: the whole model as the final one is written
  (core/train/full_model.py: each rank writes its part, no process holds the whole model;
  verified against the weights at this step), which ``AutoModelForCausalLM.from_pretrained``
  loads and ``model.from_job`` starts from.

DeepSpeed keeps its own engine checkpoint (its optimizer holds flat fp32 partitions, not
per-parameter tensors); every rank writes its partition in parallel, and the manifest and
the gathered adapter (or, for a full fine-tune, ``model/``) are added the same way. A ZeRO checkpoint resumes on another world size
through DeepSpeed's universal checkpoint (core/train/deepspeed_checkpoint.py), under
DeepSpeed only (``resume_refusal`` says so before any weight is read).

Data position: the Trainer restores ``global_step`` and skips that many optimizer steps of
batches in the epoch. accelerate's seedable sampler makes one permutation per epoch that
does not depend on the world size, and hands consecutive micro-batches to ranks in turn; so
as long as the *global* batch (per-device batch x accumulation x processes) is unchanged, an
optimizer step consumes the same samples on 1 or on 8 processes, and step N of the resumed
run is step N of the original one: no sample is repeated or skipped.

Pure Python at import time (torch is imported inside functions), like the rest of
core/train's modules that the worker may import.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.infra.errors import invalid_spec
from core.run.checkpoints import (
    FORMAT_DCP,
    FORMAT_DEEPSPEED,
    Manifest,
    ResumePlan,
    rebatch,
    resume_refusal,
)
from core.train import dist
from core.train.sharding import fsdp1_wrapped

log = logging.getLogger("core.train")

STATE_DIR = "state"
SCHEDULER_FILE = "scheduler.pt"


def plan_resume(
    checkpoint: Path, strategy: str, world_size: int, per_device: int, accumulation: int
) -> ResumePlan:
    """Read the checkpoint's manifest and decide the batch layout of the resumed run; raise
    ``resume_refused`` when it cannot continue here (said before any weight is read)."""
    manifest = Manifest.read(checkpoint)
    refusal = resume_refusal(manifest, strategy, world_size)
    if refusal:
        raise invalid_spec(f"cannot resume from {checkpoint.name}: {refusal}")
    if manifest is None or manifest.world_size == world_size:
        return ResumePlan(checkpoint, manifest, per_device, accumulation)
    layout = rebatch(manifest.global_batch, per_device, world_size)
    assert layout is not None  # resume_refusal checked the split
    return ResumePlan(checkpoint, manifest, *layout)


def uses_dcp(trainer: Any) -> bool:
    """Whether this Trainer's checkpoints are DCP (every strategy but DeepSpeed)."""
    return not trainer.is_deepspeed_enabled


def _state_options(*, load: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Frozen parameters (the base under an adapter) are not checkpoint state: they come from
    # the base model. strict=False at load for the same reason (they are "missing" keys);
    # missing *trainable* keys are checked against the checkpoint's metadata instead.
    return StateDictOptions(ignore_frozen_params=True, strict=not load)


def _torch_optimizer(optimizer: Any) -> Any:
    # accelerate's AcceleratedOptimizer wraps the torch optimizer whose state DCP maps.
    return getattr(optimizer, "optimizer", optimizer)


# Names wrappers insert into parameter names: activation checkpointing, torch.compile.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def _trainable(model: Any) -> dict[str, Any]:
    """The trainable parameters by their plain names, as the live tensors (detached views:
    DCP writes from and loads into them in place; an FSDP2 DTensor stays this rank's shard).

    Not ``get_model_state_dict``: that calls the whole model's ``state_dict()``, and the
    frozen base's hooks run too (bitsandbytes' 8-bit layers fail there on CPU) for tensors
    that are then dropped. FSDP1 is the exception (below): its parameters are views into
    flat shards that only its own state-dict machinery can name and reassemble."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    out = {}
    for name, p in inner.named_parameters():
        if p.requires_grad:
            for wrapper in _WRAPPER_NAMES:
                name = name.replace(wrapper, "")
            out[name] = p.detach()
    return out


def save_state(model: Any, optimizer: Any, checkpoint: Path) -> None:
    """Write the trainable parameters and the optimizer state to ``checkpoint/state`` (DCP).
    Call on every rank: each writes its own shards, in parallel; rank 0 the metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_state_dict

    opt, options = _torch_optimizer(optimizer), _state_options(load=False)
    if fsdp1_wrapped(model):
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
    else:
        model_sd, optim_sd = (
            _trainable(model),
            get_optimizer_state_dict(model, opt, options=options),
        )
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(checkpoint / STATE_DIR))


def load_state(model: Any, optimizer: Any, checkpoint: Path) -> None:
    """Load ``checkpoint/state`` into the (prepared) model and optimizer, resharding to this
    run's world size and strategy. Call on every rank."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        get_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    opt, options = _torch_optimizer(optimizer), _state_options(load=True)
    fsdp1 = fsdp1_wrapped(model)
    if fsdp1:
        model_sd, optim_sd = get_state_dict(model, opt, options=options)
    else:
        model_sd, optim_sd = (
            _trainable(model),
            get_optimizer_state_dict(model, opt, options=options),
        )
    stored = set(
        dcp.FileSystemReader(str(checkpoint / STATE_DIR)).read_metadata().state_dict_metadata
    )
    # FSDP1 names a tied parameter (an LM head sharing the input embedding) under each of
    # its names; every other layout stores it once, under its first name. Such a second
    # name is filled from the first after the load.
    aliases = {
        alias: first
        for alias, first in (_tied_aliases(model).items() if fsdp1 else ())
        if alias in model_sd and f"model.{alias}" not in stored and first in model_sd
    }
    for alias in aliases:
        del model_sd[alias]
    missing = sorted(k for k in model_sd if f"model.{k}" not in stored)
    if missing:
        raise invalid_spec(
            f"cannot resume from {checkpoint.name}: {len(missing)} trainable tensors of this run "
            f"are not in it (e.g. {missing[0]}); was it taken with another peft method or "
            "target_modules?",
        )
    # dcp.load fills this dict in place, each rank reading the slices its layout holds: the
    # parameters themselves (views), the optimizer state into the dict given back to torch.
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    with torch.no_grad():
        dcp.load(state, checkpoint_id=str(checkpoint / STATE_DIR))
    if fsdp1:
        for alias, first in aliases.items():
            state["model"][alias] = state["model"][first]
        set_state_dict(
            model,
            opt,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=options,
        )
    else:
        set_optimizer_state_dict(model, opt, state["optim"], options=options)


def _tied_aliases(model: Any) -> dict[str, str]:
    """Second names of tied parameters -> their first name (plain names, as get_state_dict
    gives them)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    from core.train.full_model import clean_name

    for name, p in model.named_parameters(remove_duplicate=False):
        name = clean_name(name)
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def gathered_trainable(model: Any) -> dict[str, Any]:
    """The trainable parameters whole, on rank 0's CPU (other ranks get an empty dict). Call
    on every rank: a sharded tensor is all-gathered from its shards, in the same order
    everywhere; for a LoRA adapter that is a few MB, not the model. FSDP1 through torch's
    sharded state dict (which unflattens its flat parameters)."""
    from torch.distributed.tensor import DTensor

    if fsdp1_wrapped(model):
        from core.train.sharding import fsdp1_state_dtensors

        # Each rank's row chunks, gathered here one tensor at a time (FSDP1's own
        # FULL_STATE_DICT gather crashed on CPU).
        out = {}
        for name, t in fsdp1_state_dtensors(model, trainable_only=True).items():
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if dist.is_main():
                out[name] = whole.cpu().clone()
        return out
    out = {}
    for name, p in _trainable(model).items():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        if dist.is_main():
            out[name] = t.cpu().clone()
    return out


def save_adapter(trainer: Any, checkpoint: Path) -> None:
    """The checkpoint's downloadable adapter (see the module docstring). Every rank."""
    full = gathered_trainable(trainer.model_wrapped)
    if dist.is_main():
        peft_model = trainer.accelerator.unwrap_model(trainer.model)
        # get_state_dict names match PeftModel.named_parameters(); peft picks the adapter's
        # tensors out of ``full`` and names them as it saves them.
        fsdp1 = fsdp1_wrapped(trainer.model_wrapped)
        if fsdp1:
            # peft 0.21 finds the adapter's tensors by the names of its layers as
            # named_modules() gives them, which under FSDP1 include its wrappers: it picks
            # nothing out of plain names, and keeps the adapter's name in the ones it
            # picks. So it is given wrapped names, and the file's names are made as peft
            # names them without FSDP (no wrapper, no adapter name) below.
            wrapped = {_plain(n): n for n, _ in peft_model.named_parameters()}
            full = {wrapped.get(k, k): v for k, v in full.items()}
        peft_model.save_pretrained(str(checkpoint), state_dict=full, is_main_process=True)
        if fsdp1:
            _plain_adapter_names(checkpoint, str(peft_model.active_adapter))
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(str(checkpoint))


def _plain(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _plain_adapter_names(folder: Path, adapter: str) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    plain = {_plain(k).replace(f".{adapter}.", "."): v for k, v in tensors.items()}
    save_file(plain, str(path), metadata={"format": "pt"})


def load_adapter_weights(peft_model: Any, adapter_dir: Path) -> int:
    """Start from another job's adapter (model.from_job): its saved tensors replace the
    freshly initialised ones, before the model is prepared. Returns the tensors loaded.

    Ranks that build the model without weights (FSDP2 cpu_ram_efficient_loading) hold meta
    tensors here, which take no values; rank 0's loaded ones reach them with the rest of
    its weights when the model is sharded."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    saved = load_peft_weights(str(adapter_dir), device="cpu")
    result = set_peft_model_state_dict(peft_model, saved)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected or not saved:
        raise invalid_spec(
            f"model.from_job: the adapter in {adapter_dir.name} does not fit this job's "
            f"adapter ({len(saved)} tensors, {len(unexpected)} unknown, e.g. "
            f"{(unexpected or ['-'])[0]})"
        )
    return len(saved)


def trainable_kind(model: Any) -> str:
    """ "adapter" for a PEFT model, "full" when the whole model trains."""
    return "adapter" if hasattr(model, "peft_config") else "full"


class CheckpointMixin:
    """Trainer mixin: intermediate checkpoints through this module (DCP state + manifest +
    downloadable adapter) instead of the Trainer's per-strategy formats; loading them on any
    world size. The final save (``save_model`` called from outside) is unchanged.

    The Trainer calls, per checkpoint: ``save_model(dir, _internal_call=True)``, then
    ``_save_optimizer_and_scheduler``, ``_save_scaler``, ``_save_rng_state`` and finally
    ``trainer_state.json``; written last, that file marks the checkpoint complete
    (core/run/jobdir.py). At resume: ``_load_from_checkpoint`` (before ``prepare`` except under
    FSDP/DeepSpeed) and ``_load_optimizer_and_scheduler`` (after ``prepare``, every strategy).
    """

    strategy_name: str = "none"  # set by the recipe: the strategy in effect
    # Full fine-tuning (set by the recipe): the dtype of the model written into each
    # checkpoint, and its card by step.
    full_model_dtype: Any = None
    full_model_card: Callable[[int], str] | None = None
    # Seconds the last checkpoint took to write (all its files, every rank), and the resume
    # took to load: for the checkpoint / started events.
    checkpoint_seconds: float | None = None
    resume_seconds: float | None = None
    # Of checkpoint_seconds, those its downloadable full model (model/) took; None when the
    # checkpoint has none (an adapter, or a strategy that writes no model/).
    checkpoint_model_seconds: float | None = None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t0 = time.monotonic()
        self.checkpoint_model_seconds = None
        super()._save_checkpoint(model, trial)  # type: ignore[misc]
        self.checkpoint_seconds = round(time.monotonic() - t0, 3)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        trainer: Any = self
        if not _internal_call or output_dir is None:
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
            return
        path = Path(output_dir)
        kind = trainable_kind(trainer.accelerator.unwrap_model(trainer.model))
        if uses_dcp(trainer):
            save_state(trainer.model_wrapped, trainer.optimizer, path)
            if kind == "adapter":
                save_adapter(trainer, path)
        elif kind == "adapter":
            # The downloadable adapter, gathered to rank 0 by the Trainer (under ZeRO-3 only
            # the trainable tensors); the engine's checkpoint (each rank its partition) is
            # written with the optimizer.
            super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        else:
            # A full model under DeepSpeed: the engine's checkpoint, every rank writing its
            # partition with the optimizer (_save_optimizer_and_scheduler), holds the
            # training state; the downloadable model is written below (under ZeRO-3 one
            # parameter gathered at a time, never the whole model on rank 0).
            path.mkdir(parents=True, exist_ok=True)
        if kind == "full" and self.full_model_card is not None:
            # The downloadable side of a full checkpoint: model/, as transformers loads it.
            from core.train.full_model import save_checkpoint_model

            step = int(trainer.state.global_step)
            t0 = time.monotonic()
            save_checkpoint_model(trainer, path, self.full_model_dtype, self.full_model_card(step))
            self.checkpoint_model_seconds = round(time.monotonic() - t0, 3)
        if dist.is_main():
            Manifest(
                format=FORMAT_DCP if uses_dcp(trainer) else FORMAT_DEEPSPEED,
                step=int(trainer.state.global_step),
                strategy=self.strategy_name,
                world_size=int(trainer.accelerator.num_processes),
                per_device_train_batch_size=int(trainer.args.per_device_train_batch_size),
                gradient_accumulation_steps=int(trainer.args.gradient_accumulation_steps),
                trainable=kind,
            ).write(path)
        dist.barrier()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        trainer: Any = self
        if not uses_dcp(trainer):
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
            return
        # The optimizer state went into state/ with the parameters it belongs to.
        if dist.is_main():
            import torch

            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        trainer: Any = self
        if uses_dcp(trainer) and Manifest.read(Path(resume_from_checkpoint)) is not None:
            return  # loaded after prepare, with the optimizer (_load_optimizer_and_scheduler)
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        trainer: Any = self
        path = Path(checkpoint) if checkpoint else None
        if path is None or not uses_dcp(trainer) or Manifest.read(path) is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        import torch

        t0 = time.monotonic()
        load_state(trainer.model_wrapped, trainer.optimizer, path)
        trainer.lr_scheduler.load_state_dict(
            torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True)
        )
        self.resume_seconds = round(time.monotonic() - t0, 3)

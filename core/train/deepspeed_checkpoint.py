"""DeepSpeed checkpoints that travel: a ZeRO checkpoint taken on N processes resumes on M.

A DeepSpeed checkpoint (``checkpoint-N/global_stepN/``) holds ZeRO's *flat* partitions:
each rank's file has one contiguous slice of the flattened fp32 master weights and of each
Adam moment, cut for the world size it was taken on; no other world size can read them as
they are. DeepSpeed's universal checkpoint is the documented way across: ``ds_to_universal``
reassembles every trainable parameter's fp32 weights and its two moments as whole tensors,
one folder per parameter (``global_stepN_universal/zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``),
and an engine whose config says ``checkpoint.load_universal`` reads each rank's slice of them
for its own world size. Only the trainable parameters are in it (the optimizer's), so an
adapter's checkpoint stays adapter-sized; a frozen base is read again from the base model.

* When: only to resume on another process count. On the same count the engine's own files
  load as they are (no conversion, nothing to go wrong).
* Who: global rank 0 converts, *before* the process group exists (a large model's
  conversion could outlast a collective's timeout); the other ranks wait for the file that
  DeepSpeed writes last (``latest_universal``). A conversion interrupted half-way is
  redone. The result stays in the checkpoint, so a second resume on another count reuses
  it; it costs the disk of one more copy of the optimizer state.
* Memory: the conversion reads one rank's file at a time and merges one parameter at a
  time: peak ~ one rank's partition plus the largest parameter's states, not the model.
* Not possible: ZeRO-Infinity's NVMe optimizer offload keeps the optimizer state in
  per-rank swap files (``offloaded_tensors/``), which neither the conversion nor the
  universal load reads (the engine skips it: ``load_checkpoint`` copies the swap folders
  back per rank). Such a checkpoint, or a resumed run that offloads its optimizer to NVMe,
  stays on its process count (``reshard_refusal``).

The data position and global batch are kept as for every strategy (core/run/checkpoints.py,
``rebatch``): DeepSpeed's batch sizes are the Trainer's ("auto" in the generated config).

Pure Python at import time (deepspeed is imported inside functions).
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from core.infra.errors import invalid_spec
from core.run.checkpoints import LATEST, ResumePlan, reshard_refusal
from core.spec.distributed import DistributedSpec
from core.train import dist

log = logging.getLogger("core.train")

LATEST_UNIVERSAL = "latest_universal"  # ... and the universal one's; written last
UNIVERSAL_SUFFIX = "_universal"


def engine_tag(checkpoint: Path) -> str:
    """The engine checkpoint's folder name in ``checkpoint`` (``global_stepN``)."""
    try:
        return (checkpoint / LATEST).read_text().strip()
    except FileNotFoundError:
        tags = sorted(p.name for p in checkpoint.glob("global_step*") if p.is_dir()
                      and not p.name.endswith(UNIVERSAL_SUFFIX))
        if not tags:
            raise invalid_spec(f"{checkpoint.name} holds no DeepSpeed engine checkpoint") from None
        return tags[-1]


def universal_ready(checkpoint: Path) -> bool:
    marker = checkpoint / LATEST_UNIVERSAL
    return marker.is_file() and (checkpoint / marker.read_text().strip()).is_dir()


def convert_to_universal(checkpoint: Path) -> float:
    """``checkpoint``'s engine checkpoint -> a universal one beside it (once; reused after).
    Returns the seconds it took (0.0 when it was there)."""
    if universal_ready(checkpoint):
        return 0.0
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    tag = engine_tag(checkpoint)
    out = checkpoint / f"{tag}{UNIVERSAL_SUFFIX}"
    shutil.rmtree(out, ignore_errors=True)  # a conversion that was interrupted
    t0 = time.monotonic()
    ds_to_universal.main(
        Namespace(
            input_folder=str(checkpoint / tag),
            output_folder=str(out),
            # In this process, one rank file / one parameter at a time: no worker pool
            # forked from a trainer, and the memory bound of the module docstring.
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=False,
        )
    )
    # ds_to_universal writes latest_universal last, naming ``out``: the completion mark.
    assert universal_ready(checkpoint), f"ds_to_universal left no {LATEST_UNIVERSAL}"
    return round(time.monotonic() - t0, 3)


def universal_resume(distributed: DistributedSpec, resume: ResumePlan | None) -> float | None:
    """A DeepSpeed checkpoint from another process count: converted to DeepSpeed's
    universal checkpoint; the conversion's seconds on rank 0, or None when the engine's own
    files load as they are (or the run is no DeepSpeed resume)."""
    m = resume.manifest if resume else None
    if resume is None or m is None or distributed.strategy != "deepspeed":
        return None
    if m.world_size == dist.world_size():
        return None
    nvme = distributed.deepspeed.offload_optimizer_device == "nvme"
    return prepare_universal(resume.checkpoint, nvme_optimizer=nvme)


def prepare_universal(checkpoint: Path, nvme_optimizer: bool, timeout: float = 24 * 3600) -> float:
    """Every rank, before the process group exists: rank 0 converts, the others wait for
    it. Raises resume_refused (invalid_spec) when the checkpoint cannot move. Returns the
    conversion's seconds (rank 0; 0.0 elsewhere)."""
    refusal = reshard_refusal(checkpoint, nvme_optimizer)
    if refusal:
        raise invalid_spec(f"cannot resume from {checkpoint.name} on another process count: "
                           f"{refusal}")
    if dist.is_main():
        seconds = convert_to_universal(checkpoint)
        log.info("%s converted to a universal checkpoint in %.1f s", checkpoint.name, seconds)
        return seconds
    # No collective yet: rank 0's failure ends the launch (the launcher stops every rank),
    # so waiting on the file is bounded by it.
    deadline = time.monotonic() + timeout
    while not universal_ready(checkpoint):
        if time.monotonic() > deadline:
            raise invalid_spec(f"{checkpoint.name}: no universal checkpoint after {timeout} s")
        time.sleep(0.5)
    return 0.0


def load_universal(trainer: Any) -> None:
    """Tell the engine (not built yet: it is, in trainer.train()) to read the universal
    checkpoint: DeepSpeed's ``checkpoint.load_universal``."""
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    config.setdefault("checkpoint", {})["load_universal"] = True

"""The final model of a full fine-tune (peft method full): safetensors files with their
index, config, generation config, tokenizer and a model card, written without any process
holding the whole model, verified against the trained weights, then published. Each
intermediate checkpoint holds one too (``checkpoints/checkpoint-N/model``, the same writer),
so that every checkpoint downloads and can start another job (model.from_job).

How the weights reach the disk depends on where they live while training:

* FSDP2 (each parameter a DTensor, each rank holding its slice): every rank writes its own
  slices with torch.distributed.checkpoint's Hugging Face writer (into ``sharded/``, in
  parallel, no collective moves a weight), then each rank consolidates its share of the
  output files (``consolidate_safetensors_files_on_every_rank``), which reads the slices
  back and writes one full tensor at a time. Peak per rank: its slice of the model, plus
  the largest tensor while consolidating.
* FSDP1 (each parameter a view into this rank's part of a flat parameter, which holds no
  tensor's shape): torch's SHARDED_STATE_DICT (``get_model_state_dict`` with
  ``full_state_dict=False``) unflattens one FSDP unit at a time and hands each rank its
  row chunk of every tensor as a ShardedTensor; those chunks are re-labelled as DTensors
  (the same row split, ``Shard(0)``) and written as under FSDP2. Peak per rank: its
  chunk of the model twice (the flat shard and the chunks), plus the largest FSDP unit
  while it is unflattened. Never FULL_STATE_DICT: that gathers to rank 0, and its gather
  crashes on CPU (torch ``_flat_param.py``).
* ZeRO-3 (each parameter a flat partition): one parameter at a time is gathered on every
  rank (``GatheredParameters``: a collective, in the same order on every rank); the rank
  that owns the parameter's output file keeps a copy until that file is complete, writes
  it and drops it. Peak per rank: one output file plus one parameter.
* none, DDP, ZeRO 0-2 (whole weights on every rank already): as ZeRO-3 without the
  gather; each rank writes its own files, in parallel.

There are as many output files as ranks (each writes at least one), more when a file would
exceed MAX_FILE_BYTES. Tied weights (an LM head sharing the input embedding) are saved
once, under their first name, as transformers saves them.

Verification, before anything is published: each rank reads back from the files the part
of every tensor that it holds (its DTensor slice, its ZeRO partition, or the whole tensors
of the files it wrote) and compares it with the trained values cast to the output dtype:
exactly equal, and finite; and the index must name exactly the model's tensors, with their
shapes. Rank 0 then adds config, generation config, tokenizer, card and files.json (size
and sha256 of every file, each rank hashing the files it wrote) and renames model.tmp ->
model. A rank 0 that learns of any problem fails every rank (adapter_invalid).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from core.infra.errors import adapter_invalid
from core.run.jobdir import FILES_MANIFEST, MODEL_DIR, MODEL_TMP_DIR, publish_dir
from core.train import dist
from core.train.sharding import fsdp1_wrapped

MAX_FILE_BYTES = 5 * 2**30
INDEX_FILE = "model.safetensors.index.json"
SHARDED_DIR = "sharded"
CARD_FILE = "README.md"
# Wrappers that FSDP, activation checkpointing and torch.compile put into parameter names.
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def file_name(index: int, count: int) -> str:
    """transformers' (and torch.distributed.checkpoint's) name of output file ``index``."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def clean_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _numel(p: torch.Tensor) -> int:
    # Under ZeRO-3 a parameter is a 0-element placeholder; DeepSpeed keeps the real size.
    return int(getattr(p, "ds_numel", p.numel()))


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    ds_shape = getattr(p, "ds_shape", None)
    return tuple(ds_shape) if ds_shape is not None else tuple(p.shape)


def saved_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """(name in the file, parameter or buffer) of what the model file holds, in module
    order: parameters once each (a tied one under its first name) and persistent buffers."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():  # deduplicates tied parameters
        if id(p) not in seen:
            seen.add(id(p))
            out.append((clean_name(name), p))
    for module_name, module in model.named_modules():
        skip: set[str] = getattr(module, "_non_persistent_buffers_set", set())
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in skip and id(b) not in seen:
                seen.add(id(b))
                out.append((clean_name(f"{module_name}.{name}" if module_name else name), b))
    return out


def plan_files(sizes: list[tuple[str, int]], world: int) -> dict[str, int]:
    """tensor name -> output file index (1-based): contiguous runs of tensors in model
    order, about equal bytes each, at least one file per rank when there are enough
    tensors, none above MAX_FILE_BYTES unless a single tensor is."""
    total = sum(n for _, n in sizes)
    count = max(1, min(len(sizes), max(world, math.ceil(total / MAX_FILE_BYTES))))
    target = total / count
    mapping: dict[str, int] = {}
    index, used = 1, 0
    for i, (name, n) in enumerate(sizes):
        left = len(sizes) - i  # tensors still to place, this one included
        # Next file once this one is full, keeping one tensor for each file still to come.
        if used > 0 and index < count and (used + n > target * 1.0001 or left <= count - index):
            index, used = index + 1, 0
        mapping[name] = index
        used += n
    return mapping


def owner(file_index: int, world: int) -> int:
    """The rank that writes (and hashes) output file ``file_index``, as torch's
    consolidate_safetensors_files_on_every_rank assigns them."""
    return file_index % world


# ---------------------------------------------------------------------------- writing


def _write_dtensors(
    params: list[tuple[str, torch.Tensor]], mapping: dict[str, int], out: Path, dtype: torch.dtype
) -> None:
    """FSDP2: every rank writes its slices, then consolidates its share of the files."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    state = {name: p.detach().to(dtype) for name, p in params}
    sharded = out / SHARDED_DIR
    dcp.save(
        state,
        storage_writer=HuggingFaceStorageWriter(
            str(sharded), fqn_to_index_mapping=mapping, save_distributed=True
        ),
    )
    del state
    consolidate_safetensors_files_on_every_rank(str(sharded), str(out), mapping)
    dist.barrier()  # every file is complete before anyone reads it back
    if dist.is_main():
        shutil.rmtree(sharded, ignore_errors=True)


@contextmanager
def _gathered(p: torch.Tensor, zero3: bool) -> Iterator[None]:
    if zero3:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            yield
    else:
        yield


def _write_whole(
    params: list[tuple[str, torch.Tensor]],
    mapping: dict[str, int],
    out: Path,
    dtype: torch.dtype,
    zero3: bool,
) -> None:
    """ZeRO-3 (gathered one parameter at a time) and unsharded weights: each rank buffers
    the tensors of the files it owns and writes each file once it is complete."""
    from safetensors.torch import save_file

    rank, world = dist.rank(), dist.world_size()
    count = max(mapping.values())
    last = {index: name for name, index in mapping.items()}  # the last tensor of each file
    buffer: dict[str, torch.Tensor] = {}
    for name, p in params:
        index = mapping[name]
        mine = owner(index, world) == rank
        with _gathered(p, zero3 and hasattr(p, "ds_id")):
            if mine:
                buffer[name] = p.detach().to(device="cpu", dtype=dtype).clone().contiguous()
        if mine and last[index] == name:
            save_file(buffer, str(out / file_name(index, count)), metadata={"format": "pt"})
            buffer.clear()
    dist.barrier()


def fsdp1_shards(
    wrapped: Any, params: list[tuple[str, torch.Tensor]]
) -> list[tuple[str, torch.Tensor]]:
    """FSDP1: ``params`` (names from the original parameters, use_orig_params) with each
    tensor replaced by this rank's row chunk of it, as a DTensor over all ranks. The views
    FSDP1 leaves in the original parameters between steps are not the tensors: flattened
    slices of the local shard, or empty where another rank holds the values."""
    from core.train.sharding import fsdp1_state_dtensors

    try:
        state = fsdp1_state_dtensors(wrapped, trainable_only=False)
    except ValueError as e:
        raise adapter_invalid(str(e)) from e
    missing = [name for name, _ in params if name not in state]
    if missing:
        raise adapter_invalid(
            f"FSDP1's sharded state dict has no {missing[0]} ({len(missing)} of "
            f"{len(params)} tensors missing)"
        )
    return [(name, state[name]) for name, _ in params]


# ---------------------------------------------------------------------------- verifying


def _local_part(p: torch.Tensor, rank: int) -> tuple[torch.Tensor, Any] | None:
    """(the values this rank holds of ``p``, where they sit in the whole tensor), or None
    when it holds none. Where: a tuple of slices (a DTensor shard), or ("flat", start) for
    a ZeRO-3 partition of the flattened tensor, or None for the whole tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = p.to_local()
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if local.numel() == 0:
            return None
        return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
    part = getattr(p, "ds_tensor", None)
    if part is not None:
        per_rank = int(part.ds_numel)
        start = rank * per_rank
        n = max(0, min(per_rank, _numel(p) - start))
        if n == 0:
            return None
        return part.detach().flatten()[:n], ("flat", start)
    return p, None


def verify_files(
    params: list[tuple[str, torch.Tensor]], mapping: dict[str, int], out: Path, dtype: torch.dtype
) -> list[str]:
    """This rank's problems with the written files (see the module docstring)."""
    from safetensors import safe_open

    rank, world = dist.rank(), dist.world_size()
    count = max(mapping.values())
    problems: list[str] = []
    if rank == 0:
        index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
        want = {name: file_name(i, count) for name, i in mapping.items()}
        if index != want:
            missing = sorted(set(want) - set(index))
            problems.append(
                f"the index names {len(index)} tensors, the model has {len(want)}"
                + (f" (missing {missing[0]})" if missing else "")
            )
    handles: dict[int, Any] = {}
    try:
        for name, p in params:
            i = mapping[name]
            part = _local_part(p, rank)
            if part is None:
                continue
            local, where = part
            if where is None and owner(i, world) != rank:
                continue  # whole on every rank: the rank that wrote the file checks it
            if i not in handles:
                # One file open at a time (tensors come in file order): every page read
                # through a handle stays mapped into this process until it is closed, so
                # keeping them all open made the read-back hold this rank's part of the
                # whole model (bench/sharding.py --method full measured it).
                handles.clear()
                opened = safe_open(str(out / file_name(i, count)), framework="pt")
                handles[i] = (opened, set(opened.keys()))
            f, names = handles[i]
            if name not in names:
                problems.append(f"{name} is missing from {file_name(i, count)}")
                continue
            got_shape = tuple(f.get_slice(name).get_shape())
            if got_shape != _shape(p):
                problems.append(f"{name}: shape {got_shape} in the file, {_shape(p)} trained")
                continue
            if where is None:
                saved = f.get_tensor(name)
            elif where[0] == "flat":
                saved = f.get_tensor(name).flatten()[where[1] : where[1] + local.numel()]
            else:
                saved = f.get_slice(name)[where]
            if saved.is_floating_point() and not bool(torch.isfinite(saved).all()):
                problems.append(f"{name}: non-finite values")
            elif not torch.equal(saved, local.detach().to(device="cpu", dtype=dtype).reshape(saved.shape)):
                problems.append(f"{name}: the file differs from the trained weights")
            if len(problems) >= 5:
                break
    finally:
        handles.clear()
    return problems


# ---------------------------------------------------------------------------- publishing


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _write_index(out: Path, params: list[tuple[str, torch.Tensor]], mapping: dict[str, int],
                 dtype: torch.dtype) -> None:
    count = max(mapping.values())
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(_numel(p) * size for _, p in params)
    index = {
        "metadata": {"total_size": total},
        "weight_map": {name: file_name(i, count) for name, i in mapping.items()},
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _write_companions(model: Any, tokenizer: Any, out: Path, dtype: torch.dtype, card: str) -> None:
    """Rank 0: what from_pretrained needs beside the weights, and the card."""
    import copy

    config = copy.deepcopy(model.config)
    config.dtype = dtype
    if getattr(config, "use_cache", None) is False:
        config.use_cache = True  # switched off for training; inference wants it
    config.save_pretrained(str(out))
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    (out / CARD_FILE).write_text(card)


def save_final_model(
    trainer: Any, job_root: Path, dtype: torch.dtype, card: str
) -> list[str]:
    """Write, verify and publish <job_root>/model. Call on every rank. Returns file names."""
    return write_model_dir(trainer, job_root / MODEL_TMP_DIR, job_root / MODEL_DIR, dtype, card)


def save_checkpoint_model(
    trainer: Any, checkpoint: Path, dtype: torch.dtype, card: str
) -> list[str]:
    """The model at this checkpoint, as the final one is written (``checkpoint/model``): so
    that every checkpoint of a full fine-tune downloads as a model transformers loads, and a
    new job can start from it (model.from_job), without converting the DCP state later in a
    process that would have to read the whole model. Costs one more write of the weights
    (in the output dtype: for bf16, a quarter of what state/ holds with Adam's moments),
    by every rank in parallel, no rank holding more than for the final save."""
    return write_model_dir(
        trainer, checkpoint / MODEL_TMP_DIR, checkpoint / MODEL_DIR, dtype, card
    )


def checkpoint_card(base_model: str, task: str, step: int, job_id: str) -> str:
    """The README.md of a checkpoint's model."""
    return "\n".join([
        "---",
        f"base_model: {base_model}",
        "library_name: transformers",
        f"tags: [ftune, full, {task}, checkpoint]",
        "---",
        "",
        f"# {job_id}, checkpoint at step {step}",
        "",
        (f"`{base_model}` fine-tuned in full (every parameter trained), task `{task}`: the "
         f"weights after optimizer step {step} of ftune job `{job_id}`, an intermediate "
         "checkpoint (the job's final model, once it succeeds, has its own card with the "
         "training figures)."),
        "",
    ])


def write_model_dir(
    trainer: Any, tmp: Path, final: Path, dtype: torch.dtype, card: str
) -> list[str]:
    """Write the whole model into ``tmp``, verify it, publish it as ``final``. Every rank."""
    if dist.is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted earlier save
        tmp.mkdir(parents=True)
    dist.barrier()

    model = trainer.accelerator.unwrap_model(trainer.model)
    params = saved_tensors(model)
    if fsdp1_wrapped(trainer.model_wrapped):
        # The names and order are the original parameters' (tied ones once); the values
        # FSDP1's sharded state dict, one row chunk per rank.
        params = fsdp1_shards(trainer.model_wrapped, params)
    size = torch.empty((), dtype=dtype).element_size()
    mapping = plan_files([(n, _numel(p) * size) for n, p in params], dist.world_size())
    from torch.distributed.tensor import DTensor

    problem: str | None = None
    with torch.no_grad():
        if any(isinstance(p, DTensor) for _, p in params):
            _write_dtensors(params, mapping, tmp, dtype)
        else:
            _write_whole(params, mapping, tmp, dtype, trainer.is_deepspeed_enabled)
        if dist.is_main():
            _write_index(tmp, params, mapping, dtype)
        dist.barrier()
        mine = verify_files(params, mapping, tmp, dtype)
    count, world, rank = max(mapping.values()), dist.world_size(), dist.rank()
    hashes = {
        file_name(i, count): sha256_of(tmp / file_name(i, count))
        for i in sorted(set(mapping.values()))
        if owner(i, world) == rank
    }
    reports = dist.gather_objects((mine, hashes))
    files: list[str] = []
    if dist.is_main():
        problems = [p for found, _ in reports for p in found]
        problem = "; ".join(problems[:5]) or None
        if problem is None:
            _write_companions(model, trainer.processing_class, tmp, dtype, card)
            digests = {name: h for _, found in reports for name, h in found.items()}
            files = write_manifest(tmp, digests)
            publish_dir(tmp, final)
    problem = dist.gather_objects(problem)[0]
    if problem is not None:
        raise adapter_invalid(f"the saved model failed verification: {problem}")
    return files


def write_manifest(folder: Path, known: dict[str, str] | None = None) -> list[str]:
    """files.json: name, bytes and sha256 of every file in ``folder`` (``known``: digests
    already computed, by name). Returns the file names, the manifest included."""
    known = known or {}
    entries = []
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != FILES_MANIFEST:
            entries.append(
                {
                    "name": path.name,
                    "bytes": path.stat().st_size,
                    "sha256": known.get(path.name) or sha256_of(path),
                }
            )
    (folder / FILES_MANIFEST).write_text(json.dumps({"files": entries}, indent=2))
    return [str(e["name"]) for e in entries] + [FILES_MANIFEST]

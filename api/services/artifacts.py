"""Files a job's run left in its job directory: log tail, launch command, adapter zips.

Every path is resolved and must stay inside the job directory (the trainer writes there,
and a symlink or a recorded path must never make the API serve anything else)."""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.schemas import LaunchInfo, ModelFile, ModelFiles
from core.db.models import Checkpoint, Job
from core.evals.job_results import artifact_kept
from core.infra.errors import Conflict, NotFound
from core.policy.tracking import TENSORBOARD_DIR
from core.run.jobdir import ACCELERATE_FILE, FILES_MANIFEST, LOG_FILE, MODEL_DIR

TAIL_BLOCK = 64 * 1024
TAIL_MAX_BYTES = 16 * 1024 * 1024
ZIP_CHUNK = 1024 * 1024

# What of a checkpoint directory belongs in an adapter zip (optimizer and RNG state do not).
ADAPTER_FILES = frozenset(
    {
        "adapter_config.json",
        "adapter_model.safetensors",
        "adapter_model.bin",
        "README.md",
        "labels.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "spiece.model",
        "tokenizer.model",
        "sentencepiece.bpe.model",
    }
)


def job_root(job: Job) -> Path | None:
    return Path(job.job_dir).resolve() if job.job_dir else None


def inside(root: Path, path: str | Path) -> Path | None:
    """``path`` (relative to ``root`` or absolute) resolved, if it stays inside ``root``."""
    p = (root / path).resolve()
    return p if p == root or p.is_relative_to(root) else None


# --------------------------------------------------------------------------- logs


def tail_log(job: Job, n: int) -> list[str]:
    """The last ``n`` lines of trainer.log, reading backwards from the end in blocks."""
    root = job_root(job)
    path = inside(root, LOG_FILE) if root else None
    if path is None or not path.is_file():
        return []
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        pos, blocks, newlines = end, [], 0
        while pos > 0 and newlines <= n and end - pos < TAIL_MAX_BYTES:
            size = min(TAIL_BLOCK, pos)
            pos -= size
            f.seek(pos)
            block = f.read(size)
            blocks.append(block)
            newlines += block.count(b"\n")
    data = b"".join(reversed(blocks))
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    if pos > 0 and lines:
        lines.pop(0)  # started mid-line
    return [_display(line) for line in lines[-n:]]


def _display(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").rstrip("\r")
    # Progress bars redraw a line with \r: show its last state.
    if "\r" in text:
        parts = [p for p in text.split("\r") if p.strip()]
        text = parts[-1] if parts else ""
    return text


# --------------------------------------------------------------------------- launch


def launch_info(job: Job) -> LaunchInfo:
    launch = job.launch
    if not launch:
        raise NotFound(f"job {job.id} has not been launched yet")
    argv = [str(a) for a in (launch.get("argv") or [])]
    yaml = launch.get("accelerate_yaml")
    if not isinstance(yaml, str):
        root = job_root(job)
        path = inside(root, ACCELERATE_FILE) if root else None
        yaml = path.read_text() if path is not None and path.is_file() else ""
    env = launch.get("env") or {}
    script, slurm_id = launch.get("sbatch_script"), launch.get("slurm_job_id")
    return LaunchInfo(
        accelerate_yaml=yaml, argv=argv, env={str(k): str(v) for k, v in env.items()},
        sbatch_script=script if isinstance(script, str) else None,
        slurm_job_id=str(slurm_id) if slurm_id is not None else None,
        cpus=[int(c) for c in launch["cpus"]] if launch.get("cpus") else None,
    )


# --------------------------------------------------------------------------- adapter zips


def adapter_files(
    session: Session, job: Job, checkpoint: int | None
) -> tuple[str, list[tuple[str, Path]]]:
    """(zip name, [(name in zip, file)]) of the final adapter or of a recorded checkpoint."""
    root = job_root(job)
    if checkpoint is None:
        if not artifact_kept(job) or not job.adapter_path or root is None:
            raise Conflict(f"adapter not available: job is {job.status}")
        if Path(job.adapter_path).name == MODEL_DIR:
            raise Conflict(
                f"job {job.id} trained the whole model (peft method full), not an adapter: "
                f"GET /v1/jobs/{job.id}/model lists its files"
            )
        folder = inside(root, job.adapter_path)
        if folder is None or not folder.is_dir():
            raise Conflict("adapter not available: its files are missing")
        files = _regular_files(root, folder, None)
        name = f"{job.id}-adapter"
    else:
        folder = _checkpoint_folder(session, job, checkpoint)
        files = _regular_files(root, folder, ADAPTER_FILES)  # type: ignore[arg-type]
        if not any(arcname == "adapter_config.json" for arcname, _ in files):
            if (folder / MODEL_DIR / FILES_MANIFEST).is_file():
                raise Conflict(
                    f"checkpoint {checkpoint} of job {job.id} is a whole model (peft method "
                    f"full), not an adapter: GET /v1/jobs/{job.id}/model?checkpoint="
                    f"{checkpoint} lists its files", param="checkpoint",
                )
            raise Conflict(f"checkpoint {checkpoint} holds no adapter files", param="checkpoint")
        name = f"{job.id}-checkpoint-{checkpoint}"
    if not files:
        raise Conflict("adapter not available: no files")
    return name, files


def _regular_files(
    root: Path, folder: Path, allow: frozenset[str] | None
) -> list[tuple[str, Path]]:
    out = []
    for entry in sorted(folder.iterdir()):
        if allow is not None and entry.name not in allow:
            continue
        resolved = inside(root, entry)  # a symlink out of the job dir is skipped
        if resolved is not None and resolved.is_file():
            out.append((entry.name, resolved))
    return out


# --------------------------------------------------------------------------- full models


def _checkpoint_folder(session: Session, job: Job, step: int) -> Path:
    """The directory of a recorded checkpoint that is still stored."""
    ckpt = session.scalar(
        select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step)
    )
    if ckpt is None:
        raise NotFound(f"job {job.id} has no checkpoint at step {step}", param="checkpoint")
    root = job_root(job)
    folder = inside(root, ckpt.path) if root else None
    if folder is None or not folder.is_dir():
        raise Conflict(f"checkpoint {step} is no longer stored", param="checkpoint")
    return folder


def _model_folder(
    session: Session, job: Job, checkpoint: int | None
) -> tuple[Path, list[dict[str, Any]]]:
    """The published model directory of a full fine-tune (the final one, or a checkpoint's:
    ``checkpoint-N/model``, written by the trainer as the final one is) and its files.json
    entries."""
    root = job_root(job)
    folder: Path | None
    if checkpoint is not None:
        in_checkpoint = _checkpoint_folder(session, job, checkpoint) / MODEL_DIR
        if not (in_checkpoint / FILES_MANIFEST).is_file():
            full = isinstance(job.spec, dict) and (job.spec.get("peft") or {}).get(
                "method") == "full"
            raise Conflict(
                f"checkpoint {checkpoint} holds no model: "
                + ("its model/ folder is missing (written by a trainer that predates "
                   "models in every checkpoint, or removed)" if full
                   else f"job {job.id} trains an adapter: GET /v1/jobs/{job.id}/adapter?"
                   f"checkpoint={checkpoint} downloads it"), param="checkpoint",
            )
        folder = inside(root, in_checkpoint) if root else None
        manifest = inside(root, in_checkpoint / FILES_MANIFEST) if root else None
    else:
        if not artifact_kept(job) or not job.adapter_path or root is None:
            raise Conflict(f"model not available: job is {job.status}")
        if Path(job.adapter_path).name != MODEL_DIR:
            raise Conflict(
                f"job {job.id} trained an adapter, not the whole model: GET "
                f"/v1/jobs/{job.id}/adapter downloads it"
            )
        folder = inside(root, job.adapter_path)
        manifest = inside(root, Path(job.adapter_path) / FILES_MANIFEST)
    if folder is None or manifest is None or not manifest.is_file():
        raise Conflict("model not available: its files are missing")
    entries = json.loads(manifest.read_text()).get("files") or []
    return folder, [e for e in entries if isinstance(e, dict) and isinstance(e.get("name"), str)]


def model_files(session: Session, job: Job, checkpoint: int | None = None) -> ModelFiles:
    """The listing: every file with its size and sha256 (computed by the trainer as it
    published the model), each downloadable on its own."""
    _, entries = _model_folder(session, job, checkpoint)
    query = f"?checkpoint={checkpoint}" if checkpoint is not None else ""
    data = [
        ModelFile(name=e["name"], bytes=int(e["bytes"]), sha256=str(e["sha256"]),
                  url=f"/v1/jobs/{job.id}/model/{e['name']}{query}")
        for e in entries
    ]
    return ModelFiles(job_id=job.id, checkpoint=checkpoint,
                      total_bytes=sum(f.bytes for f in data), data=data)


def model_file(session: Session, job: Job, name: str, checkpoint: int | None = None) -> Path:
    """One file of the model, by its name in the listing (nothing else is served)."""
    folder, entries = _model_folder(session, job, checkpoint)
    if name not in {e["name"] for e in entries}:
        raise NotFound(f"job {job.id}'s model has no file {name!r}", param="name")
    path = inside(folder, name)
    if path is None or not path.is_file():
        raise Conflict(f"model file {name!r} is missing")
    return path


# --------------------------------------------------------------------------- tensorboard


def tensorboard_files(job: Job) -> list[tuple[str, Path]]:
    """[(name in zip, file)] of the job's TensorBoard event files, under tensorboard/ in the
    zip (unzip, then `tensorboard --logdir tensorboard`). Written while the job runs."""
    root = job_root(job)
    folder = inside(root, TENSORBOARD_DIR) if root else None
    if root is None or folder is None or not folder.is_dir():
        raise Conflict(
            f"job {job.id} has no TensorBoard files (tracking.report_to needs tensorboard, "
            "and the run must have started)"
        )
    out = []
    for dirpath, _dirs, names in os.walk(folder):  # os.walk does not follow symlinked dirs
        for name in sorted(names):
            resolved = inside(root, Path(dirpath) / name)
            if resolved is not None and resolved.is_file():
                out.append((str((Path(dirpath) / name).relative_to(root)), resolved))
    if not out:
        raise Conflict(f"job {job.id} has no TensorBoard files yet")
    return sorted(out)


class _Sink:
    """A write-only, non-seekable stream that zipfile writes to and we drain as chunks."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.pos = 0

    def write(self, b: bytes) -> int:
        self.chunks.append(bytes(b))
        self.pos += len(b)
        return len(b)

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass  # zipfile never closes a stream it was handed; typeshed's protocol wants it

    def drain(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data


def stream_zip(files: list[tuple[str, Path]]) -> Iterator[bytes]:
    """Zip ``files`` (at the top level of the zip) while streaming: never the whole zip in
    memory. Weights are stored as they are (they do not compress), the rest deflated."""
    sink = _Sink()
    with zipfile.ZipFile(sink, mode="w", allowZip64=True) as zf:
        for arcname, path in files:
            packed = path.suffix in (".safetensors", ".bin", ".model")
            info = zipfile.ZipInfo.from_file(path, arcname)
            info.compress_type = zipfile.ZIP_STORED if packed else zipfile.ZIP_DEFLATED
            with open(path, "rb") as src, zf.open(info, "w") as dst:
                while chunk := src.read(ZIP_CHUNK):
                    dst.write(chunk)
                    if data := sink.drain():
                        yield data
            if data := sink.drain():
                yield data
    if data := sink.drain():
        yield data

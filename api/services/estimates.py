"""Dry run: the checks of a submit, then what the job would use: tokens, steps and memory
(core/model/spec_estimate.py, the estimate `ftune estimate` makes locally), time and cost
from the fleet's history (core/jobs/throughput.py)."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session

from api.schemas import DataEstimate, EstimateObject, MemoryEstimate
from api.services.jobs import validate_submission
from core.data import counts
from core.db.models import Tenant
from core.infra.settings import Settings
from core.jobs import usage
from core.jobs.throughput import throughput_history
from core.model.spec_estimate import estimate_spec
from core.policy import Refused, model_kind, model_location
from core.spec import resolved_spec

log = logging.getLogger("ftune.api")


def dry_run(
    session: Session, tenant: Tenant, body: Any, *, settings: Settings, preview: int = 3
) -> EstimateObject:
    """Same 422s as a submit; then exact token counts and steps, memory per process, the
    expected wall time and cost from this fleet's history, and the first ``preview`` rows
    as the trainer renders them."""
    spec, summary = validate_submission(session, tenant, body, settings=settings)
    notes: list[str] = []
    model_path: str | None = None
    if model_kind(spec.model.name_or_path) == "path" and not spec.model.trust_remote_code:
        try:
            model_path = model_location(spec.model.name_or_path, settings)
        except Refused as e:  # checked by validate_submission; kept for the type
            notes.append(e.message)
    else:
        notes.append(
            "the model's tokenizer and config are not available here (a hub model, or remote "
            "code, is read by the worker only): no token counts, steps or memory"
        )

    data: DataEstimate | None = None
    shown: list[dict[str, Any]] | None = None
    steps: int | None = None
    epochs: float | None = None
    trained: int | None = None
    rows = (summary.train_rows or 0) + (summary.eval_rows or 0)
    if rows > settings.dry_run_max_rows:
        # Tokenizing runs in the API process: bounded, so a dry run cannot tie it up.
        notes.append(
            f"the data has {rows} rows, more than FTUNE_DRY_RUN_MAX_ROWS "
            f"({settings.dry_run_max_rows}): tokens not counted here; `ftune estimate` with "
            "dataset.path counts them locally"
        )
    counted = rows <= settings.dry_run_max_rows
    detected = summary.resolution.layout.format if summary.resolution else None
    result = estimate_spec(
        spec, model_path, summary.train_path if counted else None, summary.eval_path,
        data_format=detected, max_decompressed_bytes=settings.decompressed_limit,
    )
    notes.extend(result.notes)
    count = result.count
    if count is not None:
        assert model_path is not None and summary.train_path is not None
        data = DataEstimate(
            rows=count.rows, examples=count.examples, tokens_per_epoch=count.tokens,
            loss_tokens_per_epoch=count.loss_tokens, truncated=count.truncated,
            dropped=count.dropped, eval_examples=count.eval_examples,
            generated_tokens_per_epoch=count.generated_tokens or None,
        )
        if preview and summary.resolution is not None:
            shown = counts.preview(
                spec, model_path, summary.train_path, summary.resolution, preview,
                settings.decompressed_limit,
            )
        steps, epochs, trained = result.steps, result.epochs, result.trained_tokens

    memory: MemoryEstimate | None = None
    base_params: int | None = None
    if (m := result.memory) is not None:
        base_params = m.total_params - m.trainable_params
        memory = MemoryEstimate(
            total_params=m.total_params, trainable_params=m.trainable_params,
            processes=m.world_size, weights_dtype=m.weights_dtype,
            weights_mb=round(m.gpu_weights_mb, 3),
            training_state_mb=round(m.gpu_training_state_mb, 3),
            activations_mb=round(m.gpu_activations_mb, 3),
            total_mb=round(m.gpu_total_mb, 3), cpu_offloaded_mb=round(m.cpu_offloaded_mb, 3),
        )

    history = throughput_history(session, base_params) if base_params is not None else None
    wall = gpu = None
    if history is None:
        notes.append("no history: no succeeded job of this model size on this fleet yet")
    elif trained is not None:
        wall = round(trained / history.tokens_per_second, 1)
        gpu = round(wall * spec.distributed.processes, 1)
    price = settings.price_per_gpu_hour
    return EstimateObject(
        spec=resolved_spec(spec),
        data=data,
        steps=steps,
        epochs=epochs,
        trained_tokens=trained,
        memory=memory,
        tokens_per_second=round(history.tokens_per_second, 2) if history else None,
        history_jobs=history.jobs if history else 0,
        wall_seconds=wall,
        gpu_seconds=gpu,
        cost=usage.cost(gpu, price) if gpu is not None else None,
        currency=settings.price_currency if price is not None else None,
        notes=notes,
        data_format=summary.data,
        preview=shown,
    )

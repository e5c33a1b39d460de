"""The job's experiment trackers: TensorBoard, MLflow and W&B, one run per job.

Where each tracker writes was decided by the worker from the operator's settings
(spec.json ``runtime.tracking``, see core/policy/tracking.py); nothing here takes a
destination from the spec itself. Two writers use these classes: the trainer (rank 0, fed
from the Trainer's logs: core/train/tracking.py) and the worker once training is over, which
adds the job's evaluation scores to the same runs (core/evals/job_tracking.py). So they live
below both, with no torch or transformers at import time.

Per run, every tracker gets: params = the spec as it ran (defaults filled in), metrics =
every number the Trainer logs (train/loss, eval/loss, DPO's train/rewards/chosen, ...) at its
optimizer step, the evaluation scores at the step of the model scored, and the final adapter
as an artifact. A retried attempt, and the worker's evaluation after the trainer has ended,
continue the same MLflow and W&B run (found by the job id), so one job is one run.

A tracker that cannot start raises TrainFailure: the trainer fails the job before training
(the operator's configuration is wrong, and a run that silently logs nowhere is worse). One
that fails later is dropped with a warning event: losing a curve must not lose hours of
training.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.infra.errors import ErrorCode, TrainFailure
from core.policy.tracking import TENSORBOARD_DIR, WANDB_DIR

log = logging.getLogger(__name__)

# An event sink: (event type, **fields), as core.train.events.EventLog.emit.
Emit = Callable[..., None]

# Scores have their own x-axis on W&B (its steps only go forward, and a job's scores are
# logged after training, from step 0 on: the base model).
SCORE_STEP = "evals/step"


def score_metric(eval_id: str, criterion: str, figure: str) -> str:
    """The tracker name of one evaluation figure: evals/<eval>/<criterion>/<figure>, with
    what MLflow refuses in a name (anything but letters, digits, _ - . / and spaces) as _."""
    return "/".join(("evals", *(re.sub(r"[^\w\-. ]", "_", p) for p in (eval_id, criterion)),
                     figure))


# MLflow's limits: 100 params or 1000 metrics per batch call, 6000 characters a param value.
_PARAMS_PER_CALL = 100
_METRICS_PER_CALL = 1000
_PARAM_VALUE_MAX = 6000


def metric_name(key: str) -> str:
    """Trainer log key -> tracker name, as transformers' own integrations name them:
    eval_loss -> eval/loss, loss -> train/loss."""
    for prefix in ("eval_", "test_"):
        if key.startswith(prefix):
            return f"{prefix[:-1]}/{key[len(prefix):]}"
    return f"train/{key}"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested spec -> {"training.learning_rate": "0.0002", ...} (lists as JSON)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            text = v if isinstance(v, str) else json.dumps(v)
            out[key] = text[:_PARAM_VALUE_MAX]
    return out


class _Tracker:
    name = ""

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_scores(self, metrics: dict[str, float], step: int) -> None:
        """Evaluation scores of the model at ``step`` (0: the base), logged after training."""
        self.log(metrics, step)

    def log_adapter(self, adapter: Path) -> None:
        """The final adapter as an artifact (trackers without artifacts skip it)."""

    def close(self, status: str) -> None:
        raise NotImplementedError

    def link(self) -> dict[str, Any]:
        raise NotImplementedError


class _TensorBoard(_Tracker):
    name = "tensorboard"

    def __init__(self, job_root: Path, spec: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed attempt adds a new event file next to the first: TensorBoard reads the
        # directory as one run, and the steps continue from the checkpoint.
        # flush_secs: the files can be downloaded while the job runs (default 120 s).
        self.writer = SummaryWriter(log_dir=str(job_root / TENSORBOARD_DIR), flush_secs=10)
        self.writer.add_text("spec", "```json\n" + json.dumps(spec, indent=2) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self, status: str) -> None:
        self.writer.close()

    def link(self) -> dict[str, Any]:
        return {"logdir": TENSORBOARD_DIR}


class _MLflow(_Tracker):
    name = "mlflow"

    def __init__(
        self, conf: dict[str, Any], job_id: str, run_name: str, tags: dict[str, str],
        spec: dict[str, Any],
    ) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=conf["tracking_uri"])
        self.ui_url = conf.get("ui_url")
        self.experiment_id = self._experiment(
            conf["experiment_name"], conf.get("artifact_location") or None
        )
        found = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`ftune.job_id` = '{_quoted(job_id)}'",
            max_results=1,
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags)
            self.run_id = run.info.run_id
        # The same values again on a resumed run: MLflow accepts a param logged twice only
        # with the value it has, which a retry of the same spec always has.
        params = [Param(k, v) for k, v in flatten(spec).items()]
        for i in range(0, len(params), _PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + _PARAMS_PER_CALL])
        self.client.log_dict(self.run_id, spec, "spec.json")

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        existing = self.client.get_experiment_by_name(name)
        if existing is not None:
            return str(existing.experiment_id)
        try:
            return str(self.client.create_experiment(name, artifact_location=artifact_location))
        except Exception:
            # Another job created it in between.
            existing = self.client.get_experiment_by_name(name)
            if existing is None:
                raise
            return str(existing.experiment_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), _METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=batch[i : i + _METRICS_PER_CALL])

    def log_adapter(self, adapter: Path) -> None:
        self.client.log_artifacts(self.run_id, str(adapter), "adapter")

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)

    def link(self) -> dict[str, Any]:
        url = None
        if self.ui_url:
            url = f"{self.ui_url}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "url": url}


class _Wandb(_Tracker):
    name = "wandb"

    def __init__(
        self, conf: dict[str, Any], job_root: Path, job_id: str, run_name: str,
        tags: dict[str, str], spec: dict[str, Any],
    ) -> None:
        import os

        import wandb

        # W&B's staging and cache directories default to the worker's home, which would
        # grow with every job; under the job directory they go with the job. (Restored at
        # close: the variables are read while the run lives, and the process may go on.)
        self.env_before = {v: os.environ.get(v) for v in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR")}
        for var, sub in (("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache")):
            os.environ.setdefault(var, str(job_root / WANDB_DIR / sub))
        server = {"base_url": conf["base_url"]} if conf.get("base_url") else {}
        settings = wandb.Settings(
            **server,
            silent=True,
            console="off",  # the trainer's output is in trainer.log already
            save_code=False,
            disable_git=True,
            x_disable_stats=True,
        )
        # id = the job id (W&B ids allow letters, digits, - and _): a retry resumes the run.
        self.run = wandb.init(
            mode=conf["mode"],
            dir=str(job_root),
            project=conf["project"],
            entity=conf.get("entity") or None,
            name=run_name,
            id=re.sub(r"[^A-Za-z0-9_-]", "-", job_id)[:128],
            resume="allow",
            config={**spec, "tags": tags},
            # W&B tags are short labels, not key/value pairs: "key=value", cut to 64.
            tags=[f"{k}={v}"[:64] for k, v in tags.items()],
            settings=settings,
            reinit="create_new",
        )
        self.score_axis = False  # evals/* defined against evals/step yet

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_scores(self, metrics: dict[str, float], step: int) -> None:
        if not self.score_axis:
            # W&B's documented custom x-axis: every evals/* metric against evals/step.
            self.run.define_metric(SCORE_STEP)
            self.run.define_metric("evals/*", step_metric=SCORE_STEP)
            self.score_axis = True
        self.run.log({**metrics, SCORE_STEP: step})

    def log_adapter(self, adapter: Path) -> None:
        import wandb

        artifact = wandb.Artifact(f"adapter-{self.run.id}", type="model")
        # immutable: the published adapter never changes, so W&B need not stage a copy of it
        # (mutable, its default, copies every file under ~/.local/share/wandb first).
        artifact.add_dir(str(adapter), policy="immutable")
        self.run.log_artifact(artifact)

    def close(self, status: str) -> None:
        import os

        try:
            self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        finally:
            for var, value in self.env_before.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value

    def link(self) -> dict[str, Any]:
        return {
            "run_id": self.run.id,
            "project": self.run.project,
            "entity": self.run.entity or None,
            "url": self.run.url,
            "mode": self.run.settings.mode,
        }


def _quoted(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


class Tracking:
    """The job's trackers (none on ranks other than 0, or when the spec asks for none)."""

    def __init__(self, trackers: list[_Tracker], emit: Emit) -> None:
        self.trackers = trackers
        self.emit = emit
        self.closed = False

    @classmethod
    def open(cls, job_root: Path, conf: dict[str, Any] | None, job_id: str,
             spec: dict[str, Any], emit: Emit, *, announce: bool = True) -> Tracking:
        """Start every tracker in ``conf`` (runtime.tracking), each continuing the job's run
        when it has one, and (``announce``) name the runs in a "tracking" event; raises
        TrainFailure if one cannot start."""
        if not conf:
            return cls([], emit)
        run_name = str(conf.get("run_name") or job_id)
        tags = {str(k): str(v) for k, v in (conf.get("tags") or {}).items()}
        trackers: list[_Tracker] = []
        for name in conf.get("report_to", []):
            try:
                if name == "tensorboard":
                    trackers.append(_TensorBoard(job_root, spec))
                elif name == "mlflow":
                    trackers.append(_MLflow(conf["mlflow"], job_id, run_name, tags, spec))
                elif name == "wandb":
                    trackers.append(
                        _Wandb(conf["wandb"], job_root, job_id, run_name, tags, spec)
                    )
                else:
                    raise ValueError(f"unknown tracker {name!r}")
            except Exception as e:
                for started in trackers:
                    started.close("FAILED")
                raise TrainFailure(
                    ErrorCode.internal, f"tracking: {name} could not start: {e}"
                ) from e
        tracking = cls(trackers, emit)
        if announce:
            emit("tracking", **{t.name: t.link() for t in trackers})
        return tracking

    def _each(self, what: str, fn: Callable[[_Tracker], None]) -> None:
        for t in list(self.trackers):
            try:
                fn(t)
            except Exception as e:
                log.warning("tracking: %s failed to %s", t.name, what, exc_info=True)
                self.emit(
                    "log",
                    level="warning",
                    message=f"tracking: {t.name} failed to {what} ({e}); it logs no more "
                    "for this run",
                )
                self.trackers.remove(t)

    def log(self, logs: dict[str, Any], step: int) -> None:
        metrics = {
            metric_name(k): float(v)
            for k, v in logs.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if metrics:
            self._each("log metrics", lambda t: t.log(metrics, step))

    def log_scores(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self._each("log evaluation scores", lambda t: t.log_scores(metrics, step))

    def finish(self, adapter: Path | None, status: str) -> None:
        """Log the adapter (when there is one) and end every run with ``status``
        (MLflow's FINISHED, FAILED or KILLED). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if adapter is not None:
            self._each("log the adapter", lambda t: t.log_adapter(adapter))
        self._each("close its run", lambda t: t.close(status))

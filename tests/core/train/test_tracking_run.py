"""Experiment tracking for real: one tiny training run feeds TensorBoard, MLflow and W&B at
once; each test reads back what one tracker wrote, through that tracker's own reader.

MLflow: a SQLite store read through MlflowClient, not a `mlflow server`: the server needs
the full mlflow package, whose newest release that fits our pins (SQLAlchemy 2.1, pyarrow
26, ...) is 1.26; mlflow-skinny 3.x has the client and the stores but no server. The store
is the same one a server would put behind its REST API.

W&B: offline mode, as the operator's default; the run's .wandb file is read back record by
record (W&B's own protobuf records in its LevelDB-style log).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils.jobdirs import events, make_job, of_type, read_error
from tests.utils.tiny import text_rows

STEPS = 4


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MLflow SQLite store for the module: creating its schema takes seconds."""
    return tmp_path_factory.mktemp("mlflow")


def store_uri(store: Path) -> str:
    return f"sqlite:///{store / 'mlflow.db'}"


def tracked_job(root: Path, model: Path, report_to: list[str], store: Path | None = None,
                **tracking: Any) -> Path:
    conf: dict[str, Any] = {
        "report_to": report_to,
        "run_name": "tiny-run",
        "tags": {"team": "nlp", "ftune.job_id": "job-track", "ftune.tenant_id": "ten-a"},
        **tracking,
    }
    if "mlflow" in report_to:
        assert store is not None or "mlflow" in tracking
        conf.setdefault("mlflow", {
            "tracking_uri": store_uri(store or root),
            "experiment_name": "ftune-tests",
            "artifact_location": str(root / "mlflow-artifacts"),
            "ui_url": "http://mlflow.example",
        })
    if "wandb" in report_to:
        conf.setdefault("wandb", {"mode": "offline", "project": "ftune-tests", "entity": None,
                                  "base_url": None})
    return make_job(
        root,
        model,
        text_rows(32),
        spec={
            "dataset": {"eval_split": 0.25},
            "tracking": {"report_to": report_to, "run_name": "tiny-run",
                         "tags": {"team": "nlp"}},
            "training": {"max_steps": STEPS, "logging_steps": 1, "save_steps": 2,
                         "eval_steps": 2},
        },
        runtime={"job_id": "job-track", "tracking": conf},
    )


@pytest.fixture(scope="module")
def tracked_run(
    tiny_causal_lm: Path, tmp_path_factory: pytest.TempPathFactory, store: Path
) -> Path:
    import signal

    from core.train.__main__ import main

    job = tracked_job(tmp_path_factory.mktemp("tracked"), tiny_causal_lm,
                      ["tensorboard", "mlflow", "wandb"], store)
    previous = signal.getsignal(signal.SIGTERM)  # main installs its own
    try:
        status = main([str(job)])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert status == 0, read_error(job)
    return job


def progress_losses(job: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in of_type(events(job), "progress") if "loss" in e}


def test_the_tracking_event_links_every_run(tracked_run: Path) -> None:
    (ev,) = of_type(events(tracked_run), "tracking")
    assert ev["tensorboard"] == {"logdir": "tensorboard"}
    mlflow = ev["mlflow"]
    assert mlflow["url"] == (
        f"http://mlflow.example/#/experiments/{mlflow['experiment_id']}/runs/{mlflow['run_id']}"
    )
    assert ev["wandb"]["run_id"] == "job-track" and ev["wandb"]["mode"] == "offline"


def test_tensorboard_holds_the_curves(tracked_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked_run / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "eval/loss"} <= set(tags)
    logged = {s.step: s.value for s in acc.Scalars("train/loss")}
    expected = progress_losses(tracked_run)
    assert sorted(logged) == sorted(expected) == list(range(1, STEPS + 1))
    assert all(logged[s] == pytest.approx(expected[s], rel=1e-6) for s in expected)
    assert [s.step for s in acc.Scalars("eval/loss")] == [2, 4]
    assert "spec/text_summary" in acc.Tags()["tensors"]


def test_mlflow_run_has_the_spec_the_curves_and_the_adapter(
    tracked_run: Path, store: Path, tmp_path: Path
) -> None:
    from mlflow import MlflowClient

    (ev,) = of_type(events(tracked_run), "tracking")
    client = MlflowClient(tracking_uri=store_uri(store))
    run = client.get_run(ev["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny-run"
    assert run.data.tags["team"] == "nlp" and run.data.tags["ftune.job_id"] == "job-track"

    # Params: the spec as it ran, defaults filled in.
    spec = json.loads((tracked_run / "spec.json").read_text())["spec"]
    params = run.data.params
    assert params["model.name_or_path"] == spec["model"]["name_or_path"]
    assert float(params["training.learning_rate"]) == spec["training"]["learning_rate"]
    assert params["training.lr_scheduler_type"] == "linear"  # a default, not in spec.json
    assert json.loads(params["tracking.report_to"]) == ["tensorboard", "mlflow", "wandb"]

    history = client.get_metric_history(run.info.run_id, "train/loss")
    expected = progress_losses(tracked_run)
    assert {m.step: m.value for m in history} == pytest.approx(expected, rel=1e-6)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [2, 4]

    assert run.info.artifact_uri.startswith(str(tracked_run.parent / "mlflow-artifacts"))
    listed = {a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= listed
    local = Path(client.download_artifacts(run.info.run_id, "adapter", str(tmp_path)))
    original = tracked_run / "adapter" / "adapter_model.safetensors"
    assert (local / "adapter_model.safetensors").read_bytes() == original.read_bytes()


def _wandb_records(path: Path) -> Iterator[Any]:
    """Records of a .wandb file: a 7-byte header (":W&B", magic, version), then 32 KiB
    blocks of chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first,
    3 middle, 4 last) holding a serialized wandb_internal Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32 * 1024, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        if kind == 0:  # zero padding up to the block end
            pos += left - 7
            continue
        pending += data[pos : pos + length]
        pos += length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_has_the_spec_the_curves_and_the_adapter(tracked_run: Path) -> None:
    # The first run directory is the trainer's (the scores' test below adds one).
    run_file = min((tracked_run / "wandb").glob("offline-run-*-job-track/*.wandb"))
    runs, history, artifacts = [], {}, []
    for r in _wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            runs.append(r.run)
        elif kind == "history":
            # A key with a "/" is stored as its nested_key.
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in r.history.item}
            if "train/loss" in items:
                history[items["_step"]] = items["train/loss"]
        elif kind == "artifact":
            artifacts.append(r.artifact)
    (run,) = runs
    assert (run.run_id, run.project, run.display_name) == ("job-track", "ftune-tests", "tiny-run")
    assert "team=nlp" in run.tags
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["training"]["max_steps"] == STEPS
    assert config["training"]["lr_scheduler_type"] == "linear"

    assert history == pytest.approx(progress_losses(tracked_run), rel=1e-6)
    (artifact,) = artifacts
    assert artifact.type == "model"
    files = {e.path for e in artifact.manifest.contents}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    # The W&B directories pointed into the job directory for the run only.
    assert "WANDB_DATA_DIR" not in os.environ and "WANDB_CACHE_DIR" not in os.environ


def test_the_workers_evaluation_scores_continue_the_trainers_runs(
    tracked_run: Path, store: Path
) -> None:
    """core/evals/job_tracking.py: once training is over the worker scores the models and
    logs each one's figures to the job's runs, at the step of the model scored."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from core.db.models import Job
    from core.evals.job_results import CriterionScore, ModelScore
    from core.evals.job_tracking import ScoreTracking

    def scored(stage: Any, step: int | None, rate: float) -> ModelScore:
        return ModelScore(stage=stage, step=step, model=f"{stage}-{step}", eval_id="eval_1",
                          run_id="r", status="completed", result_counts={},
                          criteria={"says it": CriterionScore(pass_rate=rate,
                                                              mean_score=rate / 2)})

    (ev,) = of_type(events(tracked_run), "tracking")
    before = MlflowClient(tracking_uri=store_uri(store)).get_run(ev["mlflow"]["run_id"])
    trackers = ScoreTracking(Job(id="job-track", job_dir=str(tracked_run), step=STEPS))
    for s in (scored("base", None, 0.0), scored("checkpoints", 2, 0.5),
              scored("final", None, 1.0)):
        trackers.log(s)
    trackers.close("FINISHED")
    assert trackers.take_events() == []  # no warning: every tracker took them
    name, expected = "evals/eval_1/says it/pass_rate", [(0, 0.0), (2, 0.5), (STEPS, 1.0)]

    acc = EventAccumulator(str(tracked_run / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars(name)] == expected
    assert len(acc.Scalars("train/loss")) == STEPS  # the trainer's curves are still there

    client = MlflowClient(tracking_uri=store_uri(store))
    run = client.get_run(ev["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params == before.data.params
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)] \
        == expected
    assert [(m.step, m.value) for m in client.get_metric_history(
        run.info.run_id, "evals/eval_1/says it/mean_score")] == [(0, 0.0), (2, 0.25), (4, 0.5)]

    # W&B: the same run id, resumed; the scores plotted against their own axis.
    *_, scores_file = sorted((tracked_run / "wandb").glob("offline-run-*-job-track/*.wandb"))
    logged, axes = [], set()
    for r in _wandb_records(scores_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            assert r.run.run_id == "job-track"
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in r.history.item}
            logged.append((items["evals/step"], items[name]))
        elif kind == "metric" and r.metric.step_metric:
            axes.add((r.metric.glob_name, r.metric.step_metric))
    assert logged == expected
    assert ("evals/*", "evals/step") in axes


def test_a_tracker_that_cannot_start_fails_the_job_before_training(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Any
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    job = tracked_job(
        tmp_path, tiny_causal_lm, ["mlflow"],
        mlflow={"tracking_uri": f"sqlite:///{blocker}/x/mlflow.db", "experiment_name": "e",
                "ui_url": None},
    )
    assert run_main(job) == 1
    error = read_error(job)
    assert error["code"] == "internal"
    assert error["message"].startswith("tracking: mlflow could not start")
    assert not of_type(events(job), "progress")


def mlflow_only(root: Path, job_id: str, store: Path) -> dict[str, Any]:
    return {
        "report_to": ["mlflow"], "run_name": "r", "tags": {"ftune.job_id": job_id},
        "mlflow": {"tracking_uri": store_uri(store), "experiment_name": "e",
                   "artifact_location": str(root / "artifacts"), "ui_url": None},
    }


def test_a_retried_attempt_continues_the_same_mlflow_run(tmp_path: Path, store: Path) -> None:
    from mlflow import MlflowClient

    from core.run.trackers import Tracking
    from core.train.events import EventLog

    conf, spec = mlflow_only(tmp_path, "job-r", store), {"training": {"learning_rate": 0.1}}
    log = EventLog(tmp_path / "events.jsonl", enabled=True)
    first = Tracking.open(tmp_path, conf, "job-r", spec, log.emit)
    first.log({"loss": 2.0}, 1)
    first.finish(None, "KILLED")  # cancelled or timed out; requeued
    second = Tracking.open(tmp_path, conf, "job-r", spec, log.emit)
    second.log({"loss": 1.0}, 2)
    second.finish(None, "FINISHED")

    run_ids = {e["mlflow"]["run_id"] for e in of_type(events(tmp_path), "tracking")}
    assert len(run_ids) == 1
    client = MlflowClient(tracking_uri=conf["mlflow"]["tracking_uri"])
    (run_id,) = run_ids
    assert client.get_run(run_id).info.status == "FINISHED"
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.0)]


def test_a_tracker_failing_mid_run_is_dropped_with_a_warning(
    tmp_path: Path, store: Path
) -> None:
    from mlflow import MlflowClient

    from core.run.trackers import Tracking
    from core.train.events import EventLog

    conf = mlflow_only(tmp_path, "job-f", store)
    tracking = Tracking.open(tmp_path, conf, "job-f", {},
                             EventLog(tmp_path / "events.jsonl", enabled=True).emit)
    (ev,) = of_type(events(tmp_path), "tracking")
    # The server loses the run (deleted by someone): logging to it is refused.
    MlflowClient(tracking_uri=conf["mlflow"]["tracking_uri"]).delete_run(ev["mlflow"]["run_id"])
    tracking.log({"loss": 1.0}, 1)
    tracking.log({"loss": 0.5}, 2)
    tracking.finish(None, "FINISHED")

    (warning,) = [e for e in of_type(events(tmp_path), "log") if e["level"] == "warning"]
    assert warning["message"].startswith("tracking: mlflow failed to log metrics")
    assert tracking.trackers == []


def test_a_spec_asking_for_trackers_the_runtime_lacks_is_refused(
    tiny_causal_lm: Path, tmp_path: Path, run_main: Any
) -> None:
    job = make_job(tmp_path, tiny_causal_lm, text_rows(8),
                   spec={"tracking": {"report_to": ["tensorboard"]}})
    assert run_main(job) == 1
    error = read_error(job)
    assert error["code"] == "invalid_spec"
    assert "runtime.tracking resolves []" in error["message"]
    assert not (job / "tensorboard").exists()

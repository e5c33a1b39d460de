"""Tracking policy: a spec names trackers; the operator decides which are allowed and where
they write (core/policy/tracking.py), and the spec's own checks (core/spec/)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from core.infra.settings import Settings
from core.policy import resolve_tracking, tracking_refusals
from core.spec import JobSpec, SpecError
from tests.utils.specs import parsed_spec

SERVER = "http://mlflow.internal:5000"


def job_spec(**tracking: Any) -> JobSpec:
    return parsed_spec(dataset={"file_id": "file-1"}, tracking=tracking)


def settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(data_dir=tmp_path, **kw)


def refused(spec: JobSpec, s: Settings) -> dict[str, str]:
    return {r.param: r.message for r in tracking_refusals(spec.tracking, s)}


def test_tensorboard_is_allowed_by_default_and_the_others_are_not(tmp_path: Path) -> None:
    s = settings(tmp_path)
    assert refused(job_spec(report_to=["tensorboard"]), s) == {}
    problems = refused(job_spec(report_to=["tensorboard", "mlflow", "wandb"]), s)
    assert problems == {
        "tracking.report_to": "mlflow, wandb not enabled on this server (allowed: tensorboard)"
    }


def test_mlflow_cannot_be_allowed_without_a_tracking_uri(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="FTUNE_MLFLOW_TRACKING_URI"):
        settings(tmp_path, tracking_allowed="tensorboard,mlflow")


def test_settings_read_trackers_and_uris_comma_separated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FTUNE_TRACKING_ALLOWED", "tensorboard, mlflow,wandb")
    monkeypatch.setenv("FTUNE_MLFLOW_TRACKING_URI", SERVER)
    monkeypatch.setenv("FTUNE_MLFLOW_ALLOWED_TRACKING_URIS", "http://a:5000,http://b:5000")
    s = Settings(data_dir=tmp_path)
    assert s.tracking_allowed == ["tensorboard", "mlflow", "wandb"]
    assert s.mlflow_allowed_tracking_uris == ["http://a:5000", "http://b:5000"]


def test_a_spec_cannot_point_mlflow_at_a_server_the_operator_did_not_allow(
    tmp_path: Path,
) -> None:
    s = settings(tmp_path, tracking_allowed=["mlflow"], mlflow_tracking_uri=SERVER,
                 mlflow_allowed_tracking_uris=["http://team-b:5000"])
    evil = job_spec(report_to=["mlflow"], mlflow_tracking_uri="http://attacker.example:80")
    assert list(refused(evil, s)) == ["tracking.mlflow_tracking_uri"]
    for ok in (SERVER, "http://team-b:5000"):
        assert refused(job_spec(report_to=["mlflow"], mlflow_tracking_uri=ok), s) == {}


def test_resolve_takes_destinations_from_the_operator(tmp_path: Path) -> None:
    s = settings(
        tmp_path, tracking_allowed=["tensorboard", "mlflow", "wandb"],
        mlflow_tracking_uri=SERVER, mlflow_experiment_name="team", wandb_project="p",
        wandb_entity="org", wandb_mode="online",
    )
    spec = job_spec(report_to=["mlflow", "wandb"], run_name="r1",
                    tags={"team": "nlp", "ftune.tenant_id": "someone-else"})
    rt = resolve_tracking(spec, s, job_id="job-1", tenant_id="ten-1")
    assert rt == {
        "report_to": ["mlflow", "wandb"],
        "run_name": "r1",
        # The job's own ids win over a spec's tag of the same name.
        "tags": {"team": "nlp", "ftune.job_id": "job-1", "ftune.tenant_id": "ten-1"},
        "mlflow": {"tracking_uri": SERVER, "experiment_name": "team/ten-1",
                   "artifact_location": None,
                   "ui_url": SERVER},
        "wandb": {"mode": "online", "project": "p", "entity": "org", "base_url": None},
    }


def test_no_link_to_a_store_without_a_ui(tmp_path: Path) -> None:
    s = settings(tmp_path, tracking_allowed=["mlflow"], mlflow_tracking_uri="sqlite:////m.db")
    rt = resolve_tracking(job_spec(report_to=["mlflow"]), s, job_id="job-1", tenant_id="t")
    assert rt is not None and rt["mlflow"]["ui_url"] is None and rt["run_name"] == "job-1"
    s = settings(tmp_path, tracking_allowed=["mlflow"], mlflow_tracking_uri="sqlite:////m.db",
                 mlflow_ui_url="https://mlflow.example/")
    rt = resolve_tracking(job_spec(report_to=["mlflow"]), s, job_id="job-1", tenant_id="t")
    assert rt is not None and rt["mlflow"]["ui_url"] == "https://mlflow.example"


def test_no_trackers_resolves_to_none(tmp_path: Path) -> None:
    assert resolve_tracking(job_spec(), settings(tmp_path), job_id="j", tenant_id="t") is None


@pytest.mark.parametrize(
    ("tracking", "param"),
    [
        ({"report_to": ["tensorboard", "tensorboard"]}, "tracking.report_to"),
        ({"report_to": ["tensorboard"], "mlflow_tracking_uri": SERVER},
         "tracking.mlflow_tracking_uri"),
        ({"report_to": ["tensorboard"], "run_name": "x"}, "tracking.report_to"),
        ({"report_to": ["neptune"]}, "tracking.report_to[0]"),
        ({"report_to": ["wandb"], "run_name": "a\nb"}, "tracking.run_name"),
        ({"report_to": ["wandb"], "tags": {f"k{i}": "v" for i in range(51)}}, "tracking.tags"),
        ({"report_to": ["wandb"], "url": SERVER}, "tracking.url"),
    ],
)
def test_spec_problems_name_the_field(tracking: dict[str, Any], param: str) -> None:
    with pytest.raises(SpecError) as e:
        job_spec(**tracking)
    assert param in [p.param for p in e.value.problems]

"""Deployment rows as requests see them (core/serving/deployments.py), on a real database."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session

from core.db.models import utcnow
from core.db.session import session_scope
from core.infra.settings import Settings
from core.serving import deployments
from core.serving.deployments import SERVING_CAPABILITY, ServingUnavailable
from core.serving.resolve import Resolved, base_key
from core.serving.tables import Deployment, DeploymentState
from worker.upkeep.registry import Inventory, register

TARGET = Resolved(model="m", deployment_key=base_key("/models/m"), deployment_kind="base",
                  location="/models/m")


def engine_worker(session: Session, name: str = "w1") -> None:
    register(session, name, Inventory("h", [], 2, {SERVING_CAPABILITY: True}, 1))
    session.commit()


def test_without_a_worker_that_has_an_engine_nothing_is_asked(settings_env: Settings) -> None:
    with session_scope() as s:
        register(s, "plain", Inventory("h", [], 2, {SERVING_CAPABILITY: False}, 1))
        s.commit()
        with pytest.raises(ServingUnavailable) as e:
            deployments.request(s, TARGET, settings_env)
        assert "make engine" in e.value.message and e.value.headers["Retry-After"] == "30"
        assert s.query(Deployment).count() == 0


def test_one_deployment_per_model_asked_again_once_stopped(settings_env: Settings) -> None:
    with session_scope() as s:
        engine_worker(s)
        first = deployments.request(s, TARGET, settings_env)
        assert first.state == DeploymentState.requested
        assert deployments.request(s, TARGET, settings_env).id == first.id
        s.execute(update(Deployment).values(state=DeploymentState.stopped))
        s.commit()
        again = deployments.request(s, TARGET, settings_env)
        assert (again.id, again.state) == (first.id, DeploymentState.requested)


def test_a_running_deployment_whose_worker_fell_silent_is_asked_again(
        settings_env: Settings) -> None:
    with session_scope() as s:
        engine_worker(s)
        dep = deployments.request(s, TARGET, settings_env)
        stale = utcnow() - timedelta(seconds=settings_env.heartbeat_timeout_seconds + 5)
        s.execute(update(Deployment).values(state=DeploymentState.ready, worker_id="gone",
                                            url="http://x", heartbeat_at=stale))
        s.commit()
        again = deployments.request(s, TARGET, settings_env)
        assert (again.id, again.state, again.worker_id) == (dep.id, "requested", None)


def test_stop_moves_a_running_one_to_stopping_and_a_requested_one_to_stopped(
        settings_env: Settings) -> None:
    with session_scope() as s:
        engine_worker(s)
        dep = deployments.request(s, TARGET, settings_env)
        assert deployments.stop(s, dep.id)
        s.refresh(dep)
        assert dep.state == DeploymentState.stopped
        s.execute(update(Deployment).values(state=DeploymentState.ready))
        s.commit()
        assert deployments.stop(s, dep.id)
        s.refresh(dep)
        assert dep.state == DeploymentState.stopping
        assert not deployments.stop(s, dep.id)  # already asked

"""/v1/deployments for the operator (api/routes/deployments.py): admin keys list and stop
deployments, tenant keys get 403. A running engine stopped through it is
tests/e2e/test_serving.py's (``test_the_operator_stops_a_deployment...``)."""

from __future__ import annotations

from core.serving.tables import Deployment, DeploymentState
from tests.utils.api import Api


def add_deployment(api: Api, state: DeploymentState, key: str) -> str:
    with api.session() as s:
        dep = Deployment(key=key, kind="base", location="/m", state=state)
        s.add(dep)
        s.commit()
        return dep.id


def test_an_admin_lists_the_deployments(api: Api) -> None:
    dep_id = add_deployment(api, DeploymentState.requested, "base:listed")
    r = api.client(api.key_a).get("/v1/deployments")
    assert r.status_code == 200
    (row,) = [d for d in r.json()["data"] if d["id"] == dep_id]
    assert (row["state"], row["model"], row["gpus"], row["worker_id"]) == (
        "requested", "/m", [], None)


def test_a_tenant_key_may_not_see_or_stop_them(api: Api) -> None:
    dep_id = add_deployment(api, DeploymentState.ready, "base:tenant")
    c = api.client(api.key_b)
    assert c.get("/v1/deployments").status_code == 403
    assert c.post(f"/v1/deployments/{dep_id}/stop").status_code == 403


def test_a_stop_moves_a_running_deployment_to_stopping_and_a_requested_one_to_stopped(
        api: Api) -> None:
    c = api.client(api.key_a)
    ready = add_deployment(api, DeploymentState.ready, "base:ready")
    asked = add_deployment(api, DeploymentState.requested, "base:asked")
    assert c.post(f"/v1/deployments/{ready}/stop").json()["state"] == "stopping"
    assert c.post(f"/v1/deployments/{asked}/stop").json()["state"] == "stopped"
    again = c.post(f"/v1/deployments/{asked}/stop")  # idempotent
    assert (again.status_code, again.json()["state"]) == (200, "stopped")


def test_stopping_an_unknown_deployment_is_a_404(api: Api) -> None:
    r = api.client(api.key_a).post("/v1/deployments/dep-nope/stop")
    assert r.status_code == 404 and r.json()["error"]["param"] == "deployment_id"

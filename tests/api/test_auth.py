"""Every /v1 endpoint needs a valid, unrevoked key; health endpoints do not."""

from __future__ import annotations

from api.services.keys import hash_key, list_api_keys, revoke_api_key
from testkit.wait import wait_until
from tests.utils.api import Api


def test_missing_key_is_401(api: Api) -> None:
    r = api.client().get("/v1/jobs")
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"


def test_invalid_key_is_401(api: Api) -> None:
    r = api.client("ft_not-a-real-key").get("/v1/files")
    assert r.status_code == 401
    assert set(r.json()["error"]) >= {"code", "message", "param"}


def test_malformed_header_is_401(api: Api) -> None:
    c = api.client()
    r = c.get("/v1/jobs", headers={"Authorization": f"Basic {api.key_a}"})
    assert r.status_code == 401


def test_revoked_key_is_401(api: Api) -> None:
    """Refused at once when this server has not verified it recently; within
    api_key_cache_seconds otherwise (tests/api/test_auth_cache.py)."""
    from api.services.keys import create_api_key

    with api.maker.begin() as s:
        key = create_api_key(s, "revoked-tenant", "temp")
    with api.maker.begin() as s:
        revoke_api_key(s, key[:10])
    assert api.client(key).get("/v1/jobs").status_code == 401


def test_keys_are_stored_hashed_and_last_use_recorded(api: Api, client_b) -> None:  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    from core.db.models import ApiKey

    assert client_b.get("/v1/jobs").status_code == 200
    # The last use is written beside the request (api/deps.py), soon after the response.

    def last_use_recorded() -> bool:
        with api.session() as s:
            infos = [k for k in list_api_keys(s) if k.prefix == api.key_b[:10]]
        assert len(infos) == 1
        return infos[0].last_used_at is not None

    wait_until(last_use_recorded, 10, "the key's last use to be recorded", every=0.05)
    with api.session() as s:
        stored = s.scalars(select(ApiKey.key_hash)).all()
    assert hash_key(api.key_b) in stored and api.key_b not in stored


def test_health_endpoints_need_no_key(api: Api) -> None:
    c = api.client()
    assert c.get("/healthz").json() == {"status": "ok"}
    assert c.get("/readyz").status_code == 200
    assert c.get("/metrics").status_code == 200

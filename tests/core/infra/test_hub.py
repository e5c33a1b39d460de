"""core.infra.hub: a hub id is judged within seconds, not after the hub client's minute of DNS
retries. The hub here is one this machine cannot reach (a .invalid name), or a listening
socket of the test's own."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.infra import hub
from core.infra.errors import ErrorCode
from core.policy import Refused
from tests.utils.cli import UNREACHABLE_HUB
from worker.run.prepare import hub_env


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE_HUB)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def listening_hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setenv("HF_ENDPOINT", url)
        yield url


def cache_model(cache: Path, repo_id: str) -> None:
    """What `hf download` leaves: refs/main naming a snapshot that holds config.json."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("abc123")
    (root / "snapshots" / "abc123").mkdir(parents=True)
    (root / "snapshots" / "abc123" / "config.json").write_text("{}")


def test_an_unreachable_hub_is_said_so_with_the_reason(no_hub: Path) -> None:
    reach = hub.check(fresh=True)
    assert not reach.reachable
    assert reach.endpoint == UNREACHABLE_HUB and "hub.invalid" in reach.reason


def test_a_listening_hub_is_reachable(listening_hub: str) -> None:
    reach = hub.check(fresh=True)
    assert reach.reachable and reach.endpoint == listening_hub


def test_a_model_not_in_the_cache_is_refused_with_what_to_do(no_hub: Path) -> None:
    hub.check(fresh=True)
    access = hub.access("someorg/some-model")
    assert access.refusal is not None
    assert "cannot be reached" in access.refusal and "hf download someorg/some-model" in (
        access.refusal)


def test_a_cached_model_loads_from_the_cache_alone(no_hub: Path) -> None:
    cache_model(no_hub, "someorg/cached")
    hub.check(fresh=True)
    assert hub.access("someorg/cached") == hub.HubAccess(refusal=None, offline=True)
    # The worker launches it with HF_HUB_OFFLINE=1: no retries of an unreachable hub.
    assert hub_env("someorg/cached") == {"HF_HUB_OFFLINE": "1"}


def test_offline_by_setting_refuses_what_the_cache_lacks_without_asking(
    no_hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    access = hub.access("someorg/some-model")
    assert access.refusal is not None and "HF_HUB_OFFLINE=1 is set" in access.refusal


def test_the_worker_refuses_an_unreachable_hub_model_before_launching(no_hub: Path) -> None:
    hub.check(fresh=True)
    with pytest.raises(Refused) as refused:
        hub_env("someorg/some-model")
    assert refused.value.code == ErrorCode.model_not_found
    assert refused.value.param == "model.name_or_path"
    assert hub_env("/models/local") == {}

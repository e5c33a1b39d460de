"""Can this machine reach the model hub, quickly?

huggingface_hub retries a failed name lookup for ~49 s before it gives up (docs/facts.md):
a job naming a hub id on a machine without the hub would fail a minute after its start. So
the API (at submit), the worker (before a launch) and `ftune doctor` ask here first: one DNS
lookup and one TCP connect, each bounded by a timeout, remembered for a short while.

A model already in the local hub cache needs no hub: the trainer then loads it with
HF_HUB_OFFLINE=1 (no retries at all). HF_HUB_OFFLINE=1 in the environment means "never
ask the hub": only cached models are accepted.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
CHECK_TIMEOUT_SECONDS = 2.0
# A verdict is reused this long: submits in a burst cost one check, and a hub that comes
# back is seen within seconds.
REMEMBER_SECONDS = 30.0
_TRUE = {"1", "true", "yes", "on"}

_lock = threading.Lock()
_last: tuple[float, str, HubReach] | None = None


@dataclass(frozen=True)
class HubReach:
    endpoint: str
    reachable: bool
    reason: str  # why not, or "ok"
    seconds: float


def endpoint() -> str:
    """The hub huggingface_hub would ask (HF_ENDPOINT, as it reads it)."""
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or DEFAULT_ENDPOINT


def offline_by_setting() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def _resolve(host: str, port: int, timeout: float) -> list[tuple[int, str]]:
    """getaddrinfo cannot be interrupted: it runs in a daemon thread we stop waiting for."""
    result: list[tuple[int, str]] = []
    error: list[BaseException] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            result.extend((i[0], str(i[4][0])) for i in infos)
        except OSError as e:
            error.append(e)

    t = threading.Thread(target=lookup, name="hub-dns", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"name lookup of {host} took over {timeout:g} s")
    if error:
        raise OSError(f"name lookup of {host} failed ({error[0]})")
    return result


def check(timeout: float = CHECK_TIMEOUT_SECONDS, *, fresh: bool = False) -> HubReach:
    """One bounded DNS lookup and TCP connect to the hub (at most ~2 x ``timeout``)."""
    global _last
    url = endpoint()
    now = time.monotonic()
    with _lock:
        if not fresh and _last is not None and _last[1] == url and now - _last[0] < REMEMBER_SECONDS:
            return _last[2]
    t0 = time.monotonic()
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = _resolve(host, port, timeout)
        if not addresses:
            raise OSError(f"name lookup of {host} found no address")
        family, address = addresses[0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect((address, port))
            except OSError as e:
                raise OSError(f"connect to {address}:{port} failed ({e})") from None
        reach = HubReach(url, True, "ok", time.monotonic() - t0)
    except OSError as e:  # TimeoutError is an OSError
        reach = HubReach(url, False, str(e), time.monotonic() - t0)
    with _lock:
        _last = (time.monotonic(), url, reach)
    return reach


def cached(repo_id: str) -> bool:
    """The model's config is in the local hub cache (what a load with HF_HUB_OFFLINE=1 needs
    first; missing weights would still fail the load, with the hub's own message)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - a dependency of transformers
        return False
    found = try_to_load_from_cache(repo_id, "config.json")
    return isinstance(found, str)


@dataclass(frozen=True)
class HubAccess:
    """How a hub id can be loaded here: ``refusal`` set when it cannot; ``offline`` when only
    the cache may be read (the trainer gets HF_HUB_OFFLINE=1)."""

    refusal: str | None
    offline: bool


def access(repo_id: str) -> HubAccess:
    if cached(repo_id):
        return HubAccess(None, offline_by_setting() or not check().reachable)
    if offline_by_setting():
        return HubAccess(
            f"{repo_id!r} is not in this server's hub cache and HF_HUB_OFFLINE=1 is set (the "
            "hub is never asked): give a model directory (model.name_or_path: /path/to/model), "
            "or download it into the cache first (`hf download " + repo_id + "`)", False)
    reach = check()
    if reach.reachable:
        return HubAccess(None, False)
    return HubAccess(
        f"the model hub ({reach.endpoint}) cannot be reached from this server ({reach.reason}) "
        f"and {repo_id!r} is not in its hub cache: give a model directory "
        "(model.name_or_path: /path/to/model), download it into the cache on a machine with "
        "access (`hf download " + repo_id + "`), or ask the operator for hub access",
        False,
    )

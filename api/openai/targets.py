"""Where a tenant's model name is served, as one API process knows it: resolving a name (the
job, the deployment, the adapter rows, a cold start's wait) costs more database reads than
the rest of a request, and a write (the deployment's last use), so it is kept for
``FRESH_SECONDS``. Within that time a deployment stopped or an adapter evicted meanwhile is
met as the engine's refusal or absence, and the route resolves the name again
(api/openai/inference.py); a model deleted is forgotten at once by the process that
deleted it, and met by the others as the engines' refusal (retiring it unloads it from
them: core/serving/retire.py).

Two rules keep that work off a request's path to its first token, as api/deps.py does for
API keys:
* **single flight**: requests that need the same name resolved wait for one resolution
  (one trip to a thread) instead of each doing it; eight concurrent streams arriving when
  the entry had expired were eight trips, run one after another on the GIL, and the last
  stream's request reached the engine tens of ms after the first (bench/serving.py);
* **refresh ahead**: a request that finds an entry older than ``REFRESH_AFTER`` is answered
  from it and starts the resolution in the background, so a name in use at least once every
  FRESH_SECONDS never waits for one (with a 1-second lifetime, a client sending a request
  every 1.5 s waited 4-13 ms for each), and its deployment's last use stays within
  REFRESH_AFTER of the truth (idle time, scale to zero). No entry older than
  ``FRESH_SECONDS`` is used.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from starlette.concurrency import run_in_threadpool

from core.serving.access import EngineTarget

log = logging.getLogger("ftune.api")

FRESH_SECONDS = 10.0
REFRESH_AFTER = 1.0
MAX_ENTRIES = 10_000

Key = tuple[str, str]  # (tenant id, the name the user wrote)
Resolve = Callable[[], EngineTarget]  # blocking: run in the thread pool


class TargetCache:
    """One per API process (``app.state.targets``). Entries are read and written on the
    event loop; ``forget_tenant`` may also come from a thread (models.delete), hence the
    lock."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[Key, tuple[float, EngineTarget]] = {}
        self._flights: dict[Key, asyncio.Task[EngineTarget]] = {}
        # Bumped by forget_tenant: a resolution that read before a model was deleted must
        # not put its name back afterwards.
        self._generation: dict[str, int] = {}
        self._lock = threading.Lock()

    def fresh(self, key: Key, resolve: Resolve) -> EngineTarget | None:
        """The entry for ``key`` if it may be used now (starting its refresh in the
        background once it is past REFRESH_AFTER), else None."""
        with self._lock:
            found = self._entries.get(key)
        if found is None:
            return None
        age = self._clock() - found[0]
        if age >= FRESH_SECONDS:
            return None
        if age >= REFRESH_AFTER and key not in self._flights:
            self._fly(key, resolve)
        return found[1]

    async def resolved(self, key: Key, resolve: Resolve) -> EngineTarget:
        """The name resolved now, or by the resolution already under way for it. What it
        raises (ModelNotFound, ServingUnavailable) every request waiting on it raises."""
        flight = self._flights.get(key) or self._fly(key, resolve)
        # shield: a waiter whose client went away must not cancel the others' resolution.
        return await asyncio.shield(flight)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def forget_tenant(self, tenant_id: str) -> None:
        """Every name of the tenant (a model deleted: its checkpoints' names too)."""
        with self._lock:
            self._generation[tenant_id] = self._generation.get(tenant_id, 0) + 1
            for key in [k for k in self._entries if k[0] == tenant_id]:
                del self._entries[key]

    def _fly(self, key: Key, resolve: Resolve) -> asyncio.Task[EngineTarget]:
        started = self._clock()
        with self._lock:
            generation = self._generation.get(key[0], 0)

        async def run() -> EngineTarget:
            target = await run_in_threadpool(resolve)
            with self._lock:
                if self._generation.get(key[0], 0) == generation:
                    if len(self._entries) >= MAX_ENTRIES:
                        self._entries.clear()
                    self._entries[key] = (started, target)  # as old as its reads
            return target

        flight = asyncio.ensure_future(run())
        self._flights[key] = flight
        flight.add_done_callback(lambda done: self._landed(key, done))
        return flight

    def _landed(self, key: Key, flight: asyncio.Task[EngineTarget]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if flight.cancelled():
            return
        if flight.exception() is not None:
            # A refresh nobody waited for may fail (the model deleted, its deployment
            # gone): the entry goes, and the next request resolves the name and says why.
            self.forget(key)
            log.debug("resolving %s failed", key[1], exc_info=flight.exception())

"""Where model names are served, per API process (api/openai/targets.py): one resolution
for many waiters, refreshed ahead of its expiry, never used past FRESH_SECONDS, and never
kept for a model deleted meanwhile. A fake clock ages the entries; resolutions are plain
functions run in the thread pool, as open_model is."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from api.openai import targets
from api.openai.targets import TargetCache
from core.serving.access import EngineTarget
from core.serving.deployments import ServingUnavailable

KEY = ("tenant-1", "ft:tiny:acme:job-1")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def target(url: str = "http://127.0.0.1:8001/v1") -> EngineTarget:
    return EngineTarget(model=KEY[1], engine_model="job-1", base_url=url, api_key="k",
                        deployment_id="dep-1", job_id="job-1")


class Resolver:
    """Counts its calls; blocks each until ``release`` is set (a resolution under way)."""

    def __init__(self, answer: Callable[[], EngineTarget] = target) -> None:
        self.calls = 0
        self.answer = answer
        self.release = threading.Event()
        self.release.set()

    def __call__(self) -> EngineTarget:
        self.calls += 1
        assert self.release.wait(30)
        return self.answer()


def test_concurrent_requests_for_a_name_share_one_resolution(clock: Clock) -> None:
    async def scenario() -> list[EngineTarget]:
        cache, resolve = TargetCache(clock), Resolver()
        found = await asyncio.gather(*(cache.resolved(KEY, resolve) for _ in range(8)))
        assert resolve.calls == 1
        return found

    assert asyncio.run(scenario()) == [target()] * 8


def test_a_fresh_entry_is_answered_without_resolving(clock: Clock) -> None:
    async def scenario() -> None:
        cache, resolve = TargetCache(clock), Resolver()
        await cache.resolved(KEY, resolve)
        clock.now += targets.REFRESH_AFTER / 2
        assert cache.fresh(KEY, resolve) == target()
        await asyncio.sleep(0)  # a refresh, had one started, would run now
        assert resolve.calls == 1

    asyncio.run(scenario())


def test_an_entry_past_half_its_time_is_answered_and_refreshed_behind(clock: Clock) -> None:
    async def scenario() -> None:
        moved = target("http://127.0.0.1:8002/v1")
        cache, resolve = TargetCache(clock), Resolver()
        await cache.resolved(KEY, resolve)
        resolve.answer = lambda: moved
        clock.now += targets.REFRESH_AFTER
        assert cache.fresh(KEY, resolve) == target()  # answered from the entry at once
        assert cache.fresh(KEY, resolve) == target()  # one refresh under way, not two
        await cache.resolved(KEY, resolve)  # joins the refresh
        assert resolve.calls == 2
        assert cache.fresh(KEY, resolve) == moved

    asyncio.run(scenario())


def test_an_entry_past_its_time_is_not_used(clock: Clock) -> None:
    async def scenario() -> None:
        cache, resolve = TargetCache(clock), Resolver()
        await cache.resolved(KEY, resolve)
        clock.now += targets.FRESH_SECONDS
        assert cache.fresh(KEY, resolve) is None

    asyncio.run(scenario())


def test_a_failed_resolution_fails_every_waiter_and_keeps_nothing(clock: Clock) -> None:
    def down() -> EngineTarget:
        raise ServingUnavailable("the model's deployment failed: boom", retry_after=30)

    async def scenario() -> None:
        cache, resolve = TargetCache(clock), Resolver(down)
        results = await asyncio.gather(*(cache.resolved(KEY, resolve) for _ in range(3)),
                                       return_exceptions=True)
        assert resolve.calls == 1
        assert all(isinstance(r, ServingUnavailable) for r in results)
        assert cache.fresh(KEY, resolve) is None

    asyncio.run(scenario())


def test_a_model_deleted_during_a_resolution_is_not_kept(clock: Clock) -> None:
    """models.delete forgets the tenant's names once its retirement committed; a resolution
    that read before must not put the name back."""
    async def scenario() -> None:
        cache, resolve = TargetCache(clock), Resolver()
        resolve.release.clear()
        flight = asyncio.ensure_future(cache.resolved(KEY, resolve))
        while resolve.calls == 0:  # the resolution has read (it waits in its thread)
            await asyncio.sleep(0.01)
        cache.forget_tenant(KEY[0])
        resolve.release.set()
        assert await flight == target()  # its own request is answered, as it was asked
        assert cache.fresh(KEY, resolve) is None

    asyncio.run(scenario())


def test_a_waiter_that_goes_away_leaves_the_others_their_answer(clock: Clock) -> None:
    async def scenario() -> None:
        cache, resolve = TargetCache(clock), Resolver()
        resolve.release.clear()
        gone = asyncio.ensure_future(cache.resolved(KEY, resolve))
        stays = asyncio.ensure_future(cache.resolved(KEY, resolve))
        while resolve.calls == 0:
            await asyncio.sleep(0.01)
        gone.cancel()
        resolve.release.set()
        assert await stays == target()
        assert gone.cancelled() and resolve.calls == 1

    asyncio.run(scenario())

"""Work a test hands to a thread (act on a job while the main thread runs it), with what
the thread raised raised again in the test: an assert that fails there fails the test,
where a bare ``threading.Thread`` would only print a warning."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from testkit.wait import wait_until


class Background:
    """``fn`` running in a daemon thread from construction; ``join`` waits for it and
    raises what it raised."""

    def __init__(self, fn: Callable[[], Any], name: str | None = None) -> None:
        self.error: BaseException | None = None
        self.result: Any = None
        self._fn = fn
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread by join()
            self.error = e

    def join(self, timeout: float | None = None) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"the background thread {self.thread.name} is still running")
        if self.error is not None:
            raise self.error
        return self.result


def act_when(cond: Callable[[], Any], action: Callable[[Any], Any], timeout: float, what: str,
             *, every: float = 0.05) -> Background:
    """In the background: wait until ``cond()`` holds (``what``, for the failure), then
    ``action(its value)``."""
    return Background(lambda: action(wait_until(cond, timeout, what, every=every)), name=what)

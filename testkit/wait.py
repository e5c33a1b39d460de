"""The one way tests and benches wait for something another process or thread does.

Poll a condition until it holds, then return its value; past the timeout, or as soon as
``give_up`` names a reason (the process that should have done it has died), fail naming
what was awaited. Never a bare sleep standing in for "long enough".
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout: float, what: str, *, every: float = 0.2,
               give_up: Callable[[], str | None] | None = None,
               ignore: tuple[type[BaseException], ...] = ()) -> T:
    """``cond()``'s first truthy value, polled every ``every`` seconds. AssertionError
    naming ``what`` after ``timeout`` seconds, or at once when ``give_up()`` returns a
    reason. Exceptions of the ``ignore`` types count as "not yet" (a server still
    starting refuses connections)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except ignore:
            value = None  # type: ignore[assignment]
        if value:
            return value
        reason = give_up() if give_up is not None else None
        if reason:
            raise AssertionError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)

"""Responses of the hottest read, GET /v1/jobs/{id}, kept as the bytes that were sent and sent
again while nothing in the database has changed.

A dashboard polls a job many times a second between the writes that change it (the trainer
writes a step's metrics, the worker a heartbeat). Reading, assembling and serialising the
job cost about twice what the HTTP exchange around it costs (docs/benchmarks.md): at 100
connections that is most of the latency. A kept body is served only if

* the database's version is the one it was read at. On SQLite, ``data_version`` moves on
  every commit by any connection (``LoopReads.data_version``), so a write anywhere, by any
  process, ends every kept body; nothing committed is ever hidden. On PostgreSQL, which
  has no cheap count of commits to ask (docs/facts.md), every write NOTIFYs and the
  version counts the notices that have reached this process (core/db/notices.py): a
  commit of another process is seen once PostgreSQL has sent its notice, as the commit
  completes; this process's own commits at once; and while the notices are not listened
  to, nothing is kept; and
* it is younger than ``job_read_cache_seconds``: an ETA and a running attempt's usage move
  with the clock alone, without a write; they are at most that old.

Keys hold the tenant: a body is only ever served to the tenant it was read for, after the
request's key was checked as for any other request. Only found jobs are kept (a 404 is read
each time).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from time import monotonic


@dataclass(frozen=True, slots=True)
class _Kept:
    version: Hashable
    read_at: float
    body: bytes


class ReadCache:
    """Bodies by key, each with the database version it was read at (``version``: a value
    that changes with every commit). Bounded: past ``max_entries`` the oldest kept goes (one
    dashboard polls a few jobs; a scan over many jobs only churns the oldest)."""

    def __init__(self, version: Callable[[], Hashable], max_age: float,
                 max_entries: int = 1024) -> None:
        self.version = version
        self.max_age = max_age
        self.max_entries = max_entries
        self._kept: dict[Hashable, _Kept] = {}

    def get(self, key: Hashable, version: Hashable) -> bytes | None:
        """The body kept for ``key`` if it was read at ``version`` (the database's now:
        ``self.version()``) and is not past its age."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        if kept.version != version or monotonic() - kept.read_at > self.max_age:
            del self._kept[key]
            return None
        return kept.body

    def put(self, key: Hashable, version: Hashable, body: bytes) -> None:
        """Keep ``body``, read at ``version``: a version taken *before* the read began, so
        that a write committed during the read makes the body a miss, never a stale hit."""
        self._kept.pop(key, None)  # re-inserted last: the dict's order is the age order
        while len(self._kept) >= self.max_entries:
            del self._kept[next(iter(self._kept))]
        self._kept[key] = _Kept(version, monotonic(), body)

    def __len__(self) -> int:
        return len(self._kept)

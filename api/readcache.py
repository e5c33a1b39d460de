"""Responses of the hottest read, GET /v1/jobs/{id}, kept as the bytes that were sent and sent
again while nothing in the database has changed.

A dashboard polls a job many times a second between the writes that change it (the trainer
writes a step's metrics, the worker a heartbeat). Reading, assembling and serialising the
job cost about twice what the HTTP exchange around it costs (docs/benchmarks.md): at 100
connections that is most of the latency. A kept body is served only if

* the database's version is the one it was read at. On SQLite, ``data_version`` moves on
  every commit by any connection (``LoopReads.data_version``), so a write anywhere, by any
  process, ends every kept body; nothing committed is ever hidden. On PostgreSQL, which
  has no cheap count of commits to ask (docs/facts.md), every write NOTIFYs, naming the
  job whose rows it wrote, and the version counts the notices that have reached this
  process (api/commit_notices.py): a commit of another process is seen once PostgreSQL has sent
  its notice, as the commit completes; this process's own commits at once; while the
  notices are not listened to, nothing is kept. There a job's body that shows its own
  rows alone (any status but queued: ``Version``) outlives commits to other jobs, so a
  dashboard of many jobs is not read again whenever one of them moves; and
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
class Version:
    """The database's version as a kept job body needs it, taken for one job: ``own`` moves
    with every commit that may touch that job's own rows (its row, attempts, checkpoints,
    events), ``any`` with every commit. A queued job's body (its place in the queue) depends
    on other jobs and the fleet, so it is checked against ``any``; any other against
    ``own``. Where the database cannot tell rows apart (SQLite) both are one value."""

    own: Hashable
    any: Hashable

    @classmethod
    def of(cls, value: Hashable) -> Version:
        return cls(value, value)


@dataclass(frozen=True, slots=True)
class _Kept:
    version: Hashable  # the part of the Version it is checked against
    own_rows_only: bool
    read_at: float
    body: bytes


class ReadCache:
    """Bodies by (tenant id, job id), each with the database version it was read at
    (``version(job_id)``, a Version). Bounded: past ``max_entries`` the oldest kept goes (one
    dashboard polls a few jobs; a scan over many jobs only churns the oldest)."""

    def __init__(self, version: Callable[[str], Version], max_age: float,
                 max_entries: int = 1024) -> None:
        self.version = version
        self.max_age = max_age
        self.max_entries = max_entries
        self._kept: dict[tuple[str, str], _Kept] = {}

    def get(self, key: tuple[str, str], version: Version) -> bytes | None:
        """The body kept for ``key`` if it was read at ``version`` (the database's now:
        ``self.version(job_id)``) and is not past its age."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        now = version.own if kept.own_rows_only else version.any
        if kept.version != now or monotonic() - kept.read_at > self.max_age:
            del self._kept[key]
            return None
        return kept.body

    def put(self, key: tuple[str, str], version: Version, body: bytes,
            own_rows_only: bool) -> None:
        """Keep ``body``, read at ``version``: a version taken *before* the read began, so
        that a write committed during the read makes the body a miss, never a stale hit.
        ``own_rows_only``: the body shows nothing but the job's own rows."""
        self._kept.pop(key, None)  # re-inserted last: the dict's order is the age order
        while len(self._kept) >= self.max_entries:
            del self._kept[next(iter(self._kept))]
        self._kept[key] = _Kept(version.own if own_rows_only else version.any, own_rows_only,
                                monotonic(), body)

    def __len__(self) -> int:
        return len(self._kept)

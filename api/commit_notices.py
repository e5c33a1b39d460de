"""PostgreSQL's commits, as seen by one process: what api/readcache.py compares to tell
whether a job it answered before may have changed.

SQLite has a count built in (``PRAGMA data_version``, core/db/session.py LoopReads).
PostgreSQL has no cheap equivalent to ask (docs/facts.md: ``pg_current_snapshot()`` costs a
round trip, as much as the read it would save), so the database says it instead: migration
0014_commit_notices makes every write NOTIFY ``ftune_commits``, delivered at commit, with
the job id as payload for a job's own rows (jobs, job_attempts, checkpoints, job_events)
and an empty one for every other table. This process LISTENs on a connection of its own.
``version(job_id)`` reads what has arrived on that connection's socket without waiting
(libpq's ``PQconsumeInput``: one ``recv`` that finds nothing most of the time, a few
microseconds) and counts it: ``own`` moves with the job's own notices and every empty one,
``any`` with every notice (readcache.Version).

What it guarantees: a commit is seen by every ``version()`` that runs after PostgreSQL has
sent its notification, which it does as the commit completes, before the writer is told;
a commit of this process's own sessions is seen at once (``committed_here``, after its
commit returns, as if it had touched every row), so a client reads its own writes. A
version taken while the notices are not listened to (before the first connection, after it
broke, until a new one listens) is new each time, equal to nothing: nothing is kept, every
GET reads. A reconnect starts a new generation, so no version from before it can match one
after.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from typing import Any

from sqlalchemy import Engine

from api.readcache import Version

log = logging.getLogger(__name__)

CHANNEL = "ftune_commits"  # migrations/versions/0014_commit_notices.py
RECONNECT_SECONDS = 1.0
# Jobs whose last notice is remembered; one forgotten reads as changed at the oldest notice
# remembered (``_floor``): never stale, at worst read again.
TRACKED_JOBS = 10_000


class CommitNotices:
    """Commits counted from ``engine``'s database (PostgreSQL). ``version()`` and ``close()``
    on one thread (the API's event loop); ``committed_here()`` from any."""

    def __init__(self, engine: Engine, reconnect_seconds: float = RECONNECT_SECONDS) -> None:
        # A connection of its own, outside the engine's pool: it LISTENs for its lifetime.
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(
            hide_password=False)
        self.reconnect_seconds = reconnect_seconds
        self._conn: Any = None  # psycopg.Connection, LISTENing
        self._generation = 0
        self._all = 0  # every notice, and this process's own commits
        self._fleet = 0  # notices of tables that are no job's own, and own commits
        self._last: OrderedDict[str, int] = OrderedDict()  # job id -> _all at its notice
        self._floor = 0
        self._local = itertools.count(1)  # next() is atomic under the GIL
        self._local_seen = 0
        self._closed = threading.Event()
        self._connecting: threading.Thread | None = None
        self._ready: Any = None  # a connection the connecting thread hands over
        self._listen()

    def version(self, job_id: str) -> Version:
        """The commits seen so far, for ``job_id``; parts that equal nothing (new objects)
        when not listening."""
        conn = self._conn
        if conn is None:
            conn = self._take_ready()
            if conn is None:
                return Version(object(), object())
        pg = conn.pgconn
        try:
            pg.consume_input()
            while (notice := pg.notifies()) is not None:
                self._count(notice.extra.decode())
            if pg.status != 0:  # not CONNECTION_OK: the server ended it (its reason read)
                raise ConnectionError(pg.get_error_message() or "connection closed")
        except Exception as exc:  # noqa: BLE001 - any failure: stop keeping, reconnect
            log.warning("commit notices lost (%s); job bodies are read every time until "
                        "they are listened to again", exc)
            self._drop()
            return Version(object(), object())
        local = self._local_seen
        return Version(
            own=(self._generation, self._fleet, local, self._last.get(job_id, self._floor)),
            any=(self._generation, self._all, local),
        )

    def _count(self, job_id: str) -> None:
        self._all += 1
        if not job_id:
            self._fleet += 1
            return
        self._last[job_id] = self._all
        self._last.move_to_end(job_id)
        if len(self._last) > TRACKED_JOBS:
            _, self._floor = self._last.popitem(last=False)

    def committed_here(self, *_: Any) -> None:
        """After a commit of this process's own (a Session ``after_commit`` listener)."""
        self._local_seen = next(self._local)

    def close(self) -> None:
        self._closed.set()
        for conn in (self._conn, self._ready):
            if conn is not None:
                conn.close()
        self._conn = self._ready = None

    # ------------------------------------------------------------------ the connection

    def _connect(self) -> Any:
        import psycopg

        conn = psycopg.connect(self._conninfo, autocommit=True, connect_timeout=10)
        conn.execute(f"LISTEN {CHANNEL}")
        return conn

    def _listen(self) -> None:
        """The first connection, made here (the API starts with its database reachable); if
        it fails, a thread retries as after a drop."""
        try:
            self._conn = self._connect()
            self._generation += 1
        except Exception as exc:  # noqa: BLE001
            log.warning("cannot listen for commit notices (%s); retrying", exc)
            self._reconnect_later()

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        try:
            conn.close()
        except Exception:  # noqa: BLE001, S110 - already broken
            pass
        self._reconnect_later()

    def _take_ready(self) -> Any:
        conn, self._ready = self._ready, None
        if conn is not None:
            self._generation += 1  # versions from before the gap never match again
            self._conn = conn
            log.info("listening for commit notices again")
        return conn

    def _reconnect_later(self) -> None:
        """Connect in a thread (a connect may wait for seconds; the event loop must not)."""
        if self._connecting is not None and self._connecting.is_alive():
            return

        def run() -> None:
            while not self._closed.wait(self.reconnect_seconds):
                try:
                    conn = self._connect()
                except Exception as exc:  # noqa: BLE001
                    log.info("commit notices: cannot connect yet (%s)", exc)
                    continue
                if self._closed.is_set():
                    conn.close()
                else:
                    self._ready = conn
                return

        self._connecting = threading.Thread(target=run, name="ftune-commit-notices",
                                            daemon=True)
        self._connecting.start()

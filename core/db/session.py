"""Engine and sessions. One engine per process, built from the settings."""

from __future__ import annotations

import logging
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from functools import lru_cache
from typing import Any, TypeVar, cast

from sqlalchemy import (
    Connection,
    CursorResult,
    Dialect,
    Engine,
    Executable,
    Select,
    create_engine,
    event,
)
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from core.infra.settings import get_settings

log = logging.getLogger(__name__)

_AFTER_COMMIT = "ftune.after_commit"
T = TypeVar("T")


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        # The API, the worker and the monitor thread write concurrently: WAL lets readers
        # run beside the writer, and busy_timeout makes writers queue instead of failing.
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


# How long a read on the event loop's own connection may wait for a lock before it gives up
# and goes to a thread: a reader under WAL waits only in rare moments (another connection
# recovering the WAL, or holding the file in exclusive locking mode), and the loop serves
# every other request meanwhile.
LOOP_READ_BUSY_MS = 20


def make_loop_read_engine(engine: Engine) -> Engine | None:
    """For an engine on a SQLite file: a second engine on the same file with one connection,
    read-only (``query_only``), for reads run on the API's event loop (api/deps.py Reader).
    A SQLite read is a few function calls in this process, not a trip over a network:
    running it in a thread only adds the hand-offs of the GIL between that thread and the
    loop, which cost more than the read. None for other databases (their reads wait on a
    socket: those belong in threads) and for in-memory SQLite (a second engine would open
    another, empty database)."""
    url = engine.url
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    # check_same_thread off: created in the lifespan, used by the loop's thread; never two
    # threads at once.
    loop_engine = create_engine(
        url,
        poolclass=StaticPool,
        connect_args={"check_same_thread": False, "timeout": LOOP_READ_BUSY_MS / 1000},
    )

    @event.listens_for(loop_engine, "connect")
    def _read_only(dbapi_conn: Any, _: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout={LOOP_READ_BUSY_MS}")
        cur.execute("PRAGMA query_only=ON")
        cur.close()

    return loop_engine


def make_read_engine(engine: Engine, pool_size: int) -> Engine | None:
    """For an engine on a database server (PostgreSQL): a second engine for the API's hot
    reads (api/deps.py Reader), in autocommit and without a ping per checkout. On the main
    engine a GET job took seven round trips for its one statement: the pre-ping's SELECT 1,
    BEGIN, the statement(s), and the ROLLBACK of the session's close and the pool's reset;
    each round trip a wait and a wake-up of a read thread, costing the API more CPU than the
    rows (PostgreSQL, profiled: 2.5 ms CPU a read, /healthz 0.7). A read here is its
    statements alone. What that gives up: a read of several statements no longer sees one
    snapshot (pages and counts may straddle a write, as two requests would), and a
    connection the server closed is found by the read itself, which is retried once (a read
    has no effect to repeat; api/deps.py _read). None for SQLite (reads there run in
    process, on the event loop: ``make_loop_read_engine``)."""
    if engine.url.get_backend_name() == "sqlite":
        return None
    return create_engine(
        engine.url,
        isolation_level="AUTOCOMMIT",
        pool_pre_ping=False,
        pool_reset_on_return=None,  # nothing to roll back in autocommit
        pool_size=pool_size,
        max_overflow=pool_size,
    )


class LoopReads:
    """Read-only sessions on one connection of a loop read engine (``make_loop_read_engine``)
    that stays open, for the event loop's thread only: a pooled connection per read
    (checkout, reset, return) cost 7 % of a GET job's CPU. Each session begins a transaction
    on the connection and rolls it back when it closes, so every read sees what was
    committed before it began."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._conn: Connection | None = None
        self._opened = 0  # connections opened so far: tells their data_version apart

    def _connection(self) -> Connection:
        conn = self._conn
        if conn is None or conn.closed or conn.invalidated:
            conn = self._conn = self.engine.connect()
            self._opened += 1
        return conn

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with Session(bind=self._connection(), expire_on_commit=False) as session:
            return cast(T, fn(session, *args, **kwargs))

    def data_version(self) -> tuple[int, int]:
        """A value that changes whenever any other connection (a request's write, the
        worker's, another process's) has committed to the database since it was last taken:
        SQLite's ``PRAGMA data_version`` (a read of the WAL index, ~5 us), paired with the
        connection it was asked on, since each connection counts on its own. Asked between
        reads, never inside one's transaction."""
        conn = self._connection()
        sqlite = cast(Any, conn.connection.driver_connection)  # sqlite3.Connection
        return self._opened, int(sqlite.execute("PRAGMA data_version").fetchone()[0])

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self.engine.dispose()


class DriverSelect:
    """A select run on the driver's own cursor, for the hottest read (GET /v1/jobs/{id}):
    rows as named tuples (an attribute per selected column, by its label), each value as
    SQLAlchemy would return it (its result processors applied). What it skips is
    SQLAlchemy's per-execution machinery: on PostgreSQL a ``Connection.execute`` of the
    job's row cost 2.5x the driver's execute and fetch (execution context, result metadata,
    and psycopg building a ``cursor.description`` of 49 column objects that SQLAlchemy
    reads on every execution). The statement is compiled once per dialect. An engine with
    cursor listeners (tracing, tests) gets SQLAlchemy's execution, which runs them."""

    def __init__(self, statement: Select[Any]) -> None:
        self.statement = statement
        names = [str(c.key) for c in statement.selected_columns]
        self.row: Any = namedtuple("Row", names)  # type: ignore[misc]
        self._compiled: dict[str, _CompiledSelect] = {}

    def rows(self, session: Session, params: Mapping[str, Any]) -> list[Any]:
        """The rows for ``params``, read on the session's bind: the connection it is
        bound to (LoopReads), or one checked out of its engine's pool for the statement."""
        bind = session.get_bind()
        engine = bind.engine if isinstance(bind, Connection) else bind
        hooks = engine.dispatch
        if hooks.before_cursor_execute or hooks.after_cursor_execute:
            return [self.row._make(r) for r in session.execute(self.statement, params)]
        if isinstance(bind, Connection):
            return self._run(bind.connection, bind.dialect, params)
        raw = bind.raw_connection()
        try:
            return self._run(raw, bind.dialect, params)
        finally:
            raw.close()  # back to the pool, reset as the pool resets any connection

    def _run(self, raw: Any, dialect: Dialect, params: Mapping[str, Any]) -> list[Any]:
        c = self._compiled.get(dialect.name)
        if c is None:
            c = self._compiled[dialect.name] = _CompiledSelect(self.statement, dialect)
        args = c.parameters(params)
        cursor = raw.cursor()
        try:
            cursor.execute(c.sql, args)
            fetched = cursor.fetchall()
            if c.processors is None:
                c.processors = c.result_processors(self.statement, dialect, cursor.description)
        except dialect.loaded_dbapi.Error as exc:
            # As SQLAlchemy's own execute: a connection the server closed is dropped from
            # the pool, and the error says so (api/deps.py _read retries on a fresh one).
            gone = dialect.is_disconnect(exc, raw.driver_connection, cursor)
            if gone:
                raw.invalidate(exc)
            raise DBAPIError.instance(c.sql, args, exc, dialect.loaded_dbapi.Error,
                                      connection_invalidated=gone, dialect=dialect) from exc
        finally:
            cursor.close()
        make, processors = self.row._make, c.processors
        if not any(processors):
            return [make(r) for r in fetched]
        return [make([p(v) if p else v for p, v in zip(processors, r, strict=True)])
                for r in fetched]


class _CompiledSelect:
    """A select's SQL for one dialect, how its parameters are passed, and the result
    processor of each column (None where the driver's value is already SQLAlchemy's)."""

    def __init__(self, statement: Select[Any], dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = compiled.string
        self.positions = compiled.positiontup if compiled.positional else None
        self.binds = {
            key: proc for key, b in compiled.binds.items()
            if (proc := b.type.dialect_impl(dialect).bind_processor(dialect)) is not None
        }  # fmt: skip
        self.processors: list[Callable[[Any], Any] | None] | None = None

    @staticmethod
    def result_processors(statement: Select[Any], dialect: Dialect,
                          description: Any) -> list[Callable[[Any], Any] | None]:
        """Taken at the first execution: some depend on the driver's type of the column
        (psycopg's numerics)."""
        return [c.type.dialect_impl(dialect).result_processor(dialect, d[1])
                for c, d in zip(statement.selected_columns, description, strict=True)]

    def parameters(self, params: Mapping[str, Any]) -> Any:
        values = {k: (self.binds[k](v) if k in self.binds else v) for k, v in params.items()}
        if self.positions is None:
            return values
        return tuple(values[k] for k in self.positions)


def is_lock_timeout(exc: BaseException) -> bool:
    """A SQLite statement that gave up waiting for a lock (SQLITE_BUSY or SQLITE_LOCKED)."""
    orig = getattr(exc, "orig", exc)
    return getattr(orig, "sqlite_errorcode", None) in (_SQLITE_BUSY, _SQLITE_LOCKED)


_SQLITE_BUSY = 5
_SQLITE_LOCKED = 6


@lru_cache(maxsize=1)
def get_engine() -> Engine:
    settings = get_settings()
    assert settings.database_url is not None
    if settings.is_sqlite:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return make_engine(settings.database_url)


@lru_cache(maxsize=1)
def get_sessionmaker() -> sessionmaker[Session]:
    return sessionmaker(bind=get_engine(), expire_on_commit=False)


def reset_engine_cache() -> None:
    if get_engine.cache_info().currsize:
        get_engine().dispose()
    get_engine.cache_clear()
    get_sessionmaker.cache_clear()


@contextmanager
def savepoint(session: Session) -> Iterator[None]:
    """A savepoint inside the session's transaction: an error in the block undoes only the
    block. On SQLite the driver (pysqlite, in its default transaction mode) opens no
    transaction before the first write, so a SAVEPOINT would open the outermost one and
    its RELEASE commit it at once, before the request ends; a real transaction is begun
    first, so the block commits with the rest of the unit of work, or not at all."""
    conn = session.connection()
    if conn.dialect.name == "sqlite":
        dbapi = conn.connection.dbapi_connection
        if dbapi is not None and not dbapi.in_transaction:
            conn.exec_driver_sql("BEGIN")
    with session.begin_nested():
        yield


def after_commit(session: Session, hook: Callable[[], None]) -> None:
    """Run ``hook`` once the session's unit of work has committed; never if it rolls back.
    Side effects that others act on (enqueueing a job) must not run before the rows they
    refer to are visible."""
    session.info.setdefault(_AFTER_COMMIT, []).append(hook)


def commit(session: Session) -> None:
    """Commit, then run the after-commit hooks. A failing hook is logged, not raised: what
    it was for is committed, and the hooks' owners make a lost one only a delay."""
    session.commit()
    hooks: list[Callable[[], None]] = session.info.pop(_AFTER_COMMIT, [])
    for hook in hooks:
        try:
            hook()
        except Exception:
            log.exception("after-commit hook %r failed", hook)


def rollback(session: Session) -> None:
    """Roll back, and forget the after-commit hooks: what they were for never happened."""
    session.info.pop(_AFTER_COMMIT, None)
    session.rollback()


@contextmanager
def unit_of_work(maker: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work: commit on success (then the after-commit hooks), roll back on
    error, always close."""
    session = maker()
    try:
        yield session
        commit(session)
    except BaseException:
        rollback(session)
        raise
    finally:
        session.close()


def session_scope() -> AbstractContextManager[Session]:
    """A unit of work on the process's engine."""
    return unit_of_work(get_sessionmaker())


def execute_rowcount(session: Session, statement: Executable) -> int:
    """Execute an UPDATE or DELETE and return how many rows it matched.

    For DML, ``Session.execute`` returns a ``CursorResult`` (which has ``rowcount``), but
    SQLAlchemy 2.1 types it as plain ``Result``: the cast says what it is at runtime."""
    return cast(CursorResult[Any], session.execute(statement)).rowcount

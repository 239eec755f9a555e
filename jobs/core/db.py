"""Database engine, sessions and migrations.

SQLite at ``./clipmill.db`` by default; ``CLIPMILL_DATABASE_URL`` for anything else
(for example ``postgresql+psycopg://user@host/db``). The schema is created and upgraded by
Alembic migrations only, never by ``create_all``.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.orm import Session, sessionmaker

from clipmill.jobs.core.settings import Settings

MIGRATIONS = Path(__file__).with_name("migrations")


def database_url(url: str | None = None) -> str:
    """``url``, or the settings' CLIPMILL_DATABASE_URL, or SQLite at ./clipmill.db."""
    return url or Settings.from_env().database_url


def sqlite_file(url: str | URL) -> Path | None:
    """The file of a SQLite database URL, as written in it; None for another dialect, an
    in-memory database or a ``file:`` URI. Raises ArgumentError for a URL that does not parse."""
    parsed = make_url(url)
    name = parsed.database
    if not parsed.drivername.startswith("sqlite") or not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name)


def sqlite_in_memory(url: str | URL) -> bool:
    """Whether a URL names an in-memory SQLite database (``sqlite://``, ``:memory:``, a ``file:``
    URI with ``mode=memory``), which each process opens empty. Raises ArgumentError for a URL
    that does not parse."""
    parsed = make_url(url)
    name = parsed.database or ""
    return parsed.drivername.startswith("sqlite") and (
        name in ("", ":memory:") or (name.startswith("file:") and (":memory:" in name or "mode=memory" in name))
        or parsed.query.get("mode") == "memory")


def make_engine(url: str | None = None) -> Engine:
    url = database_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):
            # WAL lets readers (status, review) run beside the writer; foreign keys are off by default.
            dbapi_conn.isolation_level = None  # let SQLAlchemy's begin below control transactions
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            # BEGIN IMMEDIATE takes the write lock up front, so compare-and-set moves serialise
            # instead of failing with "database is locked" on upgrade from a read lock.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True)


def migrate(engine: Engine) -> None:
    """Bring the schema up to the newest migration (idempotent)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            # one migrator at a time when several workers start together
            conn.execute(text("SELECT pg_advisory_xact_lock(4242001)"))
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


class Database:
    """An engine, its session factory, and a migrated schema."""

    def __init__(self, url: str | None = None, *, upgrade: bool = True):
        self.url = database_url(url)
        self.engine = make_engine(self.url)
        if upgrade:
            migrate(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    def session(self) -> Session:
        return self.sessions()

    def dispose(self) -> None:
        self.engine.dispose()

"""Alembic environment: runs on the connection clipmill hands in (see jobs.db.migrate),
or on CLIPMILL_DATABASE_URL when called from the alembic command line."""

from alembic import context

from clipmill.jobs.core.db import make_engine
from clipmill.jobs.core.models import Base

target_metadata = Base.metadata


def run() -> None:
    conn = context.config.attributes.get("connection")
    if conn is not None:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    with make_engine().connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


run()

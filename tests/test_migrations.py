"""The Alembic migrations create exactly the schema the ORM models describe."""

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from clipmill.jobs.core.db import Database
from clipmill.jobs.core.models import Base


def test_migrations_match_models(db):
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_migrate_is_idempotent(db_url):
    Database(db_url).dispose()
    d = Database(db_url)
    assert {"batches", "jobs", "attempts", "alembic_version"} <= set(inspect(d.engine).get_table_names())
    d.dispose()

"""Attempts lost with their worker are counted apart from those render and QC used up.

``jobs.attempts_lost`` counts the attempts taken back from a dead worker (kill -9, an expired
lease); they do not count against ``batches.max_attempts``, so a job whose first attempt died
with its worker still gets its QC retry. ``batches.max_lost`` (default 3) bounds them: a job
that keeps killing its worker ends failed.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("max_lost", sa.Integer(), nullable=False, server_default="3"))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("attempts_lost", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("attempts_lost")
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("max_lost")

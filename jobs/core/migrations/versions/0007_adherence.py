"""Attempts keep what the shapes world's analyzer read in their clip.

``attempts.adherence`` (JSON, null for prompts outside the shapes grammar): the attributes the
prompt asked for, those the analyzer read in the delivered clip, and which matched.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("adherence", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("adherence")

"""Jobs remember the tier they asked for, so the nightly scheduler can move them back.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("tier_requested", sa.String(16), nullable=True))
    op.execute("UPDATE jobs SET tier_requested = tier")


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("tier_requested")

"""A streaming preview's row says when its worker last showed it was streaming:
``preview_sessions.seen_at``, set when it starts and renewed every ``PREVIEW_SEEN_EVERY_S`` (10 s) while it
streams. The nightly scheduler counts a row left open by a worker (or review server) that died
only up to shortly after that, also when previews have no time limit. Rows from before have
none and are counted as before (up to the time limit).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("preview_sessions") as t:
        t.add_column(sa.Column("seen_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("preview_sessions") as t:
        t.drop_column("seen_at")

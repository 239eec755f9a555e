"""Streaming previews, so that the nightly scheduler can count the render time they take:
``preview_sessions`` keeps one row per preview (its model, the mode that served it, the worker,
when it was asked for, started and ended, its frames and why it ended).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "preview_sessions",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("mode", sa.String(16), nullable=False),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("frames", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("ended", sa.String(200), nullable=True),
    )
    op.create_index("ix_preview_sessions_started_at", "preview_sessions", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_preview_sessions_started_at", "preview_sessions")
    op.drop_table("preview_sessions")

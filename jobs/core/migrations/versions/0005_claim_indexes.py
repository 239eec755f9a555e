"""Indexes for 100k+ jobs: the claim order (priority DESC, id) and open attempts.

The claim query orders queued jobs by ``priority DESC, id``; an index on (state, priority, id)
cannot give that order, so PostgreSQL sorted every queued job on every claim. Attempts get
indexes on state (reconcile looks for the few rendered or rendering ones) and started_at (the
nightly run reads the groups since it started).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_jobs_state_priority", table_name="jobs")
    op.create_index("ix_jobs_state_priority_desc", "jobs", ["state", sa.text("priority DESC"), "id"])
    op.create_index("ix_attempts_state", "attempts", ["state"])
    op.create_index("ix_attempts_started_at", "attempts", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_attempts_started_at", table_name="attempts")
    op.drop_index("ix_attempts_state", table_name="attempts")
    op.drop_index("ix_jobs_state_priority_desc", table_name="jobs")
    op.create_index("ix_jobs_state_priority", "jobs", ["state", "priority", "id"])

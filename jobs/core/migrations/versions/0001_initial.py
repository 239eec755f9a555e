"""Batches, jobs and attempts.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(80), primary_key=True),
        sa.Column("source", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("sampler", sa.String(20), nullable=False),
        sa.Column("guidance", sa.Float(), nullable=False),
        sa.Column("out", sa.Text(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("template", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("batch_id", sa.String(80), sa.ForeignKey("batches.id", ondelete="CASCADE"), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("client_id", sa.String(64), nullable=True),
        sa.Column("prompt_raw", sa.Text(), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("negative_prompt", sa.Text(), nullable=False),
        sa.Column("elements", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("frames", sa.Integer(), nullable=False),
        sa.Column("fps", sa.Integer(), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("height", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("attempts_made", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("batch_id", "client_id", name="uq_jobs_batch_client"),
    )
    op.create_index("ix_jobs_state_priority", "jobs", ["state", "priority", "id"])
    op.create_index("ix_jobs_batch_state", "jobs", ["batch_id", "state"])
    op.create_table(
        "attempts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("sampler", sa.String(20), nullable=False),
        sa.Column("guidance", sa.Float(), nullable=False),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("group_id", sa.String(64), nullable=True),
        sa.Column("group_size", sa.Integer(), nullable=True),
        sa.Column("timings", sa.JSON(), nullable=False),
        sa.Column("qc_metrics", sa.JSON(), nullable=True),
        sa.Column("verdict", sa.String(16), nullable=True),
        sa.Column("reasons", sa.JSON(), nullable=True),
        sa.Column("raw_key", sa.Text(), nullable=True),
        sa.Column("clip_key", sa.Text(), nullable=True),
        sa.Column("poster_key", sa.Text(), nullable=True),
        sa.Column("sidecar_key", sa.Text(), nullable=True),
        sa.Column("location", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
    )
    op.create_index("ix_attempts_job_id", "attempts", ["job_id"])


def downgrade() -> None:
    op.drop_table("attempts")
    op.drop_index("ix_jobs_batch_state", "jobs")
    op.drop_index("ix_jobs_state_priority", "jobs")
    op.drop_table("jobs")
    op.drop_table("batches")

"""The review page's risk order and filters, on the job row so that a page of a 10,000-job
batch is one indexed query: ``jobs.qc_margin`` (how close the shown attempt's QC metrics came to
their limits, qc.margin; smaller is riskier), ``jobs.qc_near`` (the metric that came nearest) and
``jobs.qc_kinds`` (its reject reasons' kinds, comma-wrapped: ",boiling,flicker,"). Set by the
post stage; NULL for jobs checked before this revision (they sort last).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("qc_margin", sa.Float(), nullable=True))
        batch.add_column(sa.Column("qc_near", sa.String(24), nullable=True))
        batch.add_column(sa.Column("qc_kinds", sa.String(200), nullable=True))
        batch.create_index("ix_jobs_batch_margin", ["batch_id", "qc_margin"])


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_batch_margin")
        for column in ("qc_kinds", "qc_near", "qc_margin"):
            batch.drop_column(column)

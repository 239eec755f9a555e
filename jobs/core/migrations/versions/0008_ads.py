"""Ad batches: one row of an ad batch is an ad; its shots are jobs.

``ads``: an ad's row (line, id, placeholder values, seed), its state (waiting, assembling, done,
rejected, failed) with a version and a lease for the assembly, what the assembly wrote
(``outputs``) and why it did not (``error``). ``jobs.ad_id`` / ``jobs.shot`` / ``jobs.formats``:
the ad a job is a shot of, the shot's place in it and the formats made from its footage.
``batches.ad_template``: the template file of an ad batch. ``batches.notify_url`` /
``notified_at`` / ``notify_error``: the batch-finished callback (core.notify).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ads",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("batch_id", sa.String(80), sa.ForeignKey("batches.id", ondelete="CASCADE"), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("client_id", sa.String(64), nullable=True),
        sa.Column("values", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outputs", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ads_batch_id", "ads", ["batch_id"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("ad_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("shot", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("formats", sa.JSON(), nullable=True))
        batch.create_foreign_key("fk_jobs_ad_id", "ads", ["ad_id"], ["id"], ondelete="CASCADE")
        batch.create_index("ix_jobs_ad_id", ["ad_id"])
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("ad_template", sa.Text(), nullable=True))
        batch.add_column(sa.Column("notify_url", sa.Text(), nullable=True))
        batch.add_column(sa.Column("notified_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("notify_error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        for column in ("notify_error", "notified_at", "notify_url", "ad_template"):
            batch.drop_column(column)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_ad_id")
        batch.drop_constraint("fk_jobs_ad_id", type_="foreignkey")
        batch.drop_column("formats")
        batch.drop_column("shot")
        batch.drop_column("ad_id")
    op.drop_index("ix_ads_batch_id", "ads")
    op.drop_table("ads")

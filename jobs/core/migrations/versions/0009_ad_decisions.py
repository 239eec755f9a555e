"""Operators' decisions on ads: ``ad_decisions`` keeps every approve, decline and shot
re-render of an ad (the ad's state before it, an override of the ad-level QC, the shot
re-rendered and its jobs, the note and the operator).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ad_decisions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("ad_id", sa.Integer(), sa.ForeignKey("ads.id", ondelete="CASCADE"), nullable=False),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=False),
        sa.Column("override", sa.Boolean(), nullable=False),
        sa.Column("shot", sa.Integer(), nullable=True),
        sa.Column("jobs", sa.JSON(), nullable=True),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("operator", sa.String(120), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ad_decisions_ad_id", "ad_decisions", ["ad_id"])


def downgrade() -> None:
    op.drop_index("ix_ad_decisions_ad_id", "ad_decisions")
    op.drop_table("ad_decisions")

"""An ad batch keeps its template as it was at submit: ``batches.ad_template_text`` holds the
TOML read then, and ``batches.ad_assets`` maps each font, logo and music file the ads name (as
written in the template, placeholders filled) to its copy in the batch's storage. Assembly
reads these, so a template edited after submit changes nothing, and a farm's post workers need
no file at the submitting host's paths. Batches from before keep the path alone.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("batches") as t:
        t.add_column(sa.Column("ad_template_text", sa.Text(), nullable=True))
        t.add_column(sa.Column("ad_assets", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as t:
        t.drop_column("ad_assets")
        t.drop_column("ad_template_text")

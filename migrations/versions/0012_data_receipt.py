"""jobs.data_receipt: what submit read from the training data (format, columns used and
ignored), shown on the job object.

Revision ID: 0012_data_receipt
Revises: 0011_phase
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0012_data_receipt"
down_revision = "0011_phase"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("data_receipt", JSONType, nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "data_receipt")

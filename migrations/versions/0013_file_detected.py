"""files.detected: the data format an upload holds (detected once, at upload), with the
columns used and ignored, or why none fits and what came close; shown on the file object.

Revision ID: 0013_file_detected
Revises: 0012_data_receipt
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0013_file_detected"
down_revision = "0012_data_receipt"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.add_column("files", sa.Column("detected", JSONType, nullable=True))


def downgrade() -> None:
    op.drop_column("files", "detected")

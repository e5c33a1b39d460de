"""jobs.tracking: the job's experiment tracker runs (ids and links), from the trainer's
"tracking" event.

Revision ID: 0006_tracking
Revises: 0005_usage
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006_tracking"
down_revision = "0005_usage"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column(
            "tracking",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
    )


def downgrade() -> None:
    op.drop_column("jobs", "tracking")

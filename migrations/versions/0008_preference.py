"""jobs.preference_metrics: the latest rewards of a preference job (dpo/orpo/kto), for the
job object, denormalised from its progress events like train_loss.

Revision ID: 0008_preference
Revises: 0007_slurm
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0008_preference"
down_revision = "0007_slurm"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column(
            "preference_metrics",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
    )


def downgrade() -> None:
    op.drop_column("jobs", "preference_metrics")

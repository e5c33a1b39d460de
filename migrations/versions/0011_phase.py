"""jobs.phase: what a running job is doing before its first step (preparing data, loading
the model, preparing the run), denormalised from the trainer's latest "phase" event.

Revision ID: 0011_phase
Revises: 0010_openai
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011_phase"
down_revision = "0010_openai"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column(
            "phase",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
    )


def downgrade() -> None:
    op.drop_column("jobs", "phase")

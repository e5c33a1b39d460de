"""The OpenAI face: what an OpenAI-style create asked for and what it resolved to.

Revision ID: 0010_openai
Revises: 0009_fleet
Create Date: 2026-11-26
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0010_openai"
down_revision = "0009_fleet"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.add_column("jobs", sa.Column("openai", JSONType, nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "openai")

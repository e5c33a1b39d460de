"""Index jobs.finished_at: /metrics reads the last hour of finished jobs at every scrape.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", table_name="jobs")

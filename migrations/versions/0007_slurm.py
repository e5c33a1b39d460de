"""jobs.waiting_for: why a job that a worker handed to SLURM is not running yet (SLURM's
pending reason), shown on the job object.

Revision ID: 0007_slurm
Revises: 0006_tracking
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_slurm"
down_revision = "0006_tracking"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("waiting_for", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("waiting_for")

"""jobs.pauses: attempts that ended in a user's pause, left out of the attempt budget;
jobs.paused_at and jobs.paused_seconds: time spent paused, left out of the time limit.

The new statuses (pausing, paused) need no schema change: jobs.status is a String(16).

Revision ID: 0004_pause
Revises: 0003_webhooks
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_pause"
down_revision = "0003_webhooks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("pauses", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("paused_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("paused_seconds", sa.Float(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("paused_seconds")
        batch_op.drop_column("paused_at")
        batch_op.drop_column("pauses")

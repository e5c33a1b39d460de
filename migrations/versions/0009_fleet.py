"""The fleet: workers and their inventory, GPU allocations of running jobs, job priority,
API key roles, and the one-row scheduler lock.

Revision ID: 0009_fleet
Revises: 0008_preference
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0009_fleet"
down_revision = "0008_preference"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("executor", sa.String(length=32), nullable=False),
        sa.Column("gpus", JSONType, nullable=False),
        sa.Column("cpu_cores", sa.Integer(), nullable=False),
        sa.Column("capabilities", JSONType, nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "gpu_allocations",
        sa.Column("worker_id", sa.String(length=200), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("allocated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("worker_id", "gpu_index"),
    )
    op.create_index("ix_gpu_allocations_job_id", "gpu_allocations", ["job_id"], unique=False)
    op.create_table(
        "scheduler_lock",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("decisions", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.execute("INSERT INTO scheduler_lock (id, decisions) VALUES (1, 0)")
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), server_default="0", nullable=False))
        batch.create_index("ix_jobs_queue_order", ["status", "priority", "created_at"],
                           unique=False)
    with op.batch_alter_table("api_keys") as batch:
        # Existing keys stay tenant keys; `ftune create-key --admin` makes an admin key.
        batch.add_column(
            sa.Column("role", sa.String(length=16), server_default="tenant", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("role")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_index("ix_jobs_queue_order")
        batch.drop_column("priority")
    op.drop_table("scheduler_lock")
    op.drop_index("ix_gpu_allocations_job_id", table_name="gpu_allocations")
    op.drop_table("gpu_allocations")
    op.drop_table("workers")

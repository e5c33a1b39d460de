"""Usage per attempt (job_attempts) and the spec that ran (jobs.request, jobs.resolved_spec,
jobs.run_info).

Revision ID: 0005_usage
Revises: 0004_pause
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005_usage"
down_revision = "0004_pause"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(JSONB(), "postgresql")
UTC_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    # Nullable: jobs recorded before this revision have only `spec` (the validated request).
    op.add_column("jobs", sa.Column("request", JSONType, nullable=True))
    op.add_column("jobs", sa.Column("resolved_spec", JSONType, nullable=True))
    op.add_column("jobs", sa.Column("run_info", JSONType, nullable=True))
    op.create_table(
        "job_attempts",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True,
                  autoincrement=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("started_at", UTC_TS, nullable=False),
        sa.Column("ended_at", UTC_TS, nullable=True),
        sa.Column("processes", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(16), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("loss_tokens", sa.BigInteger(), nullable=False, server_default="0"),
        sa.UniqueConstraint("job_id", "attempt", name="uq_job_attempts_job_attempt"),
    )
    # /v1/usage reads attempts by the time they ended.
    op.create_index("ix_job_attempts_ended_at", "job_attempts", ["ended_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_job_attempts_ended_at", table_name="job_attempts")
    op.drop_table("job_attempts")
    op.drop_column("jobs", "run_info")
    op.drop_column("jobs", "resolved_spec")
    op.drop_column("jobs", "request")

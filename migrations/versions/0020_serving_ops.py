"""Serving operations (issue 37): inference rate limits per API key and minute
(rate_windows, left out of 0014's commit notices on purpose: it is written at every
inference request), deployments placed on GPUs like jobs (a gpu_allocations row holds a
job's or a deployment's GPU: job_id and attempt become optional, deployment_id is new),
and why a requested deployment waits (deployments.waiting).

Revision ID: 0020_serving_ops
Revises: 0019_kept_counts
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020_serving_ops"
down_revision = "0019_kept_counts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rate_windows",
        sa.Column("subject", sa.String(48), primary_key=True),
        sa.Column("window", sa.BigInteger(), primary_key=True),
        sa.Column("requests", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("tokens", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column("deployments", sa.Column("waiting", sa.Text(), nullable=True))
    with op.batch_alter_table("gpu_allocations") as batch:
        batch.alter_column("job_id", existing_type=sa.String(40), nullable=True)
        batch.alter_column("attempt", existing_type=sa.Integer(), nullable=True)
        batch.add_column(sa.Column("deployment_id", sa.String(40), nullable=True))
        batch.create_foreign_key("fk_gpu_allocations_deployment_id", "deployments",
                                 ["deployment_id"], ["id"], ondelete="CASCADE")
        batch.create_index("ix_gpu_allocations_deployment_id", ["deployment_id"])


def downgrade() -> None:
    op.execute("DELETE FROM gpu_allocations WHERE job_id IS NULL")
    with op.batch_alter_table("gpu_allocations") as batch:
        batch.drop_index("ix_gpu_allocations_deployment_id")
        batch.drop_constraint("fk_gpu_allocations_deployment_id", type_="foreignkey")
        batch.drop_column("deployment_id")
        batch.alter_column("attempt", existing_type=sa.Integer(), nullable=False)
        batch.alter_column("job_id", existing_type=sa.String(40), nullable=False)
    op.drop_column("deployments", "waiting")
    op.drop_table("rate_windows")

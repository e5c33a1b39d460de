"""Serving (issue 37): deployments (engine servers run by workers), the adapters loaded into
each, inference usage per tenant, model and day, and jobs.model_deleted_at (OpenAI's
models.delete). On PostgreSQL each new table notifies its commits (see 0014).

Revision ID: 0016_serving
Revises: 0017_evals
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016_serving"
down_revision = "0017_evals"
branch_labels = None
depends_on = None

TABLES = ("deployments", "deployment_adapters", "inference_usage")
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.add_column("jobs", sa.Column("model_deleted_at", TS, nullable=True))
    op.create_table(
        "deployments",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("key", sa.String(64), nullable=False, unique=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"),
                  nullable=True),
        sa.Column("keep_warm", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("url", sa.Text(), nullable=True),
        sa.Column("engine_key", sa.String(80), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("generation", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("restarts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("memory_mb", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("requested_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("ready_at", TS, nullable=True),
        sa.Column("last_used_at", TS, nullable=False),
        sa.Column("heartbeat_at", TS, nullable=True),
        sa.Column("stopped_at", TS, nullable=True),
    )
    op.create_index("ix_deployments_state", "deployments", ["state"])
    op.create_table(
        "deployment_adapters",
        sa.Column("deployment_id", sa.String(40),
                  sa.ForeignKey("deployments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("loaded_at", TS, nullable=False),
        sa.Column("last_used_at", TS, nullable=False),
    )
    op.create_table(
        "inference_usage",
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("day", sa.String(10), primary_key=True),
        sa.Column("model", sa.String(256), primary_key=True),
        sa.Column("requests", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False, server_default="0"),
    )
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:  # ftune_notify_commit() is 0014's
            op.execute(f"""
                CREATE TRIGGER ftune_notify_commit
                AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
                FOR EACH STATEMENT EXECUTE FUNCTION ftune_notify_commit()
            """)


def downgrade() -> None:
    op.drop_table("inference_usage")
    op.drop_table("deployment_adapters")
    op.drop_index("ix_deployments_state", table_name="deployments")
    op.drop_table("deployments")
    op.drop_column("jobs", "model_deleted_at")

"""Evals (OpenAI's Evals API): evals, their runs and the runs' output items; files.purpose
(evals: an eval's item file). The new tables notify their commits as every table does
(0014_commit_notices).

Revision ID: 0017_evals
Revises: 0015_history
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0017_evals"
down_revision = "0015_history"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")
TABLES = ("evals", "eval_runs", "eval_output_items")


def _when() -> sa.Column[object]:
    return sa.Column("created_at", sa.DateTime(timezone=True), nullable=False)


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("purpose", sa.String(32), nullable=False,
                                   server_default="fine-tune"))
    op.create_table(
        "evals",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("meta", JSONType, nullable=True),
        sa.Column("data_source_config", JSONType, nullable=False),
        sa.Column("testing_criteria", JSONType, nullable=False),
        _when(),
    )
    op.create_index("ix_evals_tenant_id", "evals", ["tenant_id"])
    op.create_table(
        "eval_runs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("eval_id", sa.String(40), sa.ForeignKey("evals.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("name", sa.String(256), nullable=False),
        sa.Column("meta", JSONType, nullable=True),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("data_source", JSONType, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("items_total", sa.Integer(), nullable=False),
        sa.Column("result_counts", JSONType, nullable=True),
        sa.Column("per_testing_criteria_results", JSONType, nullable=True),
        sa.Column("per_model_usage", JSONType, nullable=True),
        sa.Column("generation_seconds", sa.Float(), nullable=False),
        sa.Column("grading_seconds", sa.Float(), nullable=False),
        _when(),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("worker_id", sa.String(200), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
    )
    op.create_index("ix_eval_runs_tenant_id", "eval_runs", ["tenant_id"])
    op.create_index("ix_eval_runs_status", "eval_runs", ["status"])
    op.create_index("ix_eval_runs_eval_created", "eval_runs", ["eval_id", "created_at"])
    op.create_table(
        "eval_output_items",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("run_id", sa.String(40), sa.ForeignKey("eval_runs.id", ondelete="CASCADE"),
                  nullable=False),
        sa.Column("eval_id", sa.String(40), nullable=False),
        sa.Column("datasource_item_id", sa.Integer(), nullable=False),
        sa.Column("datasource_item", JSONType, nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("results", JSONType, nullable=False),
        sa.Column("sample", JSONType, nullable=False),
        _when(),
        sa.UniqueConstraint("run_id", "datasource_item_id"),
    )
    if op.get_bind().dialect.name == "postgresql":
        for table in TABLES:  # the function is 0014's
            op.execute(f"""
                CREATE TRIGGER ftune_notify_commit
                AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
                FOR EACH STATEMENT EXECUTE FUNCTION ftune_notify_commit()
            """)


def downgrade() -> None:
    op.drop_table("eval_output_items")
    op.drop_index("ix_eval_runs_eval_created", table_name="eval_runs")
    op.drop_index("ix_eval_runs_status", table_name="eval_runs")
    op.drop_index("ix_eval_runs_tenant_id", table_name="eval_runs")
    op.drop_table("eval_runs")
    op.drop_index("ix_evals_tenant_id", table_name="evals")
    op.drop_table("evals")
    with op.batch_alter_table("files") as batch:
        batch.drop_column("purpose")

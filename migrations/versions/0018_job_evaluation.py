"""Evaluation inside fine-tuning: an eval run may belong to the job whose evaluation made it
(eval_runs.job_id: its checkpoints are served to that run before the job succeeded), and a
job keeps its evaluation's scores and the best checkpoint it chose (jobs.evaluation).

Revision ID: 0018_job_evaluation
Revises: 0016_serving
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0018_job_evaluation"
down_revision = "0016_serving"
branch_labels = None
depends_on = None

JSONType = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("eval_runs") as batch:
        batch.add_column(sa.Column("job_id", sa.String(40), nullable=True))
    op.create_index("ix_eval_runs_job_id", "eval_runs", ["job_id"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("evaluation", JSONType, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("evaluation")
    op.drop_index("ix_eval_runs_job_id", table_name="eval_runs")
    with op.batch_alter_table("eval_runs") as batch:
        batch.drop_column("job_id")

"""What /metrics reads instead of the history: kept counts, and index ranges.

* job_status_counts: jobs per status and shard (the last character of the job id), kept by
  the state machine in each move's transaction (core/jobs/state.py says why sharded);
  filled here from the jobs in one INSERT ... SELECT ... GROUP BY.
* usage_totals: a tenant's ended attempts over all time, kept with its day rows
  (core/jobs/usage.py); filled here from usage_days.
* ix_jobs_status_queued_at replaces ix_jobs_status: the same status prefix, and the oldest
  queued job is one probe.
* ix_workers_heartbeat_at: the workers seen lately by range (a row stays for every worker
  process there ever was).

Each statement is one pass over a table: seconds at most on 100,000 jobs, no row read back
into Python.

Revision ID: 0019_kept_counts
Revises: 0018_job_evaluation
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_kept_counts"
down_revision = "0018_job_evaluation"
branch_labels = None
depends_on = None

NEW_TABLES = ("job_status_counts", "usage_totals")

# substr(id, length(id), 1): the last character, as core/jobs/state.py shard_of, on both.
_COUNTS = """
INSERT INTO job_status_counts (status, shard, jobs)
SELECT status, substr(id, length(id), 1), count(*) FROM jobs
GROUP BY status, substr(id, length(id), 1)
"""
_TOTALS = """
INSERT INTO usage_totals (tenant_id, attempts, tokens, loss_tokens, wall_seconds, gpu_seconds)
SELECT tenant_id, sum(attempts), sum(tokens), sum(loss_tokens), sum(wall_seconds),
       sum(gpu_seconds)
FROM usage_days GROUP BY tenant_id
"""


def upgrade() -> None:
    op.create_table(
        "job_status_counts",
        sa.Column("status", sa.String(16), primary_key=True),
        sa.Column("shard", sa.String(1), primary_key=True),
        sa.Column("jobs", sa.BigInteger(), nullable=False),
    )
    op.create_table(
        "usage_totals",
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"),
                  primary_key=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("loss_tokens", sa.BigInteger(), nullable=False),
        sa.Column("wall_seconds", sa.Float(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
    )
    op.execute(_COUNTS)
    op.execute(_TOTALS)
    op.create_index("ix_jobs_status_queued_at", "jobs", ["status", "queued_at"])
    op.drop_index("ix_jobs_status", table_name="jobs")
    op.create_index("ix_workers_heartbeat_at", "workers", ["heartbeat_at"])
    if op.get_bind().dialect.name == "postgresql":
        for table in NEW_TABLES:  # ftune_notify_commit() is 0014's
            op.execute(f"""
                CREATE TRIGGER ftune_notify_commit
                AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
                FOR EACH STATEMENT EXECUTE FUNCTION ftune_notify_commit()
            """)


def downgrade() -> None:
    op.drop_index("ix_workers_heartbeat_at", table_name="workers")
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.drop_index("ix_jobs_status_queued_at", table_name="jobs")
    for table in reversed(NEW_TABLES):
        op.drop_table(table)  # its triggers go with it

"""PostgreSQL: every committed write to any table sends one NOTIFY on ftune_commits, so that
an API process can tell whether anything was committed since it read a job without asking
the database (core/db/notices.py; SQLite has PRAGMA data_version for it).

A statement-level trigger on each table: NOTIFY is delivered at commit, never for a
transaction rolled back, and PostgreSQL folds the notifications a transaction sends on one
channel with one payload into one, so a transaction of many statements costs one
notification. A table added by a later migration needs the trigger too
(tests/core/db/test_notices.py checks that every table has it).

Revision ID: 0014_commit_notices
Revises: 0013_file_detected
Create Date: 2026-11-27
"""

from __future__ import annotations

from alembic import op

revision = "0014_commit_notices"
down_revision = "0013_file_detected"
branch_labels = None
depends_on = None

CHANNEL = "ftune_commits"  # core/db/notices.py CHANNEL
TABLES = (
    "tenants", "api_keys", "files", "jobs", "job_attempts", "job_events", "checkpoints",
    "webhook_endpoints", "webhook_events", "webhook_deliveries", "workers",
    "gpu_allocations", "scheduler_lock",
)


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"""
        CREATE FUNCTION ftune_notify_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('{CHANNEL}', '');
            RETURN NULL;
        END $$
    """)
    for table in TABLES:
        op.execute(f"""
            CREATE TRIGGER ftune_notify_commit
            AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
            FOR EACH STATEMENT EXECUTE FUNCTION ftune_notify_commit()
        """)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS ftune_notify_commit ON {table}")
    op.execute("DROP FUNCTION IF EXISTS ftune_notify_commit()")

"""PostgreSQL: every committed write sends a NOTIFY on ftune_commits, so that an API process
can tell whether a job may have changed since it read it without asking the database
(api/commit_notices.py; SQLite has PRAGMA data_version for it).

A job's own rows (jobs, job_attempts, checkpoints, job_events) notify per row with the job
id as payload; every other table per statement with an empty payload. NOTIFY is delivered
at commit, never for a transaction rolled back, and PostgreSQL folds the notifications of a
transaction that carry one payload into one: a transaction that writes one job many times
sends one. A table added by a later migration needs a trigger too (tests/api/test_notices.py
checks that every table has one).

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

CHANNEL = "ftune_commits"  # api/commit_notices.py CHANNEL
JOB_TABLES = {"jobs": "id", "job_attempts": "job_id", "checkpoints": "job_id",
              "job_events": "job_id"}  # table -> its job id column
OTHER_TABLES = (
    "tenants", "api_keys", "files", "webhook_endpoints", "webhook_events",
    "webhook_deliveries", "workers", "gpu_allocations", "scheduler_lock",
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
    for column in sorted(set(JOB_TABLES.values())):  # one function a column: no dynamic SQL
        op.execute(f"""
            CREATE FUNCTION ftune_notify_job_{column}() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF TG_OP = 'DELETE' THEN
                    PERFORM pg_notify('{CHANNEL}', OLD.{column});
                ELSE
                    PERFORM pg_notify('{CHANNEL}', NEW.{column});
                END IF;
                RETURN NULL;
            END $$
        """)
    for table, column in JOB_TABLES.items():
        op.execute(f"""
            CREATE TRIGGER ftune_notify_job
            AFTER INSERT OR UPDATE OR DELETE ON {table}
            FOR EACH ROW EXECUTE FUNCTION ftune_notify_job_{column}()
        """)
        op.execute(f"""
            CREATE TRIGGER ftune_notify_commit
            AFTER TRUNCATE ON {table}
            FOR EACH STATEMENT EXECUTE FUNCTION ftune_notify_commit()
        """)
    for table in OTHER_TABLES:
        op.execute(f"""
            CREATE TRIGGER ftune_notify_commit
            AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {table}
            FOR EACH STATEMENT EXECUTE FUNCTION ftune_notify_commit()
        """)


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in JOB_TABLES:
        op.execute(f"DROP TRIGGER IF EXISTS ftune_notify_job ON {table}")
    for table in (*JOB_TABLES, *OTHER_TABLES):
        op.execute(f"DROP TRIGGER IF EXISTS ftune_notify_commit ON {table}")
    for column in sorted(set(JOB_TABLES.values())):
        op.execute(f"DROP FUNCTION IF EXISTS ftune_notify_job_{column}()")
    op.execute("DROP FUNCTION IF EXISTS ftune_notify_commit()")

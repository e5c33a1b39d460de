"""The Celery side of the worker: its app and signal hooks (celery_app.py) and the tasks
(tasks.py). The producer side the API shares (task names, configuration, enqueueing) is in
core/infra/broker.py and core/jobs/dispatch.py."""

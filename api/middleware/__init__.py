"""ASGI middleware: request logging and metrics (observe.py), and GET /v1/jobs/{id} answered
before the routing for trusted keys (polled_jobs.py)."""

"""What a worker process runs beside its jobs: its entry in the fleet registry and its
heartbeat (registry.py), the reconciler that repairs what lost messages and lost workers
left (reconciler.py), and the webhook sender (webhook_sender.py)."""

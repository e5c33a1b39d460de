"""Webhooks: the outbox written beside a job's status change (outbox.py), the address guard
every call goes through (netguard.py), and Standard Webhooks signing (signing.py). The
sender that delivers the outbox is worker/upkeep/webhook_sender.py."""

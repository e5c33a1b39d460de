"""Webhooks: the outbox written beside a job's status change (outbox.py) and Standard
Webhooks signing (signing.py). The address guard every call goes through is
core/infra/netguard.py (graders' judge calls use it too). The sender that delivers the
outbox is worker/upkeep/webhook_sender.py."""

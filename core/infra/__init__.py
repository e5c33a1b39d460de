"""Infrastructure every process shares: settings, logging, errors, the broker, paths, the
outbound address guard (netguard.py: webhooks and graders' judge calls)."""

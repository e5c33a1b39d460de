"""The serving supervisor: a thread in every worker that runs the deployments it claims
(vLLM's OpenAI server, each in its own process tree), health-checks and restarts them, and
stops them when idle or told to (supervisor.py)."""

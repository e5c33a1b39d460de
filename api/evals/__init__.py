"""The Evals API (OpenAI's /v1/evals): routes, use cases and object shapes."""

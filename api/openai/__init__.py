"""The OpenAI fine-tuning API as a face of the same service: routes that translate OpenAI's
requests onto the job commands (api/services/) and the jobs, events, checkpoints, files and
errors back into OpenAI's objects (openai-python's types/fine_tuning/ are the reference)."""

"""The run: what the worker hands the trainer (the run plan) and the job directory between them."""

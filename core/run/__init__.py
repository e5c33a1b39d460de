"""The run: what the worker hands the trainer (the run plan), the job directory between them,
and the checkpoint rules both sides read (checkpoints.py: manifest, resume policy)."""

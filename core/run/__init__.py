"""The run: what the worker hands the trainer (the run plan), the job directory between them,
the checkpoint rules both sides read (checkpoints.py: manifest, resume policy), and the job's
tracker runs both write to (trackers.py: the trainer its curves, the worker its scores)."""

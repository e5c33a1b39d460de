"""The worker, in layers: queue/ (the Celery app and its tasks: how a doorbell arrives),
run/ (one run of one job: claim -> prepare -> launch -> watch -> verdict -> finish, on
this worker's own processes), slurm/ (the same run as a SLURM job), upkeep/ (what runs
beside the jobs: this worker's registry entry, the reconciler, the webhook sender)."""

"""The SLURM executor: a job becomes one SLURM job (sbatch) whose srun starts
``accelerate launch`` once per node; SLURM allocates, queues, preempts and enforces the time
limit, the worker maps what squeue and the job directory say onto the job state machine.

* script.py: the batch script and sbatch argv, built from an allowlist (pure).
* states.py: SLURM job state -> the job's verdict (pure).
* commands.py: sbatch / squeue / scancel (/ sacct when accounting is on), argv only.
* run.py: one claimed job on SLURM: adopt or submit, watch, cancel, conclude.
* orphans.py: live SLURM jobs whose job ended, scancelled by the reconciler.

submitit is not used: it pickles a Python callable and runs it with its own launcher, so the
script would not be the ``accelerate launch`` command users can read and rerun (served by
GET /v1/jobs/{id}/launch), it keeps its own job state in pickles beside the job, and its
requeue-on-preemption calls back into the pickled object. We need none of it: our "function"
is a fixed argv, state comes from squeue and the job directory, and requeues go through the
job state machine (attempts counted, resumed from the latest checkpoint).
"""

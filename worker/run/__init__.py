"""One run of one job, in layers: claim.py (the guarded queued -> running move and its
placement) -> prepare.py (the run policy, spec.json, accelerate.yaml; accelerate_config.py
builds the YAML) -> process_tree.py (spawn the trainer, kill its whole tree) -> watch.py
(the loop while it runs; ingest.py moves events, progress and checkpoints into the
database) -> verdict.py (a pure function of the evidence: adapter_check.py, trainer_log.py)
-> finish. local.py runs that lifecycle on this worker's own processes; executor.py picks
local or SLURM (worker/slurm/) for a claimed job."""

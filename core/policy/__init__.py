"""The run policy: can this job run here, and with what. One home for each rule, called by
the API at submit (api/services/jobs/submit_checks.py), the worker when it resolves a run
(worker/run/prepare.py) and the trainer before it loads weights (core/train/job.py).

* admission.py: the rules below applied in three stages (submit, claim, preflight), each
  rule at the earliest stage that has its facts and again at every later one; the API,
  the worker and the trainer call its stage functions.
* sources.py: where the model and the data may come from, and remote code.
* hardware.py: what a worker's (or the trainer's) hardware can run honestly.
* layers.py: what FSDP wraps in the model, found on the meta device.
* tracking.py: which experiment trackers a job may use, and where they write.
* slurm.py: what a SLURM pool can run (multi-machine admission).
* limits.py: how long a run may hold its hardware (time limit, deadline).
* memory.py: whether a full fine-tune's weights, gradients and optimizer state fit a GPU
  (core/model/estimate.py's accounting; at submit against the fleet, at claim against the
  worker's GPUs).

Pure: settings, spec and paths in, a ``Refusal`` (or a resolved value) out. No web, queue or
database code (the trainer imports it; tests/core/train/test_import_boundary.py); lookups
such as an upload's row stay with the caller.
"""

from core.policy.hardware import (
    bitsandbytes_installed,
    cpu_refusal,
    device_refusal,
    preference_refusal,
    quantization_refusal,
    runs_cpu_fsdp2,
    trl_installed,
    worker_refusal,
)
from core.policy.layers import (
    fsdp2_tied_weights_problem,
    fsdp_layer_classes,
    fsdp_wrap_classes,
    wraps_transformer_layers,
)
from core.policy.limits import run_deadline, time_limit
from core.policy.refusal import Refusal, Refused
from core.policy.slurm import (
    SlurmPool,
    node_cpus,
    pool_from_settings,
    runs_on_slurm,
    slurm_pool_refusal,
)
from core.policy.sources import (
    chat_template_refusal,
    context_length_refusal,
    data_path,
    model_kind,
    model_location,
    remote_code_refusal,
    stored_upload,
)
from core.policy.tracking import resolve_tracking, tracking_refusals

__all__ = [
    "Refusal",
    "Refused",
    "SlurmPool",
    "bitsandbytes_installed",
    "chat_template_refusal",
    "context_length_refusal",
    "cpu_refusal",
    "data_path",
    "device_refusal",
    "fsdp2_tied_weights_problem",
    "fsdp_layer_classes",
    "fsdp_wrap_classes",
    "model_kind",
    "model_location",
    "node_cpus",
    "pool_from_settings",
    "preference_refusal",
    "quantization_refusal",
    "remote_code_refusal",
    "resolve_tracking",
    "run_deadline",
    "runs_cpu_fsdp2",
    "runs_on_slurm",
    "slurm_pool_refusal",
    "stored_upload",
    "time_limit",
    "tracking_refusals",
    "trl_installed",
    "worker_refusal",
    "wraps_transformer_layers",
]

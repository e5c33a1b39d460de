"""The job spec: what a user POSTs to /v1/jobs, and what the trainer reads from spec.json.

Names follow transformers / accelerate / peft so a user can move settings across. Field
checks live on the models, one module per section (model, data, peft, training, distributed,
tracking; job holds the whole; grpo and graders hold training.grpo and its grader, with the
grader's template and formula languages; chat_templates the named chat templates; catalog
the base models an operator offers). Checks that relate several fields live in
``checks.spec_problems``, which collects *every* problem (with its field path) instead of
stopping at the first, so a user fixes a spec in one round trip. ``parse_job_spec``
(parsing.py) runs both and raises one ``SpecError``.

This package must stay importable without torch (the API validates specs without it), and
imports nothing else from core: it is the vocabulary the other layers speak
(tests/test_imports.py).
"""

from core.spec.base import Problem, SpecError
from core.spec.checks import spec_problems
from core.spec.data import COLUMN_ROLES, FORMATS_BY_TASK, DataFormat, DatasetSpec, ShareGptTags
from core.spec.distributed import DeepSpeedSpec, DistributedSpec, FsdpSpec
from core.spec.job import JobSpec, ResourcesSpec
from core.spec.model import (
    AUTO_MODEL_CLASS,
    PEFT_TASK_TYPE,
    HalfOrFull,
    ModelSpec,
    QuantizationSpec,
    Task,
)
from core.spec.parsing import (
    parse_job_spec,
    resolved_spec,
    stored_spec,
    stored_spec_error,
)
from core.spec.peft import (
    FullSpec,
    IA3Spec,
    LoraSpec,
    PeftSpec,
    PrefixTuningSpec,
    PromptTuningSpec,
    TargetModules,
)
from core.spec.tracking import Tracker, TrackingSpec
from core.spec.training import (
    PREFERENCE_FORMAT,
    DpoLossType,
    Objective,
    PreferenceSpec,
    TrainingSpec,
)

__all__ = [
    "AUTO_MODEL_CLASS",
    "COLUMN_ROLES",
    "FORMATS_BY_TASK",
    "PEFT_TASK_TYPE",
    "PREFERENCE_FORMAT",
    "DataFormat",
    "DatasetSpec",
    "DeepSpeedSpec",
    "DistributedSpec",
    "DpoLossType",
    "FsdpSpec",
    "FullSpec",
    "HalfOrFull",
    "IA3Spec",
    "JobSpec",
    "LoraSpec",
    "ModelSpec",
    "Objective",
    "PeftSpec",
    "PreferenceSpec",
    "PrefixTuningSpec",
    "Problem",
    "PromptTuningSpec",
    "QuantizationSpec",
    "ResourcesSpec",
    "ShareGptTags",
    "SpecError",
    "TargetModules",
    "Task",
    "Tracker",
    "TrackingSpec",
    "TrainingSpec",
    "parse_job_spec",
    "resolved_spec",
    "spec_problems",
    "stored_spec",
    "stored_spec_error",
]

"""Entry point: ``python -m core.train <job_dir>`` on every rank.

Exit status is the truth for the worker: 0 when the run finished (adapter published) or
stopped gracefully (checkpoint saved, "stopped" event); 1 on any failure, after error.json
was written; 2 when the arguments are unusable (nothing could be written).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

USAGE = (
    "usage: python -m core.train <job_dir>   (or: accelerate launch ... -m core.train <job_dir>)"
)


def _setup_logging(root: Path) -> None:
    """JSON lines on stderr (trainer.log), each with the job id, attempt and rank, like the
    API's and the worker's; Python warnings go through it too."""
    import json

    from core.infra.logging import bind, configure_logging, quiet_library_loggers

    rank = int(os.environ.get("RANK", "0"))
    # Only rank 0 narrates; other ranks speak up for warnings and errors.
    configure_logging(logging.INFO if rank == 0 else logging.WARNING, json=True)
    logging.captureWarnings(True)
    fields: dict[str, object] = {"rank": rank}
    runtime: dict[str, object] = {}
    try:
        runtime = json.loads((root / "spec.json").read_text()).get("runtime") or {}
        fields.update(job_id=runtime.get("job_id"), attempt=runtime.get("attempt"))
    except (OSError, ValueError, AttributeError):
        pass  # the recipe reports an unreadable spec.json as the failure it is
    bind(**fields)
    device = runtime.get("device")
    quiet_library_loggers(device if isinstance(device, str) else None)
    # trainer.log is a file: progress bars would fill it with carriage-return noise.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    # transformers' own handler would write its lines a second time, as text.
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def _skip_unused_libraries(root: Path) -> None:
    """Mark absent the heavy libraries this run will not use, before any library imports
    them (measured with ``python -X importtime``, per rank, 2-core machine):

    * bitsandbytes: peft and transformers import it whenever it is installed (peft's LoRA
      layer dispatch for its 8/4-bit modules): 1.3-2.4 s and a trainer.log line about its
      CPU kernels. Only a quantized base (model.quantization, QLoRA) uses it.
    * deepspeed: accelerate imports it whenever it is installed, as soon as the Trainer
      unwraps its model (``extract_model_from_parallel``), and it imports mlflow with its
      autotuner: 0.75 s. Only the deepspeed strategy uses it (core/train/deepspeed_checkpoint.py
      and full_model.py import it inside that strategy's paths).

    For a None in sys.modules importlib's find_spec answers "not installed", which every
    library here takes as its path without it. Only in a process of its own (the
    ``python -m core.train`` entry): a test calling main() must not hide them from the rest
    of its process."""
    import json

    try:
        spec = json.loads((root / "spec.json").read_text()).get("spec") or {}
        model, distributed = spec.get("model"), spec.get("distributed") or {}
        quantized = not isinstance(model, dict) or model.get("quantization") is not None
        deepspeed = not isinstance(distributed, dict) or distributed.get("strategy") == "deepspeed"
    except (OSError, ValueError, AttributeError):
        return  # the recipe reports an unreadable spec.json as the failure it is
    if not quantized:
        sys.modules.setdefault("bitsandbytes", None)  # type: ignore[arg-type]
    if not deepspeed:
        sys.modules.setdefault("deepspeed", None)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        sys.stderr.write(USAGE + "\n")
        return EXIT_USAGE if not argv or argv[0] not in ("-h", "--help") else EXIT_OK
    root = Path(argv[0]).resolve()
    if not root.is_dir():
        sys.stderr.write(f"job directory {root} does not exist\n{USAGE}\n")
        return EXIT_USAGE
    from core.infra.cpu_priority import session_follows_own_nice
    from core.run.jobdir import STOP_FILE
    from core.train.stop import StopRequest

    # A rank that torchrun started in a session of its own keeps the worker's priority
    # (FTUNE_WORKER_NICE) for that session too: it must not take the CPU from the API.
    session_follows_own_nice()

    # The handler goes in first: a SIGTERM while torch is imported or the model loads must
    # not kill the process before it had a chance to stop cleanly.
    stop = StopRequest(root / STOP_FILE, deadline=None)
    stop.install_signal_handler()
    # An orphan (the launcher or worker above was killed) stops, then exits: it must not go
    # on writing into a job directory that another attempt resumes from.
    from core.train.lifeline import watch_parent

    def orphaned() -> None:
        stop.signalled = True  # as if SIGTERMed: stop (and save) at the next step boundary

    watch_parent(orphaned, root / STOP_FILE)

    _setup_logging(root)
    log = logging.getLogger("core.train")
    from core.train import dist
    from core.train.failures import Where, classify, write_error

    recipe = None
    try:
        from core.train.recipe import Recipe

        recipe = Recipe(root, stop)
        return recipe.run()
    except BaseException as exc:  # every failure must leave error.json
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        if recipe is not None:
            try:  # the tracker runs say the job failed (never hiding the failure itself)
                recipe.close_tracking("FAILED")
            except Exception:
                log.warning("could not close the tracking runs", exc_info=True)
        where = recipe.current_where() if recipe is not None else Where("setup")
        code, message = classify(exc, where)
        log.error("failed [%s]: %s", code, message, exc_info=exc)
        try:
            write_error(root, code, message, exc)
        except Exception:  # the disk may be the problem; the exit status still tells
            log.exception("could not write error.json")
        return EXIT_FAILED
    finally:
        # Success, failure, graceful stop and cancel all pass here: the exit status returned
        # above must not be replaced by an abort in the process group's destructor.
        try:
            dist.teardown()
        except Exception:  # a broken group at exit changes nothing about the verdict
            log.warning("process group teardown failed", exc_info=True)


def exit_now(code: int) -> None:
    """End a rank of a multi-process run with ``code``, skipping interpreter finalisation.

    With the process group destroyed, what is left to run at exit is the teardown of C++
    objects that torch, gloo and torch.distributed.checkpoint keep in module globals; seen
    here once in ~15 FSDP2 runs, one of them aborted a rank that had already finished well
    ("terminate called without an active exception"), and torchrun then reported the job as
    crashed. Every file the trainer writes is closed by now; only stdio needs flushing.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) == 2:
        _skip_unused_libraries(Path(sys.argv[1]).resolve())
    # Every rank, one-process runs too: after the verdict is written, interpreter
    # finalisation only frees the model's millions of Python objects, and a job is not
    # `succeeded` until the trainer has exited (measured 0.2-0.3 s with os._exit against
    # 15-25 s under load without it; docs/benchmarks.md, service overhead). Trackers are
    # closed by the recipe itself, as multi-process runs have always needed.
    exit_now(main())

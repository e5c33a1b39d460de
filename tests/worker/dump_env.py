"""Launched by tests under `accelerate launch`: each rank writes what the launcher gave it.

Usage: ``accelerate launch --config_file X -m tests.worker.dump_env OUT_DIR [--state [BACKEND]]``.
Writes ``OUT_DIR/rank<RANK>.json`` with the launcher-set environment (ACCELERATE_*, FSDP_*,
DEEPSPEED*, torchrun's WORLD_SIZE/RANK/...) and, with ``--state``, what accelerate's
PartialState makes of it (``cpu`` as AcceleratorState/TrainingArguments would pass it, and
``backend`` as TrainingArguments(ddp_backend=...) would).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PREFIXES = ("ACCELERATE_", "FSDP_", "DEEPSPEED", "CUDA_VISIBLE_DEVICES")
NAMES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def main() -> None:
    out_dir = Path(sys.argv[1])
    env = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES) or k in NAMES}
    record: dict[str, object] = {"env": env, "pid": os.getpid()}
    rest = sys.argv[2:]
    if rest and rest[0] == "--state":
        from accelerate import PartialState
        from accelerate.utils import parse_flag_from_env

        backend = rest[1] if len(rest) > 1 else None
        state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), backend=backend)
        record["distributed_type"] = str(state.distributed_type.value)
        record["backend"] = state.backend
        record["num_processes"] = state.num_processes
        record["process_index"] = state.process_index
        state.wait_for_everyone()
        state.destroy_process_group()
    (out_dir / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
